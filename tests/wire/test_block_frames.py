"""Put/Get frames written and read without protobuf objects interoperate with protobuf."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.block_frames import (
    PutFrame,
    decode_fields,
    decode_get_response,
    encode_get_response,
    encode_put_request,
)

LAYOUT = pb.Layout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
DATA = bytes(range(256)) * 8  # 2 KiB: a length that needs a two-byte varint


@pytest.mark.parametrize("first", [True, False])
def test_encoded_put_request_parses_as_protobuf_and_back(first):
    extra = dict(layout=LAYOUT, parent_hash=b"p" * 32) if first else {}
    raw = encode_put_request(b"h" * 32, b"t" * 16, memoryview(DATA), **extra)
    assert pb.PutRequest.FromString(raw) == pb.PutRequest(block_hash=b"h" * 32, token_ids=b"t" * 16, data=DATA, **extra)
    frame = PutFrame.decode(raw)
    assert (frame.block_hash, frame.token_ids, bytes(frame.data)) == (b"h" * 32, b"t" * 16, DATA)
    assert frame.layout == (LAYOUT if first else None) and frame.parent_hash == (b"p" * 32 if first else b"")


def test_protobuf_serialized_messages_decode_with_unknown_fields_and_any_order():
    message = pb.PutRequest(layout=LAYOUT, block_hash=b"h" * 32, token_ids=b"t" * 16, data=DATA)
    unknown = b"\x30\x05" + b"\x3a\x02zz" + b"\x41" + b"\x00" * 8  # field 6 varint, 7 bytes, 8 fixed64
    reordered = pb.PutRequest(data=DATA).SerializeToString() + pb.PutRequest(block_hash=b"h" * 32).SerializeToString()
    frame = PutFrame.decode(message.SerializeToString() + unknown)
    assert (frame.layout, frame.block_hash, bytes(frame.data)) == (LAYOUT, b"h" * 32, DATA)
    assert (PutFrame.decode(reordered).block_hash, bytes(PutFrame.decode(reordered).data)) == (b"h" * 32, DATA)
    response = pb.GetResponse(block_hash=b"g" * 32, data=DATA)
    assert decode_get_response(response.SerializeToString()) == (b"g" * 32, DATA)
    assert pb.GetResponse.FromString(encode_get_response(b"g" * 32, DATA)) == response


def test_the_data_is_a_view_not_a_copy():
    raw = encode_put_request(b"h" * 32, b"", DATA)
    assert PutFrame.decode(raw).data.obj is raw


@pytest.mark.parametrize("raw", [b"\x2a\x05abc", b"\x2a", b"\x2a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                 b"\x2b", b"\x0a\x03\xff\xff\xff"])
def test_malformed_messages_are_invalid_arguments(raw):
    """A field past the end, a truncated or overlong varint, a group wire type, a bad layout."""
    with pytest.raises(InvalidArgument, match="malformed"):
        PutFrame.decode(raw)


def test_empty_fields_are_left_out_like_proto3():
    assert encode_put_request(b"", b"", b"") == b"" == pb.PutRequest().SerializeToString()
    assert decode_fields(b"") == {}
