"""HTTP/2 wire pieces shared by the gRPC server and the perf tool's gRPC client.

Frames (RFC 9113 §4.1), the two HPACK encodings we emit (RFC 7541 §5: integers and
strings without Huffman coding; our header blocks never touch the peer's dynamic table),
and a header-block decoder for what peers send.
"""

from __future__ import annotations

import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = 0, 1, 2, 3, 4, 5, 6, 7
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# gRPC message compression (grpc-encoding): zlib's wbits for each; gRPC's "deflate" is
# the zlib format.
GRPC_ENCODING_WBITS = {"gzip": 31, "deflate": 15}
# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
# error codes
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB

MAX_FRAME = 16384  # the frame size every peer accepts
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return HEAD.pack((len(payload) << 8) | kind, flags, stream) + payload


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an N-bit prefix, ``first`` holding the bits above it."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return hpack_int(len(data), 7, 0) + data  # no Huffman


def literal(name: str | int, value: str | bytes) -> bytes:
    """A header field as a literal that is never added to the peer's dynamic table;
    ``name`` is a static-table index or the name itself."""
    if isinstance(name, int):
        return hpack_int(name, 4, 0x00) + hpack_string(value)
    return b"\x00" + hpack_string(name) + hpack_string(value)


class HeaderDecoder:
    """HPACK decoding for one connection, with a cache for the common case.

    A client that repeats a call sends, from the second call on, a header block made
    only of one-byte references to table entries. Such a block changes no table, so
    until a block that does arrives, the same bytes mean the same headers: the
    decoded list is kept by block and the decoder only runs for new blocks.
    """

    def __init__(self, max_header_list_size: int = 65536) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._known: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's (name, value) pairs; raises :class:`hpack.HPACKError` on a bad block."""
        known = self._known.get(block)
        if known is not None:
            return known
        # Latin-1, not UTF-8: any octets decode (HTTP/2 field values may hold obs-text)
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in self._decoder.decode(block, raw=True)
        ]
        if min(block, default=0) >= 0x80:  # indexed fields only: no table changed
            if len(self._known) > 64:
                self._known.clear()
            self._known[block] = headers
        else:
            self._known.clear()
        return headers


HPACKError = hpack.HPACKError
