"""OpenAI completions and chat-completions request bodies, read into what the engine takes.

Both read ``model``, ``n``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage`` and ``user`` (OpenAI's names), plus vLLM's extensions
``top_k``, ``ignore_eos`` and ``priority``. Completions take ``prompt`` (a string, a
list of token ids, or a list holding one of those), ``max_tokens`` (default 16) and
``echo``; chat takes ``messages``, ``max_completion_tokens`` or ``max_tokens`` (default:
as many as the model's length allows), ``echo`` (vLLM's: the answer starts with the last
message's content when that message is the assistant's) and ``add_generation_prompt``.

``null`` reads as absent, as it does for OpenAI. Unknown keys are ignored, as vLLM does;
settings this server cannot honour (penalties, ``logit_bias``, ``suffix``, tools, a
non-text ``response_format``, ``best_of`` other than ``n``) are refused with
a 400 naming the parameter, rather than silently sampling otherwise than asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgumentError

# Sampling keys passed to the engine's parameters under the same name.
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "n", "priority")
# Settings whose only value we honour is their neutral one.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
}


class ParameterError(InvalidArgumentError):
    """A bad request parameter; OpenAI's error object names it in ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """What a completions or chat request asks for, in the engine's terms."""

    model: str
    parameters: dict[str, Any]  # the engine's sampling parameters (vLLM's names)
    stream: bool
    include_usage: bool  # a last streamed chunk with the usage
    echo: bool


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    text: str | None
    token_ids: tuple[int, ...] | None  # exactly one of the two is set


def read_request(document: Mapping[str, Any], *, default_max_tokens: int | None) -> OpenAIRequest:
    """The settings common to both endpoints (``default_max_tokens`` None: no limit asked)."""
    given = {key: value for key, value in document.items() if value is not None}
    model = given.get("model")
    if not isinstance(model, str):
        raise ParameterError("model", "'model' is required and must be a string")
    for key, neutral in _NEUTRAL.items():
        if key in given and not any(_same(given[key], value) for value in neutral):
            raise ParameterError(key, f"'{key}' is not supported by this server")
    if "best_of" in given and given["best_of"] != given.get("n", 1):
        raise ParameterError("best_of", "'best_of' is not supported by this server")
    response_format = given.get("response_format", {"type": "text"})
    if not (isinstance(response_format, dict) and response_format.get("type") == "text"):
        raise ParameterError("response_format", "only the 'text' response format is supported")
    parameters = {key: given[key] for key in _SAMPLING_KEYS if key in given}
    max_tokens = given.get("max_completion_tokens", given.get("max_tokens", default_max_tokens))
    if max_tokens is not None:
        parameters["max_tokens"] = max_tokens
    stream = _flag(given, "stream")
    options = given.get("stream_options", {})
    if not isinstance(options, dict):
        raise ParameterError("stream_options", "'stream_options' must be an object")
    if "stream_options" in given and not stream:
        raise ParameterError("stream_options", "'stream_options' needs 'stream': true")
    include_usage = _flag(options, "include_usage")
    if "user" in given and not isinstance(given["user"], str):
        raise ParameterError("user", "'user' must be a string")
    return OpenAIRequest(model, parameters, stream, include_usage, _flag(given, "echo"))


def completion_prompt(document: Mapping[str, Any]) -> CompletionPrompt:
    """The one prompt of a completions request: text or token ids."""
    prompt = document.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return CompletionPrompt(prompt, None)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return CompletionPrompt(None, tuple(prompt))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise ParameterError("prompt", "one prompt per request: send each prompt on its own")
    raise ParameterError(
        "prompt", "'prompt' must be a string or a non-empty list of token ids (integers)"
    )


def chat_messages(document: Mapping[str, Any]) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` with text content (parts joined)."""
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ParameterError("messages", "'messages' must be a non-empty list")
    read = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ParameterError(f"messages[{i}]", f"messages[{i}] must be an object with a role")
        read.append({"role": message["role"], "content": _text(message.get("content"), i)})
    return read


def _text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ParameterError(
                    f"messages[{i}].content", "only text content parts are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ParameterError(f"messages[{i}].content", "a text part needs its 'text'")
            parts.append(text)
        return "".join(parts)
    raise ParameterError(f"messages[{i}].content", "content must be a string or a list of parts")


def _flag(document: Mapping[str, Any], key: str) -> bool:
    value = document.get(key, False)
    if value is None:
        return False
    if type(value) is not bool:
        raise ParameterError(key, f"'{key}' must be a boolean")
    return value


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and bool(value == neutral)


def prompt_ids_in_vocabulary(ids: Sequence[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        raise ParameterError("prompt", "this model takes text prompts only")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ParameterError(
            "prompt", f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
        )
