"""JSON for REST endpoints: the one way to read a JSON object from a request body, and
the one compact encoder answers are written with."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .._errors import InvalidArgumentError

# Answers are written without spaces (what Triton sends, and fewer bytes).
COMPACT = json.JSONEncoder(separators=(",", ":"))

_SPACE = " \t\n\r"  # JSON's whitespace (str.strip() would take more)

# The decoder's scanner called directly: ``json.loads`` reaches it through three Python
# frames and two regular-expression matches, a third of its time on a small inference
# request. ``json.loads`` still parses anything this rejects, for its error message.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def json_object(text: bytes | str) -> dict[str, Any]:
    """The JSON object ``text`` holds; anything else is INVALID_ARG."""
    try:
        if not isinstance(text, str):
            text = text.decode(json.detect_encoding(text), "surrogatepass")
        start = len(text) - len(text.lstrip(_SPACE)) if text[:1] in _SPACE else 0
        try:
            document, end = _scan(text, start)
        except (StopIteration, ValueError):
            end = -1
        if end != len(text) and (end < 0 or text[end:].strip(_SPACE)):
            document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"malformed JSON in the request: {exc}") from None
    except RecursionError:  # the decoder bounds its own recursion by the interpreter's
        raise InvalidArgumentError("malformed JSON in the request: nested too deeply") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError("the request must be a JSON object")
    return document
