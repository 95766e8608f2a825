"""HPACK (RFC 7541): a header block decoder for the HTTP/2 core, and a stateless encoder.

Headers are bytes, names and values alike: gRPC metadata may hold any octets, and what
they mean is the caller's business. The ``hpack`` package provides the static table and
Huffman decoding; the rest is here, written for the hot path.

gRPC clients send the same header block on every call of a connection once their first
call has filled the dynamic table (grpcio's second ModelInfer is eight one-byte indexes),
so the decoder remembers the result of each block that left the dynamic table as it was:
such a block means the same thing until the table changes, and decoding it again costs a
dictionary lookup. What it remembers is bounded in bytes (blocks and their decoded
lists), since a client sending distinct 60 KB values would fill a cache bounded by count
with tens of megabytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from ._sized_cache import SizedCache

Header = tuple[bytes, bytes]
HeaderList = tuple[Header, ...]

STATIC_TABLE: tuple[Header, ...] = HeaderTable.STATIC_TABLE
_STATIC_LENGTH = len(STATIC_TABLE)
# RFC 7541 section 4.1: an entry's size counts 32 octets of overhead beside its name and value;
# RFC 9113 section 6.5.2 measures a header list the same way.
ENTRY_OVERHEAD = 32
# An integer may take at most this many bits of continuation bytes: 5 bytes, far beyond
# any index, length or table size a block can carry, and short of a runaway loop.
_MAX_CONTINUATION_SHIFT = 28


class HpackError(Exception):
    """A malformed header block: a COMPRESSION_ERROR for the whole connection."""


class HeaderListTooLarge(HpackError):
    """The decoded header list exceeds the decoder's ``max_header_list_size``.

    The dynamic table has been updated by the whole block, so the connection can go on:
    the stream that sent it is refused (RFC 9113 section 8.2.2: HTTP 431, or RST_STREAM).
    """


def _integer(data: bytes, pos: int, value: int) -> tuple[int, int]:
    """Finish an integer whose prefix was all ones (``value``): RFC 7541 section 5.1."""
    shift = 0
    while True:
        try:
            byte = data[pos]
        except IndexError:
            raise HpackError("header block ends inside an integer") from None
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > _MAX_CONTINUATION_SHIFT:
            raise HpackError("integer too large in header block")


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    """A string literal at ``pos`` (RFC 7541 section 5.2) and the position after it."""
    try:
        byte = data[pos]
    except IndexError:
        raise HpackError("header block ends before a string literal") from None
    length = byte & 0x7F
    pos += 1
    if length == 0x7F:
        length, pos = _integer(data, pos, length)
    end = pos + length
    if end > len(data):
        raise HpackError("string literal runs past the end of the header block")
    raw = data[pos:end]
    if byte & 0x80:
        try:
            raw = decode_huffman(raw)
        except HPACKDecodingError as exc:
            raise HpackError(f"bad Huffman code in header block: {exc}") from None
    return raw, end


class HeaderDecoder:
    """The decoding context of one HTTP/2 connection (one per connection, used in order).

    ``max_table_size`` is the dynamic table size this endpoint allows the peer's encoder
    (SETTINGS_HEADER_TABLE_SIZE; 4096 is the protocol's default, which needs no setting);
    ``max_header_list_size`` bounds a decoded list, counted as RFC 9113 counts
    SETTINGS_MAX_HEADER_LIST_SIZE (each name and value plus 32 octets); ``cache_bytes``
    the blocks remembered with their lists (each counted as its block plus its list).
    """

    __slots__ = (
        "_max_header_list_size",
        "_max_table_size",
        "_table",
        "_table_limit",
        "_table_used",
        "cache",
    )

    def __init__(
        self,
        max_table_size: int = 4096,
        max_header_list_size: int = 65536,
        *,
        cache_bytes: int = 256 * 1024,
    ) -> None:
        self._max_table_size = max_table_size
        self._max_header_list_size = max_header_list_size
        self._table: deque[Header] = deque()  # newest first: index 62 is self._table[0]
        self._table_limit = max_table_size  # the encoder may lower it with size updates
        self._table_used = 0
        # Results of blocks that did not change the table, valid until the table changes.
        self.cache: SizedCache[bytes, HeaderList] = SizedCache(cache_bytes)

    @property
    def table(self) -> tuple[Header, ...]:
        """The dynamic table's entries, newest first (for tests and debugging)."""
        return tuple(self._table)

    def decode(self, block: bytes) -> HeaderList:
        """The header list of one complete header block (HEADERS plus CONTINUATIONs).

        The result is an immutable tuple of ``(name, value)`` byte pairs in block order,
        and may be the very object an earlier call returned for the same bytes. Raises
        ``HpackError`` on any malformed block, after which the context is unusable (the
        connection must end with COMPRESSION_ERROR). Raises ``HeaderListTooLarge`` when
        the decoded list exceeds ``max_header_list_size``: the whole block has still been
        decoded and the dynamic table updated, so the context stays usable.
        """
        if type(block) is not bytes:
            block = bytes(block)  # hashable, and slices are bytes
        cached = self.cache.get(block)
        if cached is not None:
            return cached
        return self._decode(block)

    def _decode(self, data: bytes) -> HeaderList:
        headers: list[Header] = []
        list_size = 0
        list_limit = self._max_header_list_size
        table_changed = False
        fields_seen = False
        pos = 0
        end = len(data)
        while pos < end:
            byte = data[pos]
            pos += 1
            if byte & 0x80:  # indexed header field (section 6.1)
                index = byte & 0x7F
                if index == 0x7F:
                    index, pos = _integer(data, pos, index)
                header = self._entry(index)
            elif byte & 0x40:  # literal with incremental indexing (section 6.2.1)
                header, pos = self._literal(data, pos, byte & 0x3F, 0x3F)
                self._insert(header)
                table_changed = True
            elif byte & 0x20:  # dynamic table size update (section 6.3)
                if fields_seen:
                    raise HpackError("dynamic table size update after a header field")
                size = byte & 0x1F
                if size == 0x1F:
                    size, pos = _integer(data, pos, size)
                if size > self._max_table_size:
                    raise HpackError(
                        f"dynamic table size update to {size} exceeds the limit of "
                        f"{self._max_table_size}"
                    )
                self._resize(size)
                table_changed = True
                continue
            else:  # literal without indexing or never indexed (sections 6.2.2, 6.2.3)
                header, pos = self._literal(data, pos, byte & 0x0F, 0x0F)
            fields_seen = True
            # Past the limit, stop collecting (a tiny block can name a large table entry
            # thousands of times) but keep decoding: the table must stay in step.
            list_size += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
            if list_size <= list_limit:
                headers.append(header)
        if list_size > list_limit:
            raise HeaderListTooLarge(
                f"header list of {list_size} octets exceeds the limit of {list_limit}"
            )
        result = tuple(headers)
        if not table_changed:
            self.cache.put(data, result, len(data) + list_size)
        return result

    def _literal(self, data: bytes, pos: int, index: int, prefix_max: int) -> tuple[Header, int]:
        """A literal field after its first byte: the name (by ``index`` into the tables,
        or a string when 0; ``index`` at ``prefix_max`` continues as an integer), then the
        value."""
        if index == prefix_max:
            index, pos = _integer(data, pos, index)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = _string(data, pos)
        value, pos = _string(data, pos)
        return (name, value), pos

    def _entry(self, index: int) -> Header:
        if index <= _STATIC_LENGTH:
            if index == 0:
                raise HpackError("header table index 0")
            return STATIC_TABLE[index - 1]
        try:
            return self._table[index - _STATIC_LENGTH - 1]
        except IndexError:
            raise HpackError(f"header table index {index} out of range") from None

    def _insert(self, header: Header) -> None:
        """Add an entry, evicting the oldest to make room (RFC 7541 section 4.4)."""
        self.cache.clear()
        size = len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        if size > self._table_limit:
            self._table.clear()  # an entry larger than the table empties it
            self._table_used = 0
            return
        self._evict(self._table_limit - size)
        self._table.appendleft(header)
        self._table_used += size

    def _resize(self, size: int) -> None:
        self.cache.clear()
        self._table_limit = size
        self._evict(size)

    def _evict(self, room: int) -> None:
        table = self._table
        while self._table_used > room:
            name, value = table.pop()
            self._table_used -= len(name) + len(value) + ENTRY_OVERHEAD


def _first_indexes() -> tuple[dict[bytes, int], dict[Header, int]]:
    names: dict[bytes, int] = {}
    fields: dict[Header, int] = {}
    for index, header in enumerate(STATIC_TABLE, start=1):
        names.setdefault(header[0], index)
        fields.setdefault(header, index)
    return names, fields


_STATIC_NAME_INDEX, _STATIC_FIELD_INDEX = _first_indexes()


def _append_integer(out: bytearray, value: int, prefix_bits: int, first: int) -> None:
    """Append ``value`` with an N-bit prefix (RFC 7541 section 5.1), high bits from ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        out.append(first | value)
        return
    out.append(first | limit)
    value -= limit
    while value >= 0x80:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)


def encode_headers(headers: Iterable[Header]) -> bytes:
    """A header block that any decoder reads the same, whatever its dynamic table holds.

    A field of the static table is one index; any other is a literal without indexing,
    naming its name by static index where the table has it; no Huffman coding. The block
    never touches the dynamic table, so the encoder needs no state and a block can be
    built once and sent on any connection. Names must already be lower-case (HTTP/2).
    """
    out = bytearray()
    for header in headers:
        index = _STATIC_FIELD_INDEX.get(header)
        if index is not None:
            out.append(0x80 | index)  # every static index fits the 7-bit prefix
            continue
        name, value = header
        name_index = _STATIC_NAME_INDEX.get(name, 0)
        _append_integer(out, name_index, 4, 0x00)
        if not name_index:
            _append_integer(out, len(name), 7, 0x00)
            out += name
        _append_integer(out, len(value), 7, 0x00)
        out += value
    return bytes(out)
