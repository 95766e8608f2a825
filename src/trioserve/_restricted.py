"""Restricted APIs: endpoint groups that answer only requests carrying a given header.

Triton's ``--http-restricted-api`` and ``--grpc-restricted-protocol`` take
``<api>[,<api>...]:<key>=<value>``; a request to a restricted group must carry header
(or gRPC metadata) ``key`` with exactly ``value``. A deployment uses it to keep untrusted
clients from, for example, mapping host memory through the shared-memory API.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The groups this server can restrict; "model-repository" guards the repository API,
# "trace" and "logging" the trace and logging extensions' settings.
RESTRICTABLE_APIS = ("shared-memory", "model-repository", "trace", "logging")


@dataclass(frozen=True, slots=True)
class Restriction:
    """The header a restricted request must carry. ``key`` is lower-case: HTTP header
    names are case-insensitive and gRPC metadata keys are lower-case on the wire."""

    key: str
    value: str

    def allows(self, value: str | None) -> bool:
        # In constant time: how long a wrong guess takes to refuse tells nothing of the value.
        return value is not None and hmac.compare_digest(_utf8(value), _utf8(self.value))

    def message(self) -> str:
        return f"This API is restricted, expecting header '{self.key}'"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def parse_restrictions(specs: Iterable[str]) -> dict[str, Restriction]:
    """``["shared-memory:admin-key=secret", ...]`` -> {api: Restriction}; ValueError if bad."""
    restrictions: dict[str, Restriction] = {}
    for spec in specs:
        apis, _, header = spec.partition(":")
        key, equals, value = header.partition("=")
        if not apis or not key or not equals:
            raise ValueError(f"restricted API {spec!r} is not <api>[,<api>...]:<key>=<value>")
        for api in apis.split(","):
            if api not in RESTRICTABLE_APIS:
                raise ValueError(
                    f"unknown restricted API {api!r}; one of {', '.join(RESTRICTABLE_APIS)}"
                )
            if api in restrictions:
                raise ValueError(f"restricted API {api!r} is given twice")
            restrictions[api] = Restriction(key.strip().lower(), value)
    return restrictions


def check_restrictions(restrictions: Mapping[str, Restriction]) -> None:
    """ValueError unless every entry names a restrictable API (for hand-built configs)."""
    for api, restriction in restrictions.items():
        if api not in RESTRICTABLE_APIS or not isinstance(restriction, Restriction):
            raise ValueError(f"invalid restricted API {api!r}: {restriction!r}")
