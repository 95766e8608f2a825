"""A repository upload's files, decoded from base64 as their text arrives.

A load request's ``file:<path>`` values are base64 strings inside its JSON body; an
upload of hundreds of MiB is never held whole. Each value is decoded as its text arrives
(``Base64Writer``, fed by the body's streaming parse in ``_load_body.py``) into a file of
its own in a staging folder, named by its arrival, not by its path: the path is checked
later by the repository's load, as for files sent over gRPC, and only then
``StagedFile.write_to`` moves the decoded file where the load puts it. Text that is not
base64 stops the decoding, and is reported by that same ``write_to``, so that the load
fails as it would have with the whole text in hand (the model's failure recorded, its
message naming the parameter). The staging folder goes with the request, whatever
happened.
"""

from __future__ import annotations

import binascii
import shutil
from pathlib import Path
from typing import BinaryIO

from .._errors import InvalidArgumentError


class StagedFile:
    """One uploaded file, decoded into the staging folder; ``write_to`` (the repository's
    ``UploadedFile``) moves it into the model's folder, or reports its bad base64."""

    def __init__(self, parameter: str, staged: Path) -> None:
        self.parameter = parameter
        self.staged = staged
        self.valid = True

    def write_to(self, path: Path) -> None:
        if not self.valid:
            raise InvalidArgumentError(f"parameter '{self.parameter}' is not valid base64")
        shutil.move(self.staged, path)  # a rename: the staging folder is on the same disk

    def discard(self) -> None:
        """A later value of the same parameter replaces this one (JSON's last wins)."""
        self.staged.unlink(missing_ok=True)


class Base64Writer:
    """Decodes one value's base64 text, given in pieces cut anywhere, into its staged
    file, accepting exactly what ``binascii.a2b_base64(text, strict_mode=True)`` accepts
    of the whole text: only the alphabet, and padding only at the very end."""

    _PADDING_KEPT = 8  # a longer run of "=" means what this many do

    def __init__(self, file: StagedFile) -> None:
        self._file = file
        self._out: BinaryIO | None = file.staged.open("wb")
        # What is not decoded yet: the last whole quantum, which the text's end is read
        # with (padding is judged by what precedes it), a partial one, and any "=".
        self._carry = ""

    def write(self, text: str) -> None:
        if self._out is None:  # found invalid already: the rest is read and dropped
            return
        text = self._carry + text
        data = text.rstrip("=")
        padding = len(text) - len(data)
        ready = len(data) - len(data) % 4 - 4  # decode all but the last whole quantum
        if ready <= 0:
            self._carry = text[: len(data) + self._PADDING_KEPT]
            return
        if "=" in text[:ready]:  # padding, then more text
            self._invalid()
            return
        self._carry = text[ready : len(data) + min(padding, self._PADDING_KEPT)]
        self._decode(text[:ready])

    def end(self) -> None:
        """The value's closing quote: what is left is decoded as the text's end."""
        if self._out is not None and self._carry:
            self._decode(self._carry)
        self.close()

    def _decode(self, text: str) -> None:
        assert self._out is not None
        try:
            data = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
        except (ValueError, UnicodeEncodeError):
            self._invalid()
            return
        self._out.write(data)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _invalid(self) -> None:
        self._file.valid = False
        self.close()
        self._file.staged.write_bytes(b"")  # free its disk now; the load will refuse it
