"""The one way a REST endpoint reads a JSON object from a request body."""

from __future__ import annotations

import json
from typing import Any

from .._errors import InvalidArgumentError


def json_object(text: bytes | str) -> dict[str, Any]:
    """The JSON object ``text`` holds; anything else is INVALID_ARG."""
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"malformed JSON in the request: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError("the request must be a JSON object")
    return document
