"""Path routing: compiled patterns; a path matched with the wrong method answers 405.

Patterns use ``{name}`` for one path segment. Exact paths are looked up in a dict first,
since the health and metadata probes are the most frequent requests after inference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._errors import InferenceServerError, NotFoundError

H = TypeVar("H")

_SEGMENT = re.compile(r"\{(\w+)\}")


class MethodNotAllowed(InferenceServerError):
    """The path exists but not for this method; ``allow`` lists the methods it takes."""

    def __init__(self, allow: list[str]) -> None:
        super().__init__("Method Not Allowed")
        self.allow = allow


@dataclass
class _Route(Generic[H]):
    pattern: re.Pattern[str]
    handlers: dict[str, H] = field(default_factory=dict)


class Router(Generic[H]):
    def __init__(self) -> None:
        self._exact: dict[str, dict[str, H]] = {}
        self._patterns: dict[str, _Route[H]] = {}

    def add(self, method: str, path: str, handler: H) -> None:
        if "{" not in path:
            self._exact.setdefault(path, {})[method] = handler
            return
        route = self._patterns.get(path)
        if route is None:
            regex = "^" + _SEGMENT.sub(r"(?P<\1>[^/]+)", path) + "$"
            route = self._patterns[path] = _Route(re.compile(regex))
        route.handlers[method] = handler

    def resolve(self, method: str, path: str) -> tuple[H, dict[str, str]]:
        """The handler and path parameters; NOT_FOUND or ``MethodNotAllowed`` otherwise."""
        handlers = self._exact.get(path)
        params: dict[str, str] = {}
        if handlers is None:
            for route in self._patterns.values():
                match = route.pattern.match(path)
                if match is not None:
                    handlers, params = route.handlers, match.groupdict()
                    break
            else:
                raise NotFoundError(f"Not Found: {path}")
        handler = handlers.get(method)
        if handler is None:
            raise MethodNotAllowed(sorted(handlers))
        return handler, params
