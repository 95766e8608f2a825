"""simple_sequence: OUTPUT = INPUT + START for each ready request of a sequence."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [self._answer(request) for request in requests]

    @staticmethod
    def _answer(request):
        value, start, ready = (
            pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            for name in ("INPUT", "START", "READY")
        )
        output = ((value + start) * ready).astype(np.int32)
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", output)])
