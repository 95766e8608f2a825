"""The body of a repository load, parsed as it arrives:

    {"parameters": {"config": "<JSON>", "file:<path>": "<base64>", ...}}

An upload's ``file:`` values can be hundreds of MiB of base64. Parsed whole, the body,
its text and each value would be held at once (four times the body), and the C JSON
parser would hold the GIL over the whole document. ``LoadBody`` is instead fed the body
in pieces cut anywhere (``feed``, then ``finish``): a small JSON push parser that keeps
only the token a piece ends inside, hands each ``file:`` value's text to its
``Base64Writer`` as it comes, and keeps the other strings it needs (keys, ``config``)
whole. Values it has no use for are checked as JSON and dropped.

It accepts what ``json.loads`` accepts (NaN and Infinity too; a repeated key's last value
wins) and, once the body is whole, checks what ``_repository_endpoints`` checked of the
parsed document, in the same order and with the same messages; only the text of a JSON
syntax error's message is its own. Bodies in UTF-16 or UTF-32 are read as
``json.loads`` reads them.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn, Protocol

from .._errors import InvalidArgumentError
from .._served import UploadedFile
from ._staged_files import Base64Writer, StagedFile

_RUN = re.compile(r'[^"\\\x00-\x1f]*')  # string characters that need no attention
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_ESCAPED = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.0-9eE]*")  # a number cut by a piece's end ends in these
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_MAX_DEPTH = 512  # nested containers; json.loads's recursion stops near 1,000

# What a container is to the load (its role), and what it expects next (its state).
_BODY, _PARAMETERS, _SKIPPED = range(3)
_KEY_OR_CLOSE, _KEY, _COLON, _VALUE, _VALUE_OR_CLOSE, _COMMA_OR_CLOSE = range(6)


class _Other:
    """A parameter value that is neither a string nor null (only its kind matters)."""


_OTHER = _Other()
_NOT_OBJECT = _Other()  # "parameters" held something other than an object
Parameter = StagedFile | str | None | _Other


class _Sink(Protocol):
    def write(self, text: str) -> None: ...

    def end(self) -> None: ...

    def close(self) -> None: ...


class _Text:
    """A string kept whole: a key or ``config``."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass

    def value(self) -> str:
        # Escaped surrogate pairs (\ud83d\ude00) were decoded one half at a time:
        # a round trip through UTF-16 joins them, as json.loads would have.
        text = "".join(self.parts)
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


class _Dropped:
    """A string nobody needs: checked as JSON, then forgotten."""

    def write(self, text: str) -> None:
        pass

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


_DROPPED = _Dropped()


class _Container:
    __slots__ = ("close", "key", "role", "state")

    def __init__(self, close: str, role: int, state: int) -> None:
        self.close = close  # "}" or "]"
        self.role = role
        self.state = state
        self.key = ""  # an object's key whose value is expected or being read


