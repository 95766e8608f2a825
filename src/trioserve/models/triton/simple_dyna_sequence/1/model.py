"""simple_dyna_sequence: OUTPUT = INPUT + START, plus the correlation id when END."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            # Every input and control input, as int64 (the id is a uint64).
            x = {t.name(): t.as_numpy().astype(np.int64) for t in request.inputs()}
            output = x["INPUT"] + x["START"] + x["END"] * x["CORRID"]
            tensor = pb_utils.Tensor("OUTPUT", output.astype(np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses
