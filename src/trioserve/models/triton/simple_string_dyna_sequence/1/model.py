"""simple_string_dyna_sequence: a running sum kept in the sequence's implicit state."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return list(map(_running_sum, requests))


def _running_sum(request):
    def tensor(name):
        return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

    total = (tensor("SUM_IN") + tensor("INPUT")).astype(np.int32)
    output = total.astype(np.int64)
    if tensor("END").item():  # the last request adds its (numeric) string id
        output += int(tensor("CORRID").item())
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("OUTPUT", output.astype(np.int32)),
            pb_utils.Tensor("SUM_OUT", total),
        ]
    )
