"""JSON for REST endpoints: the one way to read a JSON object from a request body, and
the one compact encoder answers are written with."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .._errors import InvalidArgumentError
from .._limits import OFF_LOOP_BYTES

# Answers are written without spaces (what Triton sends, and fewer bytes).
COMPACT = json.JSONEncoder(separators=(",", ":"))

_SPACE = " \t\n\r"  # JSON's whitespace (str.strip() would take more)
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # four times quicker than str.lstrip(_SPACE)

# The decoder's scanner called directly: ``json.loads`` reaches it through three Python
# frames and two regular-expression matches, a third of its time on a small inference
# request. ``json.loads`` still parses anything this rejects, for its error message.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _float(text: str) -> float:
    return float(text)


def _int(text: str) -> int:
    return int(text)


# For large bodies, which are parsed in a worker thread: the C parser holds the GIL for
# the whole document (a second for 40 MiB), so the event loop would wait all the same.
# Numbers read through Python functions give the interpreter its chance to hand the GIL
# over every few milliseconds, for twice the parsing time.
_yielding_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(  # type: ignore[attr-defined]
    parse_float=_float, parse_int=_int
).scan_once


def json_object(text: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """The JSON object ``text`` holds; anything else is INVALID_ARG. (A memoryview: a
    body read in place where a front-end worker wrote it.)"""
    try:
        if isinstance(text, memoryview):
            text = bytes(text)
        if not isinstance(text, str):
            text = text.decode(json.detect_encoding(text), "surrogatepass")
        start = _WHITESPACE.match(text).end() if text[:1] in _SPACE else 0  # type: ignore[union-attr]
        large = len(text) >= OFF_LOOP_BYTES
        try:
            document, end = (_yielding_scan if large else _scan)(text, start)
        except (StopIteration, ValueError) as exc:
            if large:  # parsing again for json.loads's message would cost as much again
                if isinstance(exc, StopIteration):
                    raise json.JSONDecodeError("Expecting value", text, exc.value) from None
                raise
            end = -1
        if end != len(text) and (end < 0 or _WHITESPACE.match(text, end).end() != len(text)):  # type: ignore[union-attr]
            document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"malformed JSON in the request: {exc}") from None
    except RecursionError:  # the decoder bounds its own recursion by the interpreter's
        raise InvalidArgumentError("malformed JSON in the request: nested too deeply") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError("the request must be a JSON object")
    return document


def json_object_or_empty(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """``json_object`` of a body that may be left empty (or blank): then ``{}``."""
    return json_object(body) if bytes(body).strip() else {}
