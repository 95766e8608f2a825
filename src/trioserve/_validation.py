"""Checks a decoded request against what its model declares, before it is queued."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ._errors import InvalidArgumentError
from ._model import Model
from ._types import InferenceRequest


def validate_request(model: Model, request: InferenceRequest) -> tuple[int, Hashable]:
    """Check ``request`` against ``model``; return its batch size and batch key.

    Requests batch together only when their inputs agree in name and per-item shape:
    the key is the set of (name, item shape) pairs, the same for every request that sends
    all the inputs of a model whose dims do not vary (``Model.fixed_batch_key``, made
    once). One pass over the inputs checks them, since it runs for every request: each
    input that agrees with the batch size an earlier one set costs one comparison for
    it, and the model's ``max_batch_size`` is read rather than its ``batches`` property.
    """
    declared = model.input_specs
    inputs = request.inputs
    limit = model.max_batch_size  # 0: the model does not batch
    if limit and not inputs:
        _check_required(model, request)
        raise InvalidArgumentError(
            f"a request to model '{model.name}' needs an input: its batch size is the first "
            "dimension of its inputs"
        )
    size = 0 if limit else 1
    for name, tensor in inputs.items():
        try:  # no test for the usual input, a declared one
            spec = declared[name]
        except KeyError:
            raise InvalidArgumentError(
                f"unexpected inference input '{name}' for model '{model.name}'"
            ) from None
        if tensor.datatype is not spec.wire_datatype:
            raise InvalidArgumentError(
                f"inference input '{name}' data-type is '{tensor.datatype.name}', "
                f"but model '{model.name}' expects '{spec.datatype}'"
            )
        shape = tensor.shape
        if limit:
            first = shape[0] if shape else 0
            if first != size or not size:  # else: the batch size an earlier input set
                if not 1 <= first <= limit:
                    raise InvalidArgumentError(
                        f"inference input '{name}' batch size {first} "
                        f"is outside 1..{limit} for model '{model.name}'"
                    )
                if size:
                    raise InvalidArgumentError(
                        f"inputs of a request to model '{model.name}' must share one batch size"
                    )
                size = first
            item = shape[1:]
        else:
            item = shape
        dims = spec.dims
        if item != dims and not fits_dims(dims, item):
            expected = ([-1] if limit else []) + list(dims)
            raise InvalidArgumentError(
                f"unexpected shape for input '{name}' for model '{model.name}'. "
                f"Expected {expected}, got {list(shape)}"
            )
    complete = len(inputs) == len(declared)
    if not complete:
        _check_required(model, request)
    if request.outputs:
        _check_outputs(model, request)
    key = model.fixed_batch_key if complete else None
    if key is None:  # some input's dims vary, or an optional input was left out
        key = frozenset([(name, t.shape[1:] if limit else t.shape) for name, t in inputs.items()])
    return size, key


def fits_dims(dims: Sequence[int], shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` matches declared ``dims`` (-1: any size)."""
    return len(shape) == len(dims) and all(
        d == -1 or d == s for d, s in zip(dims, shape, strict=True)
    )


def _check_required(model: Model, request: InferenceRequest) -> None:
    missing = [s.name for s in model.inputs if not s.optional and s.name not in request.inputs]
    if missing:
        raise InvalidArgumentError(
            f"expected {len(model.inputs)} inputs but got {len(request.inputs)} inputs "
            f"for model '{model.name}'; missing: {', '.join(missing)}"
        )


def _check_outputs(model: Model, request: InferenceRequest) -> None:
    seen: set[str] = set()
    for output in request.outputs:
        if output.name not in model.output_specs:
            raise InvalidArgumentError(
                f"unexpected inference output '{output.name}' for model '{model.name}'"
            )
        if output.name in seen:
            raise InvalidArgumentError(f"output '{output.name}' is requested twice")
        seen.add(output.name)
