"""repeat_int32: answers each element of IN in its own response, after its DELAY.

Each request is answered by a thread of its own, so the model instance is free for the
next request at once; a request whose client cancels it stops early.
"""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            if delays.shape != values.shape:
                error = pb_utils.TritonError(
                    f"expected DELAY to have {values.size} elements, got {delays.size}",
                    pb_utils.TritonError.INVALID_ARG,
                )
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            threading.Thread(
                target=_repeat, args=(request, values, delays, int(wait[0])), daemon=True
            ).start()
        return None


def _repeat(request, values, delays, wait_ms):
    sender = request.get_response_sender()
    for index, (value, delay_ms) in enumerate(zip(values, delays, strict=True)):
        time.sleep(int(delay_ms) / 1000)
        if request.is_cancelled():
            break
        out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
        idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))
        sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
    time.sleep(wait_ms / 1000)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
