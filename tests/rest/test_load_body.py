"""The streaming parse of a repository load's body (``_load_body.LoadBody``), fed pieces
cut anywhere: it must read what ``json.loads`` reads of the whole body, files decoded
byte for byte, and refuse what it refuses, wherever the cuts fall."""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve._errors import InvalidArgumentError
from trioserve.rest._load_body import LoadBody
from trioserve.rest._staged_files import Base64Writer, StagedFile

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Parameters other than config and files: any JSON, which the parse checks and drops.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
paths = st.text("ab/._1", min_size=1, max_size=8)


def parse(body: bytes, cuts: list[int]) -> tuple[str | None, dict[str, bytes]] | str:
    """What the body loads: (config, path -> decoded bytes), or the error's message."""
    with tempfile.TemporaryDirectory() as folder:
        parsed = LoadBody(Path(folder))
        try:
            start = 0
            for cut in [*sorted(cuts), len(body)]:
                parsed.feed(body[start:cut])
                start = cut
            config, files = parsed.finish()
            contents = {}
            for index, (path, file) in enumerate(files.items()):
                target = Path(folder) / f"out{index}"
                file.write_to(target)
                contents[path] = target.read_bytes()
            return config, contents
        except InvalidArgumentError as exc:
            return exc.message
        finally:
            parsed.close()


def cut_points(body: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(body)), max_size=12)


def encode(document: Any, ascii_only: bool, escape_slashes: bool) -> bytes:
    text = json.dumps(document, ensure_ascii=ascii_only)
    return (text.replace("/", "\\/") if escape_slashes else text).encode()


@SETTINGS
@given(
    files=st.dictionaries(paths, st.binary(max_size=300), max_size=3),
    config=st.none() | st.text(),
    others=st.dictionaries(st.text().filter(lambda k: k != "config"), json_values, max_size=3),
    top=st.dictionaries(st.text().filter(lambda k: k != "parameters"), json_values, max_size=2),
    ascii_only=st.booleans(),
    escape_slashes=st.booleans(),
    data=st.data(),
)
def test_pieces_cut_anywhere_load_what_the_whole_body_holds(
    files: dict[str, bytes],
    config: str | None,
    others: dict[str, Any],
    top: dict[str, Any],
    ascii_only: bool,
    escape_slashes: bool,
    data: st.DataObject,
) -> None:
    parameters = {k: v for k, v in others.items() if not k.startswith("file:")}
    parameters["config"] = config
    parameters |= {f"file:{path}": base64.b64encode(b).decode() for path, b in files.items()}
    body = encode({**top, "parameters": parameters}, ascii_only, escape_slashes)
    assert parse(body, data.draw(cut_points(body))) == (config, files)


@SETTINGS
@given(
    document=st.dictionaries(
        st.sampled_from(["parameters", "x"]),
        st.dictionaries(st.sampled_from(["config", "file:a", "file:b", "y"]), json_values),
    )
    | json_values,
    mangle=st.sampled_from(["", "truncate", "byte", "insert"]),
    data=st.data(),
)
def test_any_body_reads_the_same_whole_or_in_pieces(
    document: Any, mangle: str, data: st.DataObject
) -> None:
    """Valid or not (truncated, a byte changed or added), cuts change nothing: the same
    files, or the same error."""
    body = bytearray(json.dumps(document).encode())
    if mangle and body:
        at = data.draw(st.integers(0, len(body) - 1))
        if mangle == "truncate":
            del body[at:]
        elif mangle == "byte":
            body[at] = data.draw(st.sampled_from(b'{}[]:,"\\ 0aeE-+.ntf'))
        else:
            body.insert(at, data.draw(st.sampled_from(b'{}[]:,"\\ 0-')))
    whole = parse(bytes(body), [])
    assert parse(bytes(body), data.draw(cut_points(bytes(body)))) == whole
    try:
        json.loads(body)
    except ValueError:
        if body.strip():  # an empty body loads nothing, as before
            assert isinstance(whole, str) and whole.startswith("malformed JSON in the request")


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"[1]", "the request must be a JSON object"),
        (b'{"parameters": null}', "'parameters' must be a JSON object"),
        (b'{"parameters": {"config": 5}}', "parameter 'config' must be a JSON string"),
        (b'{"parameters": {"file:a": []}}', "parameter 'file:a' must be a base64 string"),
        (b'{"parameters": {"file:a": "QUJD"}} {}', "malformed JSON in the request: Extra data"),
        (b'{"parameters": {"file:a": "QUJD', "malformed JSON in the request: Unterminated"),
        (b'{"parameters": {"config": "\\x"}}', "malformed JSON in the request: Invalid \\escape"),
        (b"[" * 600, "malformed JSON in the request: nested too deeply"),
        (b'{"a": "\xff"}', "malformed JSON in the request: 'utf-8' codec can't decode"),
    ],
)
def test_what_is_refused(body: bytes, error: str) -> None:
    for cuts in ([], list(range(len(body)))):  # whole, and a byte at a time
        message = parse(body, cuts)
        assert isinstance(message, str) and message.startswith(error), message


@pytest.mark.parametrize("bad", ["QUJD=A==", "QUJ", "QUJD\n", "QUJDé", "QQ==QUJD", "===="])
def test_bad_base64_is_found_wherever_the_cuts_fall(bad: str) -> None:
    body = json.dumps({"parameters": {"file:a": bad}}).encode()
    for cuts in ([], list(range(len(body)))):
        assert parse(body, cuts) == "parameter 'file:a' is not valid base64"


def test_a_repeated_parameter_keeps_its_last_value() -> None:
    """As json.loads: the last "file:a", and the files of the last "parameters" only."""
    body = (
        b'{"parameters": {"file:a": "QUJD", "file:b": "QUJD", "file:a": "REVG"},'
        b' "parameters": {"file:c": "R0hJ", "config": "{}"}}'
    )
    assert parse(body, []) == ("{}", {"c": b"GHI"})
    assert parse(body[: body.index(b', "parameters"')] + b"}", []) == (
        None,
        {"a": b"DEF", "b": b"ABC"},
    )


def test_utf16_bodies_are_read_as_json_loads_reads_them() -> None:
    body = json.dumps({"parameters": {"config": "é", "file:x": "QUJD"}}).encode("utf-16")
    assert parse(body, [1, 3, 7]) == ("é", {"x": b"ABC"})


def test_base64_in_pieces_is_judged_as_the_whole_text(tmp_path: Path) -> None:
    """Every text of up to 7 characters from "QA=" (valid or not, padded anywhere), cut
    at each single place and at every place: accepted and decoded exactly as
    ``a2b_base64(whole, strict_mode=True)`` decodes it; long "=" runs too."""

    def whole(text: str) -> bytes | None:
        try:
            return binascii.a2b_base64(text.encode(), strict_mode=True)
        except ValueError:
            return None

    def streamed(text: str, cuts: list[int]) -> bytes | None:
        file = StagedFile("file:a", tmp_path / "staged")
        writer = Base64Writer(file)
        for start, end in itertools.pairwise([0, *cuts, len(text)]):
            writer.write(text[start:end])
        writer.end()
        return file.staged.read_bytes() if file.valid else None

    texts = ["".join(c) for n in range(8) for c in itertools.product("QA=", repeat=n)]
    texts += ["QUJD" + "=" * 20, "QQ" + "=" * 20, "QUJD" + "=" * 20 + "QUJD", "=" * 20]
    for text in texts:
        for cuts in [[], list(range(1, len(text))), *([i] for i in range(1, len(text)))]:
            assert streamed(text, cuts) == whole(text), (text, cuts)
