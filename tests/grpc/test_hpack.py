"""HPACK: our decoder against RFC 7541's examples and the ``hpack`` package, our encoder back."""

from __future__ import annotations

import contextlib

import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.grpc._hpack import (
    HeaderDecoder,
    HeaderListTooLarge,
    HpackError,
    encode_headers,
)

# --------------------------------------------------------------------------- RFC 7541 Appendix C

AUTHORITY = (b":authority", b"www.example.com")
CACHE_NO = (b"cache-control", b"no-cache")
CUSTOM = (b"custom-key", b"custom-value")
REQUESTS = [  # C.3 / C.4: three requests on one connection; the table after each
    (
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), AUTHORITY],
        [AUTHORITY],
    ),
    (
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), AUTHORITY, CACHE_NO],
        [CACHE_NO, AUTHORITY],
    ),
    (
        [
            (b":method", b"GET"),
            (b":scheme", b"https"),
            (b":path", b"/index.html"),
            AUTHORITY,
            CUSTOM,
        ],
        [CUSTOM, CACHE_NO, AUTHORITY],
    ),
]
C3 = [
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
]
C4 = [
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
]

PRIVATE = (b"cache-control", b"private")
DATE_21 = (b"date", b"Mon, 21 Oct 2013 20:13:21 GMT")
DATE_22 = (b"date", b"Mon, 21 Oct 2013 20:13:22 GMT")
LOCATION = (b"location", b"https://www.example.com")
GZIP = (b"content-encoding", b"gzip")
COOKIE = (b"set-cookie", b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")
RESPONSES = [  # C.5 / C.6: three responses, table limited to 256 octets
    (
        [(b":status", b"302"), PRIVATE, DATE_21, LOCATION],
        [LOCATION, DATE_21, PRIVATE, (b":status", b"302")],
    ),
    (
        [(b":status", b"307"), PRIVATE, DATE_21, LOCATION],
        [(b":status", b"307"), LOCATION, DATE_21, PRIVATE],
    ),
    ([(b":status", b"200"), PRIVATE, DATE_22, LOCATION, GZIP, COOKIE], [COOKIE, GZIP, DATE_22]),
]
C5 = [
    "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a"
    " 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "4803 3330 37c1 c0bf",
    "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04"
    " 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49"
    " 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
]
C6 = [
    "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e"
    " 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
    "4883 640e ffc1 c0bf",
    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7"
    " 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed"
    " 4ee5 b106 3d50 07",
]


@pytest.mark.parametrize(
    ("blocks", "expected", "table_size"),
    [
        pytest.param(C3, REQUESTS, 4096, id="C.3"),
        pytest.param(C4, REQUESTS, 4096, id="C.4-huffman"),
        pytest.param(C5, RESPONSES, 256, id="C.5"),
        pytest.param(C6, RESPONSES, 256, id="C.6-huffman"),
    ],
)
def test_rfc7541_examples(blocks, expected, table_size):
    decoder = HeaderDecoder(max_table_size=table_size)
    for block, (headers, table) in zip(blocks, expected, strict=True):
        assert decoder.decode(bytes.fromhex(block)) == tuple(headers)
        assert decoder.table == tuple(table)


# --------------------------------------------------------------------------- against hpack

names = st.one_of(
    st.sampled_from([b":path", b":authority", b"content-type", b"te", b"grpc-timeout", b"x-bin"]),
    st.binary(max_size=40),
)
header_lists = st.lists(st.tuples(names, st.binary(max_size=300)), max_size=12)


def _encode(encoder: hpack.Encoder, headers, huffman: bool, sensitive: bool) -> bytes:
    if sensitive:
        headers = [hpack.NeverIndexedHeaderTuple(n, v) for n, v in headers]
    return encoder.encode(headers, huffman=huffman)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(
        st.tuples(
            header_lists, st.booleans(), st.booleans(), st.sampled_from([None, 0, 100, 4096])
        ),
        min_size=1,
        max_size=6,
    )
)
def test_decodes_what_hpack_encodes(blocks):
    """A connection's worth of blocks: dynamic table use, never-indexed fields, size updates."""
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(max_header_list_size=1 << 20)
    oracle = hpack.Decoder(max_header_list_size=1 << 20)
    for headers, huffman, sensitive, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size
        block = _encode(encoder, headers, huffman, sensitive)
        decoded = decoder.decode(block)
        assert decoded == tuple(headers)
        assert list(decoded) == oracle.decode(block, raw=True)
        assert decoder.table == tuple(tuple(e) for e in encoder.header_table.dynamic_entries)


@settings(max_examples=100)
@given(headers=header_lists)
def test_encoder_output_reads_the_same_on_any_connection(headers):
    block = encode_headers(headers)
    used = HeaderDecoder()
    used.decode(hpack.Encoder().encode([(b"x-filler", b"y" * 100)]))
    assert HeaderDecoder().decode(block) == used.decode(block) == tuple(headers)
    oracle = hpack.Decoder()
    assert oracle.decode(block, raw=True) == list(headers)
    assert len(oracle.header_table.dynamic_entries) == 0


def test_encoder_uses_the_static_table():
    assert encode_headers([(b":status", b"200")]) == b"\x88"
    assert encode_headers([(b"content-type", b"application/grpc")]) == (
        b"\x0f\x10\x10application/grpc"  # name index 31 = 15 + 16, literal value
    )
    long_name = b"n" * 200
    block = encode_headers([(long_name, b"v")])
    assert block[:3] == b"\x00\x7f\x49"  # 200 = 127 + 73
    assert HeaderDecoder().decode(block) == ((long_name, b"v"),)


