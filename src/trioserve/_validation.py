"""Checks a decoded request against what its model declares, before it is queued."""

from __future__ import annotations

from collections.abc import Hashable

from ._errors import InvalidArgumentError
from ._model import Model, TensorSpec
from ._types import InferenceRequest


def validate_request(model: Model, request: InferenceRequest) -> None:
    declared = model.input_specs
    for name, tensor in request.inputs.items():
        spec = declared.get(name)
        if spec is None:
            raise InvalidArgumentError(
                f"unexpected inference input '{name}' for model '{model.name}'"
            )
        if tensor.datatype.name != spec.datatype:
            raise InvalidArgumentError(
                f"inference input '{name}' data-type is '{tensor.datatype.name}', "
                f"but model '{model.name}' expects '{spec.datatype}'"
            )
        _check_shape(model, spec, tensor.shape)
    missing = [s.name for s in model.inputs if not s.optional and s.name not in request.inputs]
    if missing:
        raise InvalidArgumentError(
            f"expected {len(model.inputs)} inputs but got {len(request.inputs)} inputs "
            f"for model '{model.name}'; missing: {', '.join(missing)}"
        )
    if model.batches:
        sizes = {tensor.shape[0] for tensor in request.inputs.values()}
        if len(sizes) > 1:
            raise InvalidArgumentError(
                f"inputs of a request to model '{model.name}' must share one batch size"
            )
    seen: set[str] = set()
    for output in request.outputs:
        if output.name not in model.output_specs:
            raise InvalidArgumentError(
                f"unexpected inference output '{output.name}' for model '{model.name}'"
            )
        if output.name in seen:
            raise InvalidArgumentError(f"output '{output.name}' is requested twice")
        seen.add(output.name)


def _check_shape(model: Model, spec: TensorSpec, shape: tuple[int, ...]) -> None:
    dims = spec.dims
    if model.batches:
        if not shape or not 1 <= shape[0] <= model.max_batch_size:
            raise InvalidArgumentError(
                f"inference input '{spec.name}' batch size {shape[0] if shape else 0} "
                f"is outside 1..{model.max_batch_size} for model '{model.name}'"
            )
        item_shape = shape[1:]
    else:
        item_shape = shape
    if len(item_shape) != len(dims) or any(
        d != -1 and d != s for d, s in zip(dims, item_shape, strict=True)
    ):
        expected = ([-1] if model.batches else []) + list(dims)
        raise InvalidArgumentError(
            f"unexpected shape for input '{spec.name}' for model '{model.name}'. "
            f"Expected {expected}, got {list(shape)}"
        )


def batch_key(request: InferenceRequest) -> Hashable:
    """Requests batch together only when their inputs agree in name and item shape."""
    return tuple(sorted((name, t.shape[1:]) for name, t in request.inputs.items()))
