"""``json_object``: the decoder every REST endpoint reads its JSON body with."""

from __future__ import annotations

import json

import pytest

from trioserve._errors import InvalidArgumentError
from trioserve.rest._json_body import json_object


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, 2.5, "x", null, true]}',
        ' \t\r\n{"a": 1}',  # JSON whitespace before and after the object
        '{"a": 1}\n \t',
        '{"nested": {"deep": [[1], [2, {"k": "v"}]]}, "n": -0.5e3}',
    ],
)
def test_reads_what_json_reads(text: str) -> None:
    expected = json.loads(text)
    assert json_object(text) == expected
    assert json_object(text.encode()) == expected


def test_reads_utf16_and_a_utf8_byte_order_mark_as_json_loads_does() -> None:
    assert json_object('{"é": 1}'.encode("utf-16")) == {"é": 1}
    assert json_object(b'\xef\xbb\xbf{"a": 2}') == {"a": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "Expecting value: line 1 column 1"),
        ("   ", "Expecting value: line 1 column 4"),
        ('{"a": 1} x', "Extra data: line 1 column 10"),
        ('{"a": 1}{}', "Extra data: line 1 column 9"),
        ('{"a": }', "Expecting value: line 1 column 7"),
        ('{"a": 1', "Expecting ',' delimiter"),
        ('\ufeff{"a": 1}', "Unexpected UTF-8 BOM"),
        ('{"a": 1}\u00a0', "Extra data"),  # a no-break space is not JSON whitespace
    ],
)
def test_malformed_json_is_invalid_argument_with_json_s_own_message(
    text: str, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match="malformed JSON in the request") as error:
        json_object(text)
    assert message in error.value.message


def test_bytes_that_are_not_text_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="malformed JSON in the request"):
        json_object(b'{"a": "\xff\xfe\xfd"}')


@pytest.mark.parametrize("text", ["[1, 2]", '"text"', "3", "null"])
def test_json_that_is_not_an_object_is_invalid_argument(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a JSON object"):
        json_object(text)
