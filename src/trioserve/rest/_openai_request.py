"""OpenAI completions and chat-completions request bodies, read into what the engine takes.

Both read ``model``, ``stream``, ``stream_options.include_usage`` and ``user``, and the
sampling parameters of the table (``scheduler``'s ``read_parameters``, dialects
``completions`` and ``chat``): OpenAI's names (``n``, ``temperature``, ``top_p``,
``seed``, ``stop``, the penalties...) and vLLM's extensions (``top_k``, ``min_p``,
``ignore_eos``, ``priority``...). Completions take ``prompt`` (a string, a list of token
ids, or a list holding one of those), ``max_tokens`` (default 16) and ``echo``; chat
takes ``messages``, ``max_completion_tokens`` or ``max_tokens`` (default: as many as the
model's length allows), ``echo`` (vLLM's: the answer starts with the last message's
content when that message is the assistant's) and ``add_generation_prompt``.

``null`` reads as absent, as it does for OpenAI. Unknown keys are ignored, as vLLM does;
settings this server cannot honour (``logit_bias``, ``suffix``, tools, a non-text
``response_format``, ``best_of`` other than ``n``) are refused with a 400 naming the
parameter, rather than silently sampling otherwise than asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..scheduler import PARAMETERS, ParameterError, RequestParameters, read_parameters

# The names chat reads the output limit under: none given, the model's room is the limit.
_CHAT_MAX_TOKENS = next(p for p in PARAMETERS if p.name == "max_tokens").wire_names("chat")
# Settings whose only value we honour is their neutral one.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
}


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """What a completions or chat request asks for, in the engine's terms."""

    model: str
    parameters: RequestParameters
    max_tokens_given: bool  # chat's default limit depends on its prompt
    stream: bool
    include_usage: bool  # a last streamed chunk with the usage
    echo: bool


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    text: str | None
    token_ids: tuple[int, ...] | None  # exactly one of the two is set


def requested_model(document: Mapping[str, Any]) -> str:
    model = document.get("model")
    if not isinstance(model, str):
        raise ParameterError("model", "'model' is required and must be a string")
    return model


def read_request(document: Mapping[str, Any], *, chat: bool, max_num_seqs: int) -> OpenAIRequest:
    """The settings common to both endpoints, for a model running ``max_num_seqs``."""
    given = {key: value for key, value in document.items() if value is not None}
    for key, neutral in _NEUTRAL.items():
        if key in given and not any(_same(given[key], value) for value in neutral):
            raise ParameterError(key, f"'{key}' is not supported by this server")
    if "best_of" in given and given["best_of"] != given.get("n", 1):
        raise ParameterError("best_of", "'best_of' is not supported by this server")
    response_format = given.get("response_format", {"type": "text"})
    if not (isinstance(response_format, dict) and response_format.get("type") == "text"):
        raise ParameterError("response_format", "only the 'text' response format is supported")
    parameters = read_parameters(
        given, "chat" if chat else "completions", max_num_seqs=max_num_seqs
    )
    stream = _flag(given, "stream")
    options = given.get("stream_options", {})
    if not isinstance(options, dict):
        raise ParameterError("stream_options", "'stream_options' must be an object")
    if "stream_options" in given and not stream:
        raise ParameterError("stream_options", "'stream_options' needs 'stream': true")
    include_usage = _flag(options, "include_usage")
    if "user" in given and not isinstance(given["user"], str):
        raise ParameterError("user", "'user' must be a string")
    return OpenAIRequest(
        requested_model(document),
        parameters,
        max_tokens_given=not chat or any(key in given for key in _CHAT_MAX_TOKENS),
        stream=stream,
        include_usage=include_usage,
        echo=_flag(given, "echo"),
    )


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
