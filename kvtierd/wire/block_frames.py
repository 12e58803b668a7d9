"""PutRequest and GetResponse on the wire without protobuf objects around the block bytes.

Put and Get carry one block (2 MiB for Llama-3-8B) per message. Through generated protobuf
classes each block is copied four or five times per side (into the message, serialized, parsed,
and again on every read of the bytes field). These functions write and read exactly the proto3
encoding of kvtier.proto's PutRequest and GetResponse — any protobuf client interoperates; the
tests check both directions against the generated classes — with one copy when encoding and a
memoryview (no copy) when decoding.

Encoding: each field is `key (varint: field_number << 3 | wire_type) | length (varint) | bytes`;
every field used here is length-delimited (wire type 2). Decoding accepts fields in any order,
skips unknown fields, and keeps the last occurrence of a repeated scalar, as protobuf does.
"""

from __future__ import annotations

import dataclasses

from kvtierd.errors import InvalidArgument
from kvtierd.token_bytes import TokenBytes
from kvtierd.v1 import kvtier_pb2 as pb

LENGTH_DELIMITED = 2
_SKIP = {0: None, 1: 8, 5: 4}  # other wire types: varint, fixed64, fixed32

# PutRequest field numbers (proto/kvtierd/v1/kvtier.proto)
PUT_LAYOUT, PUT_BLOCK_HASH, PUT_PARENT_HASH, PUT_TOKEN_IDS, PUT_DATA, PUT_RETENTION = 1, 2, 3, 4, 5, 6
# GetResponse field numbers
GET_BLOCK_HASH, GET_DATA = 1, 2

Buffer = bytes | bytearray | memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_head(number: int, nbytes: int) -> bytes:
    return _varint(number << 3 | LENGTH_DELIMITED) + _varint(nbytes)


def _fields(parts: list[tuple[int, Buffer]]) -> bytes:
    """The encoding of length-delimited fields, empty ones left out (proto3 defaults)."""
    pieces: list[Buffer] = []
    for number, value in parts:
        nbytes = memoryview(value).nbytes
        if nbytes:
            pieces += [_field_head(number, nbytes), value]
    return b"".join(pieces)


def encode_put_request(block_hash: bytes, token_ids: bytes, data: Buffer, layout: pb.Layout | None = None,
                       parent_hash: bytes = b"", retention: pb.RetentionHint | None = None) -> bytes:
    """A serialized PutRequest; `data` is copied once, into the result."""
    layout_bytes = layout.SerializeToString() if layout is not None else b""
    retention_bytes = retention.SerializeToString() if retention is not None else b""
    return _fields([(PUT_LAYOUT, layout_bytes), (PUT_BLOCK_HASH, block_hash), (PUT_PARENT_HASH, parent_hash),
                    (PUT_TOKEN_IDS, token_ids), (PUT_DATA, data), (PUT_RETENTION, retention_bytes)])


def encode_get_response(block_hash: bytes, data: Buffer) -> bytes:
    return _fields([(GET_BLOCK_HASH, block_hash), (GET_DATA, data)])


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise InvalidArgument("malformed message: truncated or overlong varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def decode_fields(raw: Buffer) -> dict[int, memoryview]:
    """Field number → its last length-delimited value, as a view into `raw` (no copy)."""
    view = memoryview(raw).cast("B") if not isinstance(raw, memoryview) else raw
    fields: dict[int, memoryview] = {}
    pos, end = 0, len(view)
    while pos < end:
        key, pos = _read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == LENGTH_DELIMITED:
            nbytes, pos = _read_varint(view, pos)
            if pos + nbytes > end:
                raise InvalidArgument("malformed message: a field runs past the end")
            fields[number] = view[pos:pos + nbytes]
            pos += nbytes
        elif wire_type in _SKIP:
            skip = _SKIP[wire_type]
            pos = _read_varint(view, pos)[1] if skip is None else pos + skip
        else:
            raise InvalidArgument(f"malformed message: wire type {wire_type}")
    if pos != end:
        raise InvalidArgument("malformed message: a field runs past the end")
    return fields


@dataclasses.dataclass(frozen=True, slots=True)
class PutFrame:
    """One decoded PutRequest; `data` is a view into the received message."""

    layout: pb.Layout | None  # first message only
    block_hash: bytes
    parent_hash: bytes
    token_ids: TokenBytes  # as sent: BlockPut.check checks that they fill one block
    data: memoryview
    retention: pb.RetentionHint | None = None  # first message only, optional

    @classmethod
    def decode(cls, raw: Buffer) -> PutFrame:
        fields = decode_fields(raw)
        empty = memoryview(b"")
        layout = fields.get(PUT_LAYOUT)
        try:
            layout_message = pb.Layout.FromString(bytes(layout)) if layout is not None else None
        except Exception:  # protobuf's DecodeError
            raise InvalidArgument("malformed PutRequest.layout") from None
        retention = fields.get(PUT_RETENTION)
        try:
            retention_message = pb.RetentionHint.FromString(bytes(retention)) if retention is not None else None
        except Exception:  # protobuf's DecodeError
            raise InvalidArgument("malformed PutRequest.retention") from None
        return cls(layout_message, bytes(fields.get(PUT_BLOCK_HASH, empty)), bytes(fields.get(PUT_PARENT_HASH, empty)),
                   TokenBytes(bytes(fields.get(PUT_TOKEN_IDS, empty))), fields.get(PUT_DATA, empty), retention_message)


def decode_get_response(raw: Buffer) -> tuple[bytes, bytes]:
    """(block hash, data) of a serialized GetResponse; the data is copied once, out of `raw`."""
    fields = decode_fields(raw)
    empty = memoryview(b"")
    return bytes(fields.get(GET_BLOCK_HASH, empty)), bytes(fields.get(GET_DATA, empty))
