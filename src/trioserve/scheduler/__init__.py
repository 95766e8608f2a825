"""Schedulers: what stands between a model and the front ends.

Two halves, one public face (everything else here is private, and
``tests/test_package.py`` holds the rest of the package to that):

- the tensor half: ``ModelRunner`` (dynamic batching), ``SequenceRunner`` (the sequence
  batcher), ``DecoupledRunner`` (many responses per request), picked by
  ``runner_class``; ``ResponseCache``, the response cache they share;
- the LLM half: ``GenerativeRunner`` and its ``LLMEngine`` (continuous batching), the
  request and chunk types front ends speak (``GenerationRequest``, ``GenerationChunk``,
  ``TokenLogprob``...), the sampling-parameter table every front end reads requests'
  parameters with (``read_parameters``), ``IterationStats`` for the metrics, ``call_tokenizer`` to
  tokenize off the event loop.
"""

from ._cache import ResponseCache, cache_size_from_flags
from ._decoupled_runner import DecoupledRunner
from ._engine import LLMEngine
from ._generation import (
    GenerationChunk,
    GenerationRequest,
    GenerativeServed,
    TokenLogprob,
    generative,
)
from ._generation_input import (
    TEXT_INPUT,
    RequestIds,
    generation_request,
    prompt_and_parameters,
)
from ._generative_runner import GenerativeRunner
from ._llm_stats import FinishedRequest, IterationStats
from ._model_calls import Tokenizer, call_tokenizer
from ._runner import ModelRunner
from ._runners import runner_class
from ._sampling_params import (
    MAX_LOGPROBS,
    PARAMETERS,
    ParameterError,
    RequestParameters,
    SamplingParams,
    read_parameters,
)
from ._sequence_runner import SequenceRunner
from ._ticket import Ticket

__all__ = [
    "MAX_LOGPROBS",
    "PARAMETERS",
    "TEXT_INPUT",
    "DecoupledRunner",
    "FinishedRequest",
    "GenerationChunk",
    "GenerationRequest",
    "GenerativeRunner",
    "GenerativeServed",
    "IterationStats",
    "LLMEngine",
    "ModelRunner",
    "ParameterError",
    "RequestIds",
    "RequestParameters",
    "ResponseCache",
    "SamplingParams",
    "SequenceRunner",
    "Ticket",
    "TokenLogprob",
    "Tokenizer",
    "cache_size_from_flags",
    "call_tokenizer",
    "generation_request",
    "generative",
    "prompt_and_parameters",
    "read_parameters",
    "runner_class",
]