# --------------------------------------------------------------------------- malformed blocks

MALFORMED = {
    "integer overflow": b"\xff" + b"\xff" * 6 + b"\x01",
    "integer truncated": b"\xff\x80",
    "index 0": b"\x80",
    "index past the empty dynamic table": b"\xbe",
    "index far out of range": b"\xff\xff\x7f",
    "name index out of range": b"\x7e\x01a",
    "huffman EOS": b"\x01\x84\xff\xff\xff\xff",
    "huffman padding over 7 bits": b"\x01\x82\x1f\xff",
    "huffman padding not ones": b"\x01\x81\x18",
    "string truncated": b"\x01\x05abc",
    "string length missing": b"\x01",
    "literal name truncated": b"\x00\x03ab",
    "string length truncated": b"\x01\x7f",
    "size update above the maximum": b"\x3f\xe2\x1f",  # 4097
    "size update after a field": b"\x82\x20",
    "size update at the end": b"\x82\x3f\xe1\x1f",
}


@pytest.mark.parametrize("block", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_blocks_raise_hpack_error(block):
    with pytest.raises(HpackError) as info:
        HeaderDecoder().decode(block)
    assert not isinstance(info.value, HeaderListTooLarge)
    with pytest.raises(hpack.HPACKError):  # the oracle agrees these are malformed
        oracle = hpack.Decoder()
        oracle.max_allowed_table_size = 4096
        oracle.decode(block)


def test_size_updates_at_the_start_are_allowed():
    decoder = HeaderDecoder()
    decoder.decode(b"\x40\x01a\x01b")  # a: b, 34 octets
    assert decoder.decode(b"\x20\x3f\xe1\x1f\x82") == ((b":method", b"GET"),)  # 0, then 4096
    assert decoder.table == ()  # the update to 0 emptied it
    decoder.decode(b"\x3f\x03\x40\x01a\x01b\x40\x01c\x01d")  # limit 34: c: d evicts a: b
    assert decoder.table == ((b"c", b"d"),)
    decoder.decode(b"\x40\x01e\x02ff")  # 35 octets: larger than the table, which empties
    assert decoder.table == ()


def test_header_list_too_large_keeps_the_table_in_step():
    decoder = HeaderDecoder(max_header_list_size=200)
    big = b"v" * 300
    first = hpack.Encoder().encode([(b"x-big", big), (b"x-small", b"1")])
    with pytest.raises(HeaderListTooLarge):
        decoder.decode(first)
    assert decoder.table == ((b"x-small", b"1"), (b"x-big", big))
    assert decoder.decode(b"\xbe") == ((b"x-small", b"1"),)
    with pytest.raises(HeaderListTooLarge):  # 1,000 references to one large entry
        decoder.decode(b"\xbf" * 1000)


@settings(max_examples=500)
@given(block=st.binary(max_size=200), filled=st.booleans())
def test_arbitrary_bytes_raise_nothing_but_hpack_error(block, filled):
    decoder = HeaderDecoder(max_table_size=256, max_header_list_size=2000)
    if filled:
        decoder.decode(hpack.Encoder().encode([(b"x-a", b"1"), (b"x-b", b"2" * 50)]))
    with contextlib.suppress(HpackError):
        decoder.decode(block)


# --------------------------------------------------------------------------- the result cache


def test_repeated_block_hits_the_cache():
    encoder = hpack.Encoder()
    headers = [(b":method", b"POST"), (b":path", b"/inference.GRPCInferenceService/ModelInfer")]
    decoder = HeaderDecoder()
    first = decoder.decode(encoder.encode(headers))  # fills the table: not cached
    second = encoder.encode(headers)
    assert second == b"\x83\xbe"
    result = decoder.decode(second)
    assert result == first == tuple(headers)
    assert decoder.decode(bytearray(second)) is result  # the same object: a cache hit
    assert decoder.decode(second) is result


def test_a_table_change_invalidates_the_cache():
    decoder = HeaderDecoder()
    decoder.decode(b"\x40\x01a\x01b")
    assert decoder.decode(b"\xbe") == ((b"a", b"b"),)
    decoder.decode(b"\x40\x01c\x01d")  # now index 62 is c: d
    assert decoder.decode(b"\xbe") == ((b"c", b"d"),)
    decoder.decode(b"\x20")  # a size update empties the table
    with pytest.raises(HpackError):
        decoder.decode(b"\xbe")


def test_blocks_that_index_are_decoded_every_time():
    decoder = HeaderDecoder()
    block = b"\x40\x01a\x01b"
    decoder.decode(block)
    decoder.decode(block)
    assert decoder.table == ((b"a", b"b"), (b"a", b"b"))


def test_the_cache_is_bounded():
    decoder = HeaderDecoder(cache_bytes=90)  # two blocks of 1 + 42 bytes
    blocks = [b"\x82", b"\x83", b"\x84"]
    results = [decoder.decode(block) for block in blocks]
    assert decoder.decode(blocks[2]) is results[2]
    assert decoder.decode(blocks[1]) is results[1]
    again = decoder.decode(blocks[0])  # the oldest was dropped
    assert again == results[0] and again is not results[0]
