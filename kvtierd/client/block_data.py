"""Block data as the client takes it: token ids and block bytes from lists, numpy, bytes or torch
tensors (torch never imported here: a caller holding a tensor has imported it), and the messages
of a Put stream built from them."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

from kvtierd.errors import InvalidArgument, KvtierError
from kvtierd.layout import Layout
from kvtierd.token_bytes import pack_token_ids
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.block_frames import encode_put_request
from kvtierd.wire.conversions import layout_to_proto

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

TokenIds = Union[Sequence[int], np.ndarray, "torch.Tensor", bytes]
BlockData = Union[bytes, bytearray, memoryview, "torch.Tensor"]


def is_tensor(value: object) -> TypeIs[torch.Tensor]:
    """Whether `value` is a torch.Tensor, without importing torch: a caller holding a tensor has
    imported torch already, so the client never pulls it in itself."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)

@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    num_blocks: int
    num_already_cached_blocks: int


def optional_tokens(token_ids: TokenIds | None) -> bytes:
    if token_ids is None:
        return b""
    if is_tensor(token_ids):
        token_ids = token_ids.detach().cpu().numpy()
    return pack_token_ids(token_ids)


def hash_list(block_hashes: Iterable[bytes]) -> list[bytes]:
    """The hashes as a list of bytes (what a protobuf repeated bytes field takes)."""
    if isinstance(block_hashes, list) and set(map(type, block_hashes)) <= {bytes}:
        return block_hashes  # the common case, checked at C speed
    return [bytes(block_hash) for block_hash in block_hashes]


def check_block_size(data: BlockData, layout: Layout) -> None:
    nbytes = data.numel() * data.element_size() if is_tensor(data) else memoryview(data).nbytes
    if nbytes != layout.bytes_per_block:
        raise InvalidArgument(f"a block of this layout is {layout.bytes_per_block} bytes, got {nbytes}")


def block_buffer(data: BlockData, layout: Layout) -> bytes | bytearray | memoryview:
    """A block's bytes in block-major order, as a buffer (a tensor's host bytes, not copied
    when it is already a contiguous CPU tensor)."""
    check_block_size(data, layout)
    if is_tensor(data):
        return data.detach().contiguous().cpu().reshape(-1).view(sys.modules["torch"].uint8).numpy().data
    return data


class PutStream:
    """The requests of one Put: layout and parent hash in the first message only, then one
    message per block. Block sizes of a sequence are checked before anything is sent; a
    malformed block met mid-stream aborts the stream (grpc cancels the call) and is kept in
    `error`, for the client to raise rather than grpc's "Exception iterating requests!"."""

    def __init__(self, layout: Layout, blocks: Iterable[tuple[bytes, TokenIds, BlockData]],
                 parent_hash: bytes | None) -> None:
        if isinstance(blocks, Sequence):
            for _, _, data in blocks:
                check_block_size(data, layout)
        self.layout = layout
        self.blocks = blocks
        self.parent_hash = bytes(parent_hash or b"")
        self.error: KvtierError | None = None

    def requests(self) -> Iterator[bytes]:
        """Serialized PutRequests (block_frames.py: the block is copied once, into the message)."""
        for index, (block_hash, token_ids, data) in enumerate(self.blocks):
            try:
                first = index == 0
                yield encode_put_request(bytes(block_hash), optional_tokens(token_ids), block_buffer(data, self.layout),
                                         layout_to_proto(self.layout) if first else None,
                                         self.parent_hash if first else b"")
            except KvtierError as error:
                self.error = error
                raise

    def result(self, response: pb.PutResponse) -> PutResult:
        return PutResult(response.num_blocks, response.num_already_cached_blocks)
