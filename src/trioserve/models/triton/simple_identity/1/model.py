"""simple_identity: answers each request's BYTES input as its output."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    )
                ]
            )
            for r in requests
        ]