class LoadBody:
    """Parses a load request's body fed in pieces; decoded files go to ``staging``."""

    def __init__(self, staging: Path) -> None:
        self._staging = staging
        self._head = b""  # the first bytes, until the encoding can be told
        self._decoder: codecs.IncrementalDecoder | None = None
        self._rest = ""  # text of a token a piece ended inside
        self._offset = 0  # characters before _rest, for error messages
        self._stack: list[_Container] = []
        self._top: bool | None = None  # the document: an object (True), other, none yet
        self._parameters: dict[str, Parameter] | _Other | None = None
        self._sink: _Sink | None = None  # the string being read, if one is
        self._key: _Text | None = None  # ... when that string is a key
        self._files = 0

    def feed(self, data: bytes) -> None:
        if self._decoder is None:
            self._head += data
            if len(self._head) < 4:  # json.detect_encoding looks at four bytes
                return
            data, self._head = self._head, b""
            self._decoder = _decoder(data)
        self._scan(self._decode(data, final=False), final=False)

    def finish(self) -> tuple[str | None, dict[str, UploadedFile]]:
        """The body has ended: its config override and files, or INVALID_ARG."""
        if self._decoder is None:
            self._decoder = _decoder(self._head)
        self._scan(self._decode(self._head, final=True), final=True)
        if self._sink is not None:
            self._fail("Unterminated string", len(self._rest))
        if self._stack:
            self._fail("Expecting value", len(self._rest))
        if self._top is False:
            raise InvalidArgumentError("the request must be a JSON object")
        if isinstance(self._parameters, _Other):
            raise InvalidArgumentError("'parameters' must be a JSON object")
        return _load_parameters(self._parameters or {})

    def close(self) -> None:
        """Let go of the file being written, if any (the staging folder goes later)."""
        if self._sink is not None:
            self._sink.close()

    def _decode(self, data: bytes, final: bool) -> str:
        assert self._decoder is not None
        try:
            return self._decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"malformed JSON in the request: {exc}") from None

    def _scan(self, text: str, final: bool) -> None:
        buf = self._rest + text if self._rest else text
        pos, end = 0, len(buf)
        while True:
            if self._sink is not None:
                pos = self._string(buf, pos, final)
                if self._sink is not None:
                    break  # the piece ended inside the string
                continue
            pos = _WHITESPACE.match(buf, pos).end()  # type: ignore[union-attr]
            if pos == end:
                break
            taken = self._token(buf, pos, final)
            if taken == pos:
                break  # the piece ended inside a number or literal
            pos = taken
        self._offset += pos
        self._rest = buf[pos:]

    def _token(self, buf: str, pos: int, final: bool) -> int:
        """Act on the token at ``pos``; where it ends (``pos`` if cut off)."""
        char = buf[pos]
        if not self._stack:
            if self._top is not None:
                self._fail("Extra data", pos)
            return self._value(buf, pos, final)
        container = self._stack[-1]
        state = container.state
        if state in (_KEY_OR_CLOSE, _KEY):
            if char == "}" and state == _KEY_OR_CLOSE:
                return self._pop(pos)
            if char != '"':
                self._fail("Expecting property name enclosed in double quotes", pos)
            self._key = _Text()
            self._sink = self._key
            return pos + 1
        if state == _COLON:
            if char != ":":
                self._fail("Expecting ':' delimiter", pos)
            container.state = _VALUE
            return pos + 1
        if state == _COMMA_OR_CLOSE:
            if char == container.close:
                return self._pop(pos)
            if char != ",":
                self._fail("Expecting ',' delimiter", pos)
            container.state = _KEY if container.close == "}" else _VALUE
            return pos + 1
        if char == "]" and state == _VALUE_OR_CLOSE:
            return self._pop(pos)
        return self._value(buf, pos, final)

    def _value(self, buf: str, pos: int, final: bool) -> int:
        """A value starts at ``pos``: a container or string opens, a scalar is read."""
        char = buf[pos]
        if char in "{[":
            if len(self._stack) >= _MAX_DEPTH:
                raise InvalidArgumentError("malformed JSON in the request: nested too deeply")
            role = self._container_role(char)
            if char == "{":
                self._stack.append(_Container("}", role, _KEY_OR_CLOSE))
            else:
                self._stack.append(_Container("]", role, _VALUE_OR_CLOSE))
            return pos + 1
        if char == '"':
            self._sink = self._string_sink()
            return pos + 1
        for literal in _LITERALS:
            if buf.startswith(literal, pos):
                self._scalar(None if literal == "null" else _OTHER)
                return pos + len(literal)
            if not final and len(buf) - pos < len(literal) and literal.startswith(buf[pos:]):
                return pos  # cut off: wait for the rest
        if not final and _NUMBER_CHARS.match(buf, pos).end() == len(buf):  # type: ignore[union-attr]
            return pos
        number = _NUMBER.match(buf, pos)
        if number is None:
            self._fail("Expecting value", pos)
        self._scalar(_OTHER)
        return number.end()

    def _string(self, buf: str, pos: int, final: bool) -> int:
        """Hand the string's characters from ``pos`` to its sink, up to its closing
        quote (then the sink is done) or the piece's end; where reading stopped."""
        sink = self._sink
        assert sink is not None
        end = len(buf)
        while True:
            run = _RUN.match(buf, pos).end()  # type: ignore[union-attr]
            if run > pos:
                sink.write(buf[pos:run])
            if run == end:
                return run
            char = buf[run]
            if char == '"':
                self._string_ended()
                return run + 1
            if char != "\\":
                self._fail("Invalid control character at", run)
            escape = _ESCAPE.match(buf, run)
            if escape is None:
                if not final and end - run < 6:
                    return run  # an escape cut off by the piece's end
                self._fail("Invalid \\escape", run)
            text = escape.group()
            sink.write(_ESCAPED[text[1]] if len(text) == 2 else chr(int(text[2:], 16)))
            pos = escape.end()

    def _string_ended(self) -> None:
        sink, self._sink = self._sink, None
        assert sink is not None
        sink.end()
        container = self._stack[-1] if self._stack else None
        if sink is self._key and container is not None:
            container.key = self._key.value()
            container.state = _COLON
            self._key = None
            return
        if isinstance(sink, _Text):  # config
            self._record(sink.value())
        self._value_ended()

    def _container_role(self, char: str) -> int:
        """What the container opening here is to the load."""
        if not self._stack:
            self._top = char == "{"
            return _BODY if self._top else _SKIPPED
        container = self._stack[-1]
        if container.role == _BODY and container.key == "parameters":
            self._drop_parameters()
            if char == "{":
                self._parameters = {}
                return _PARAMETERS
            self._parameters = _NOT_OBJECT
        elif container.role == _PARAMETERS:
            self._record(_OTHER)
        return _SKIPPED

    def _string_sink(self) -> _Sink:
        """Where the string value opening here goes: a staged file for ``file:``, kept
        whole for ``config``, dropped otherwise."""
        if not self._stack:
            self._top = False
            return _DROPPED
        container = self._stack[-1]
        if container.role == _BODY and container.key == "parameters":
            self._drop_parameters()
            self._parameters = _NOT_OBJECT
        elif container.role == _PARAMETERS:
            if container.key.startswith("file:"):
                self._files += 1
                staged = StagedFile(container.key, self._staging / str(self._files))
                self._record(staged)
                return Base64Writer(staged)
            if container.key == "config":
                return _Text()
            self._record(_OTHER)
        return _DROPPED

    def _scalar(self, value: _Other | None) -> None:
        if not self._stack:
            self._top = False
        elif self._stack[-1].role == _PARAMETERS:
            self._record(value)
        elif self._stack[-1].role == _BODY and self._stack[-1].key == "parameters":
            self._drop_parameters()
            self._parameters = _NOT_OBJECT
        self._value_ended()

    def _record(self, value: Parameter) -> None:
        """The parameter being read has ``value``; one of the same name before is gone."""
        parameters = self._parameters
        assert isinstance(parameters, dict)
        key = self._stack[-1].key
        replaced = parameters.get(key)
        if isinstance(replaced, StagedFile) and replaced is not value:
            replaced.discard()
        parameters[key] = value

    def _drop_parameters(self) -> None:
        """A later "parameters" replaces what an earlier one uploaded."""
        if isinstance(self._parameters, dict):
            for value in self._parameters.values():
                if isinstance(value, StagedFile):
                    value.discard()

    def _pop(self, pos: int) -> int:
        self._stack.pop()
        self._value_ended()
        return pos + 1

    def _value_ended(self) -> None:
        if self._stack:
            self._stack[-1].state = _COMMA_OR_CLOSE

    def _fail(self, what: str, pos: int) -> NoReturn:
        raise InvalidArgumentError(
            f"malformed JSON in the request: {what} (char {self._offset + pos})"
        )


def _decoder(head: bytes) -> codecs.IncrementalDecoder:
    # surrogatepass, as json_object decodes: lone surrogates are the model's business
    return codecs.getincrementaldecoder(json.detect_encoding(head))("surrogatepass")


def _load_parameters(
    parameters: Mapping[str, Parameter],
) -> tuple[str | None, dict[str, UploadedFile]]:
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidArgumentError("parameter 'config' must be a JSON string")
    files: dict[str, UploadedFile] = {}
    for key, value in parameters.items():
        if key.startswith("file:"):
            if not isinstance(value, StagedFile):
                raise InvalidArgumentError(f"parameter '{key}' must be a base64 string")
            files[key.removeprefix("file:")] = value
    return config, files
