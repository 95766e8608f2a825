"""A model's outputs for one request as the response the front end sends: the outputs
the request asked for (all declared ones if none), each in its declared datatype."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .._errors import InternalError
from .._model import Model, Outputs, ResponseOutputs
from .._tensor import datatype_of
from .._types import InferenceRequest, InferenceResponse, OutputTensor
from ..shm import is_device_array


def response_of(
    model: Model, version: str, request: InferenceRequest, outputs: Outputs
) -> InferenceResponse:
    """The response; InternalError when the outputs do not fit the model's config."""
    declared = model.output_specs
    wanted = request.outputs
    # The usual request asks for no output by name: every declared one, no parameters.
    names: Iterable[str] = [o.name for o in wanted] if wanted else declared
    tensors = []
    for name in names:
        try:  # rather than ``in`` first: a test less for every output
            produced = outputs[name]
        except KeyError:
            raise InternalError(f"model '{model.name}' did not produce output '{name}'") from None
        dt = declared[name].wire_datatype
        # A GPU model's cupy array stays on the device: the front end copies it into a
        # CUDA region directly, or to the host for the wire.
        if type(produced) is np.ndarray or is_device_array(produced):
            array = produced
        else:
            array = np.asarray(produced)
        if dt.is_bytes:
            if datatype_of(array) is not dt:
                raise InternalError(
                    f"model '{model.name}': output '{name}' is declared BYTES but is {array.dtype}"
                )
        elif array.dtype != dt.dtype:
            array = array.astype(dt.dtype)
        tensors.append(OutputTensor(name, dt, array, {}))
    if wanted:  # each output the client named carries the parameters it attached
        parameters = {o.name: o.parameters for o in wanted}
        for tensor in tensors:
            tensor.parameters = parameters[tensor.name]
    extra = outputs.parameters if isinstance(outputs, ResponseOutputs) else {}
    return InferenceResponse(model.name, version, tensors, request.id, extra)
