"""Path routing: compiled patterns; a path matched with the wrong method answers 405.

Patterns use ``{name}`` for one whole path segment. A pattern compiles to its segments;
a path is split once and compared only with the patterns of its segment count. When
several match, the one with the most literal segments wins (``/v2/models/stats`` over
``/v2/models/{model}``), whatever order they were added in. Resolved paths are
remembered, so the comparison runs once per distinct path, not on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._errors import NotFoundError
from ._errors import method_not_allowed

Handler = TypeVar("Handler")
_SEEN_LIMIT = 1024


@dataclass
class _Route(Generic[Handler]):
    literals: tuple[tuple[int, str], ...]  # (segment index, text) that must match exactly
    captures: tuple[tuple[int, str], ...]  # (segment index, parameter name)
    handlers: dict[str, Handler] = field(default_factory=dict)


class Router(Generic[Handler]):
    def __init__(self) -> None:
        self._by_length: dict[int, dict[str, _Route[Handler]]] = {}
        # Paths seen before, to their route and parameters: the same few model URLs
        # arrive again and again. Bounded, since clients choose the paths.
        self._seen: dict[str, tuple[_Route[Handler], dict[str, str]]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        segments = path.split("/")
        routes = self._by_length.setdefault(len(segments), {})
        route = routes.get(path)
        if route is None:
            literals, captures = [], []
            for index, segment in enumerate(segments):
                if segment.startswith("{") and segment.endswith("}"):
                    captures.append((index, segment[1:-1]))
                else:
                    literals.append((index, segment))
            route = routes[path] = _Route(tuple(literals), tuple(captures))
        route.handlers[method] = handler

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler and path parameters; NOT_FOUND, or an ``HttpError`` 405 for a path
        that does not take ``method``."""
        found = self._seen.get(path)
        if found is None:
            found = self._match(path)
            if len(self._seen) >= _SEEN_LIMIT:
                self._seen.clear()
            self._seen[path] = found
        route, params = found
        handler = route.handlers.get(method)
        if handler is None:
            raise method_not_allowed(sorted(route.handlers))
        return handler, params

    def _match(self, path: str) -> tuple[_Route[Handler], dict[str, str]]:
        segments = path.split("/")
        best: _Route[Handler] | None = None
        for route in self._by_length.get(len(segments), {}).values():
            if (
                (best is None or len(route.literals) > len(best.literals))
                and all(segments[i] == text for i, text in route.literals)
                and all(segments[i] for i, _ in route.captures)
            ):
                best = route
        if best is None:
            raise NotFoundError(f"Not Found: {path}")
        return best, {name: segments[i] for i, name in best.captures}
