"""A T3 value is the block asked for or a FrameMismatch: every check of block_frame.read_frame,
each refused for exactly the corruption it is there for, and no flipped bit ever read as KV."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.layout import Layout
from kvtierd.t3.block_frame import HEADER_BYTES, MAGIC, FrameMismatch, frame_block, layout_digest, read_frame

LAYOUT = Layout("m", 2, 2, 16, 4)
DIGEST = layout_digest(LAYOUT, "raw")
BLOCK = bytes(range(16)) + b"\xab" * 32  # a daemon key: tenant tag (16) + client hash (32)
PARENT = b"\x11" * 16 + b"\x22" * 32
TOKENS = struct.pack("<4I", 7, 70000, 0, 2**32 - 1)  # LAYOUT's block of 4 tokens, packed u32
PAYLOAD = bytes((i * 37 + 5) % 256 for i in range(LAYOUT.bytes_per_block))

# Where each part of a frame of BLOCK, PARENT, TOKENS and PAYLOAD lies (block_frame.py's table).
HASH_AT = HEADER_BYTES
PARENT_AT = HASH_AT + len(BLOCK)
TOKENS_AT = PARENT_AT + len(PARENT)
PAYLOAD_AT = TOKENS_AT + len(TOKENS)


def frame(digest: bytes = DIGEST, block: bytes = BLOCK, parent: bytes = PARENT, tokens: bytes = TOKENS,
          payload=PAYLOAD) -> bytes:
    return frame_block(digest, block, parent, tokens, payload)


def read(value, digest: bytes = DIGEST, block: bytes = BLOCK, parent: bytes | None = PARENT,
         payload_nbytes: int = len(PAYLOAD), tokens: bytes | None = TOKENS):
    return read_frame(value, digest, block, parent, payload_nbytes, tokens)


def refusal(value, **asked) -> str:
    """The reason `read` refuses `value` with (fails the test when it is accepted)."""
    with pytest.raises(FrameMismatch) as refused:
        read(value, **asked)
    return refused.value.reason


def flipped(value: bytes, bit: int) -> bytes:
    changed = bytearray(value)
    changed[bit // 8] ^= 1 << (bit % 8)
    return bytes(changed)


# ------------------------------------------------------------------------------------------------ round trip


def test_a_frame_reads_back_its_payload_token_ids_and_parent():
    """What frame_block wrote is what read_frame returns, byte for byte, whether or not the reader knows the
    parent and the token ids."""
    value = frame()
    assert len(value) == PAYLOAD_AT + len(PAYLOAD) and value[:4] == MAGIC
    for parent, tokens in ((PARENT, TOKENS), (None, None)):
        got = read(value, parent=parent, tokens=tokens)
        assert bytes(got.payload) == PAYLOAD
        assert got.token_ids == TOKENS
        assert got.parent_hash == PARENT


def test_a_payload_given_as_a_numpy_row_frames_its_bytes():
    """RemoteTier frames T1 rows (numpy uint8 views): the value holds exactly those bytes."""
    row = np.frombuffer(PAYLOAD, dtype=np.uint8).copy()
    assert frame(payload=row) == frame()
    assert bytes(read(frame(payload=row)).payload) == PAYLOAD


def test_a_block_without_tokens_or_parent_round_trips():
    """Zero-length parent and token ids are legal (a chain's first block; a block of another kind)."""
    value = frame(parent=b"", tokens=b"")
    got = read(value, parent=b"", tokens=b"")
    assert (got.parent_hash, got.token_ids, bytes(got.payload)) == (b"", b"", PAYLOAD)


# ------------------------------------------------------------------------------------------------ "short"


@pytest.mark.parametrize("value", [
    pytest.param(None, id="none"),
    pytest.param(b"", id="empty"),
    pytest.param(frame()[:HEADER_BYTES - 1], id="truncated-header"),
    pytest.param(frame()[:HEADER_BYTES], id="header-only"),
    pytest.param(frame()[:-1], id="truncated-payload"),
    pytest.param(frame()[:PAYLOAD_AT], id="no-payload"),
    pytest.param(frame() + b"\0", id="one-extra-byte"),
    pytest.param(frame() + frame(), id="two-frames"),
])
def test_a_missing_truncated_or_overlong_value_is_short(value):
    """A value whose length is not what its header says (or that has no header) is refused as short."""
    assert refusal(value) == "short"


# ------------------------------------------------------------------------------------------------ header fields


def test_another_magic_is_refused_as_magic():
    """A value that does not start with KVT3 (another program's value under the key) is refused as magic."""
    value = frame()
    assert refusal(b"KVT4" + value[4:]) == "magic"
    assert refusal(b"\0" * len(value)) == "magic"


def test_another_version_is_refused_as_version():
    """A frame of another format version is refused as version, whatever it holds."""
    value = frame()
    for version in (0, 2, 0xFFFF):
        assert refusal(value[:4] + struct.pack("<H", version) + value[6:]) == "version"


LAYOUT_CHANGES = {
    "model_id": dict(model_id="n"),
    "num_layers": dict(num_layers=3),
    "num_kv_heads": dict(num_kv_heads=1),
    "head_dim": dict(head_dim=8),
    "block_size": dict(block_size=8),
    "dtype": dict(dtype="bfloat16"),
    "tp_size": dict(tp_size=2),
}


@pytest.mark.parametrize("field", sorted(LAYOUT_CHANGES))
def test_a_frame_of_a_layout_that_differs_in_one_field_is_refused_as_layout(field):
    """The layout digest covers every Layout field: a frame written under a layout that differs in any one of
    them is refused as layout, with the same payload length."""
    other = dataclasses.replace(LAYOUT, **LAYOUT_CHANGES[field])
    assert layout_digest(other, "raw") != DIGEST
    assert refusal(frame(digest=layout_digest(other, "raw"))) == "layout"


def test_the_layout_digest_tells_tp_ranks_and_codecs_apart():
    """Two ranks of one TP group and two codecs of one layout have different digests; one layout and codec
    always the same (other daemons must find it)."""
    rank0, rank1 = (dataclasses.replace(LAYOUT, tp_size=2, tp_rank=r) for r in (0, 1))
    digests = {layout_digest(rank0, "raw"), layout_digest(rank1, "raw"), DIGEST, layout_digest(LAYOUT, "fp8")}
    assert len(digests) == 4 and all(len(d) == 16 for d in digests)
    assert layout_digest(Layout("m", 2, 2, 16, 4), "raw") == DIGEST
    assert refusal(frame(digest=layout_digest(LAYOUT, "fp8"))) == "layout"


@pytest.mark.parametrize("payload_nbytes", [len(PAYLOAD) - 1, len(PAYLOAD) + 1, len(PAYLOAD) // 2])
def test_a_payload_of_another_length_is_refused_as_layout(payload_nbytes):
    """A frame whose payload is not the reader's slot size is refused as layout (consistent, of another codec)."""
    other = PAYLOAD[:payload_nbytes] if payload_nbytes < len(PAYLOAD) else PAYLOAD + b"\0"
    assert refusal(frame(payload=other)) == "layout"


# ------------------------------------------------------------------------------------------------ identity


def test_another_blocks_value_under_this_key_is_refused_as_hash():
    """A consistent frame of another block (same layout, parent and tokens) is refused as hash."""
    other = BLOCK[:-1] + bytes([BLOCK[-1] ^ 1])
    assert refusal(frame(block=other)) == "hash"
    assert refusal(frame(block=BLOCK[:-1])) == "hash"  # a hash of another length (another hash function)
    assert refusal(frame(block=BLOCK + b"\0")) == "hash"


def test_a_block_after_another_parent_is_refused_as_parent():
    """The reader knows the parent: a frame of the same block after another parent is refused as parent;
    without a parent asked for it is read, and the frame's parent returned."""
    other = b"\x33" * len(PARENT)
    assert refusal(frame(parent=other)) == "parent"
    assert read(frame(parent=other), parent=None).parent_hash == other


def test_token_ids_other_than_the_callers_are_refused_as_tokens():
    """The caller sent its token ids: a frame with any other ids is refused as tokens; a caller that sent
    none gets the frame's."""
    other = struct.pack("<4I", 7, 70000, 1, 2**32 - 1)
    assert refusal(frame(tokens=other)) == "tokens"
    assert refusal(frame(), tokens=other) == "tokens"
    assert read(frame(tokens=other), tokens=None).token_ids == other


# ------------------------------------------------------------------------------------------------ checksum


def test_a_flipped_payload_bit_is_refused_as_checksum():
    """The last bit of the payload flipped: every other check passes, the checksum does not."""
    assert refusal(flipped(frame(), 8 * len(frame()) - 1)) == "checksum"
    assert refusal(flipped(frame(), 8 * PAYLOAD_AT)) == "checksum"


def test_a_flipped_checksum_bit_is_refused_as_checksum():
    """The checksum field itself corrupted: refused as checksum."""
    assert refusal(flipped(frame(), 8 * 36 + 5)) == "checksum"


@given(st.integers(0, 8 * (len(BLOCK) + len(PARENT) + len(TOKENS) + len(PAYLOAD)) - 1))
def test_any_flipped_bit_in_the_hashes_tokens_or_payload_is_refused(bit):
    """One bit flipped anywhere after the header is always refused; with the reader knowing neither parent nor
    tokens, only the hash check can catch it before the checksum does."""
    value = flipped(frame(), 8 * HEADER_BYTES + bit)
    assert refusal(value) in ("hash", "parent", "tokens", "checksum")
    at = HEADER_BYTES + bit // 8
    expected = "hash" if HASH_AT <= at < PARENT_AT else "checksum"
    assert refusal(value, parent=None, tokens=None) == expected


@given(st.integers(0, 8 * (PAYLOAD_AT + len(PAYLOAD)) - 1))
def test_no_flipped_bit_anywhere_is_read_as_other_bytes(bit):
    """One bit flipped anywhere in the value, header (its reserved field too) included: refused."""
    with pytest.raises(FrameMismatch):
        read(flipped(frame(), bit), parent=None, tokens=None)
