"""Triton's logging extension over the stdlib ``logging`` module: logger ``trioserve``
and everything under it (the scheduler's, the Python backend's models').

    log_file            "" (standard error) or a file to append to
    log_info            INFO records pass
    log_warning         WARNING records pass
    log_error           ERROR and CRITICAL records pass
    log_verbose_level   0: no verbose records; N: DEBUG and the N-1 levels below it
    log_format          "default" (I1126 08:17:17.123456 4242 _server.py:120] ...) or
                        "ISO8601" (2026-11-26T08:17:17Z I 4242 _server.py:120] ...)

The server takes the logger over (a handler of its own; records stop propagating to the
root's) when it starts with a ``LogConfig`` (``trioserve run`` always does) or when a
client first changes a setting; an embedding application's logging is left alone until
then. A change applies to the next record; ``close`` gives the logger back as it was.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ._errors import InvalidArgumentError

FORMATS = ("default", "ISO8601")
_LOGGER = "trioserve"


@dataclass(frozen=True)
class LogConfig:
    file: str = ""
    info: bool = True
    warning: bool = True
    error: bool = True
    verbose_level: int = 0
    format: Literal["default", "ISO8601"] = "default"

    def __post_init__(self) -> None:
        if self.verbose_level < 0:
            raise ValueError("log verbose level must be >= 0")
        if self.format not in FORMATS:
            raise ValueError(f"log format must be one of {', '.join(FORMATS)}")


# Setting name -> (LogConfig's field, the JSON type it takes).
_SETTINGS: dict[str, tuple[str, type]] = {
    "log_file": ("file", str),
    "log_info": ("info", bool),
    "log_warning": ("warning", bool),
    "log_error": ("error", bool),
    "log_verbose_level": ("verbose_level", int),
    "log_format": ("format", str),
}


class LogControl:
    """The running server's log settings."""

    def __init__(self, config: LogConfig | None) -> None:
        self.config = LogConfig() if config is None else config
        self._handler: logging.Handler | None = None
        self._saved: tuple[bool, int] | None = None  # the logger's propagate and level
        if config is not None:
            self._install()

    def settings(self) -> dict[str, Any]:
        return {name: getattr(self.config, field) for name, (field, _) in _SETTINGS.items()}

    def update(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a POST's settings at once; InvalidArgumentError changes nothing."""
        fields: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in _SETTINGS:
                raise InvalidArgumentError(f"unknown log setting '{name}'")
            field, kind = _SETTINGS[name]
            if type(value) is not kind:
                raise InvalidArgumentError(
                    f"log setting '{name}' takes a {_KIND_NAMES[kind]}, got {value!r}"
                )
            fields[field] = value
        try:
            config = replace(self.config, **fields)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if config.file != self.config.file and config.file:
            try:
                open(config.file, "a").close()
            except OSError as exc:
                raise InvalidArgumentError(f"cannot open log file '{config.file}': {exc}") from None
        self.config = config
        self._install()
        return self.settings()

    def _install(self) -> None:
        config = self.config
        logger = logging.getLogger(_LOGGER)
        if self._saved is None:
            self._saved = (logger.propagate, logger.level)
        handler: logging.Handler
        if config.file:
            handler = logging.FileHandler(config.file)
        else:
            handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TritonFormatter(config.format))
        handler.addFilter(self._passes)
        self._remove_handler()
        self._handler = handler
        logger.addHandler(handler)
        logger.propagate = False
        # Verbose level N lets DEBUG (10) and the N-1 levels below it through.
        logger.setLevel(
            logging.DEBUG + 1 - config.verbose_level if config.verbose_level else logging.INFO
        )

    def _passes(self, record: logging.LogRecord) -> bool:
        config = self.config
        level = record.levelno
        if level >= logging.ERROR:
            return config.error
        if level >= logging.WARNING:
            return config.warning
        if level >= logging.INFO:
            return config.info
        return True  # verbose: the logger's level already chose

    def _remove_handler(self) -> None:
        if self._handler is not None:
            logging.getLogger(_LOGGER).removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def close(self) -> None:
        """Give the logger back as the server found it."""
        self._remove_handler()
        if self._saved is not None:
            logger = logging.getLogger(_LOGGER)
            logger.propagate, level = self._saved
            logger.setLevel(level)
            self._saved = None


_KIND_NAMES = {str: "string", bool: "boolean", int: "non-negative integer"}


class TritonFormatter(logging.Formatter):
    """Triton's log line: level letter, time, process, file:line, message."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self._iso = style == "ISO8601"

    def format(self, record: logging.LogRecord) -> str:
        letter = "V" if record.levelno < logging.INFO else record.levelname[0]
        where = f"{record.process} {record.filename}:{record.lineno}]"
        if self._iso:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            head = f"{stamp} {letter} {where}"
        else:
            local = time.localtime(record.created)
            micros = int(record.msecs * 1000)
            head = f"{letter}{time.strftime('%m%d %H:%M:%S', local)}.{micros:06d} {where}"
        text = f"{head} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text
