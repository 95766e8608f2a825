"""Chat messages made into one prompt: the model's Jinja chat template, or the default.

A model's template is the ``chat_template`` of its Hugging Face ``tokenizer_config.json``
(``GenerativeModel.chat_template``). It is rendered as the ecosystem renders it: a
sandboxed, immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
variables ``messages``, ``add_generation_prompt`` and the model's special tokens
(``bos_token``, ``eos_token``...), a ``raise_exception(message)`` function (its message
becomes the client's 400) and a ``tojson`` filter that keeps non-ASCII text as it is.

A model without a template gets ``DEFAULT_CHAT_TEMPLATE``: one ``role: content`` line
per message, then ``assistant:`` to prompt the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .._errors import InvalidArgumentError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class _TemplateError(Exception):
    """Raised by a template's ``raise_exception``: the messages do not fit the template."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    environment.filters["tojson"] = _tojson
    return environment.from_string(source)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    template: str | None,
    special_tokens: Mapping[str, str],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for ``messages`` (already checked: each has a role and text content)."""
    source = template or DEFAULT_CHAT_TEMPLATE
    try:
        compiled = _compiled(source)
    except jinja2.TemplateError as exc:
        raise InvalidArgumentError(f"the model's chat template does not compile: {exc}") from None
    try:
        return compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except _TemplateError as exc:
        raise InvalidArgumentError(f"the chat template refused the messages: {exc}") from None
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"the chat template failed on the messages: {exc}") from None
