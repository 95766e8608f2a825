"""Helpers for testing against a real trioserve: a server on a background thread."""

from ._thread import server_in_thread

__all__ = ["server_in_thread"]
