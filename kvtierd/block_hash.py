"""Block keys: parent-chained content hashes of full blocks of tokens.

    hash[-1] = root(namespace)                        namespace = hash algorithm + layout + tenant
    hash[i]  = H(hash[i-1], token_ids[i*B:(i+1)*B], extra_keys[i])        full blocks only

Encoding, version 1 (pinned by tests/test_block_hash.py; any change needs a new version byte):
every hashed message starts with HEADER = b"kvtierd\\x00" + VERSION (0x01), then one kind byte
(b"R" for a root, b"B" for a block), then tagged, length-framed fields, each
`tag (u8) | length (u32 little-endian) | value`, in this order:

    root:  ALGO (b"sha256" | b"xxh3_128"), LAYOUT (Layout.fingerprint()), TENANT (UTF-8)
    block: TOKENS (each token id as u32 little-endian), PARENT (the parent digest),
           LORA (UTF-8, on every block of a LoRA request),
           MM (mm_hash | offset u32 | length u32, one per multimodal input overlapping the block,
               in order of offset),
           SALT (UTF-8 cache_salt, on block 0 only)

An engine that keys its blocks by its own content hash and does not tell the tokens (SGLang's storage
API: chained per-page SHA-256 strings) gets keys of kind b"F" (`Namespace.foreign_keys`):

    foreign: PARENT (the namespace's root), SCHEME (UTF-8, which engine's keys: b"sglang"),
             KEY (the engine's key, UTF-8)

so its keys are bound to the algorithm, the layout and the tenant like any chain, and never equal a
block hash of kvtierd's own chain (another kind byte).

Because every field carries its tag and its length, the encoding is injective: a LoRA name, a
cache salt and a tenant with the same text land in different fields and can never produce the
same message (the untagged-string collision of vLLM #44701 cannot happen here).

Root policy: the root is a fixed function of the namespace, never a random per-process seed,
so two processes, two engines on a node and a restarted daemon compute the same hashes (the
failure of LMCache #2979, whose per-process seed made every restart a cold cache). Tenants are
separated by the TENANT field of the root, not by secrecy of the seed.

H is sha256 (32-byte digests) by default; xxh3-128 (16 bytes) is opt-in for a trusted single
tenant: it is not collision resistant against a chosen input.

The parent comes after the tokens so that everything of a block message but the parent can be
laid out for the whole prompt at once (one numpy pass), leaving one concatenation and one digest
per block in the Python loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import NewType, cast

import numpy as np
import xxhash

from kvtierd.errors import InvalidArgument
from kvtierd.hash_chain_native import native_chain
from kvtierd.layout import Layout
from kvtierd.token_bytes import TOKEN_ID_BYTES, pack_token_ids

BlockHash = NewType("BlockHash", bytes)

VERSION = 1
HEADER = b"kvtierd\x00" + bytes([VERSION])
KIND_ROOT = b"R"
KIND_BLOCK = b"B"

TAG_ALGO = 0x01
TAG_LAYOUT = 0x02
TAG_TENANT = 0x03
TAG_PARENT = 0x10
TAG_TOKENS = 0x11
TAG_LORA = 0x12
TAG_MM = 0x13
TAG_SALT = 0x14
TAG_SCHEME = 0x20
TAG_FOREIGN_KEY = 0x21
KIND_FOREIGN = b"F"

HASH_FUNCTIONS: dict[str, tuple[int, Callable[[bytes], bytes]]] = {
    "sha256": (32, lambda data: hashlib.sha256(data).digest()),
    "xxh3_128": (16, xxhash.xxh3_128_digest),
}


def field(tag: int, value: bytes) -> bytes:
    """One tagged, length-framed field of the encoding."""
    return struct.pack("<BI", tag, len(value)) + value


@dataclasses.dataclass(frozen=True, slots=True)
class MultimodalInput:
    """A multimodal input (an image, an audio clip) occupying tokens [offset, offset + length)."""

    mm_hash: bytes | str  # the content hash of the input; a str counts as its UTF-8 bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.mm_hash:
            raise InvalidArgument("multimodal input needs a non-empty mm_hash")
        if self.offset < 0 or self.length <= 0:
            raise InvalidArgument(
                f"multimodal input needs offset >= 0 and length > 0, got {self.offset}, {self.length}")

    def encode(self) -> bytes:
        digest = self.mm_hash.encode() if isinstance(self.mm_hash, str) else bytes(self.mm_hash)
        return digest + struct.pack("<II", self.offset, self.length)


@dataclasses.dataclass(frozen=True, slots=True)
class PromptExtras:
    """The extra keys of a prompt: what, besides the tokens, changes the KV of its blocks."""

    lora_id: str | None = None
    mm_inputs: tuple[MultimodalInput, ...] = ()
    cache_salt: str | None = None

    def encode_block(self, block_index: int, block_size: int) -> bytes:
        """The extra-key fields of block `block_index` (b"" when it has none)."""
        parts = []
        if self.lora_id is not None:
            parts.append(field(TAG_LORA, str(self.lora_id).encode()))
        start, end = block_index * block_size, (block_index + 1) * block_size
        for mm in sorted(self.mm_inputs, key=lambda m: m.offset):
            if mm.offset < end and start < mm.offset + mm.length:
                parts.append(field(TAG_MM, mm.encode()))
        if block_index == 0 and self.cache_salt is not None:
            parts.append(field(TAG_SALT, self.cache_salt.encode()))
        return b"".join(parts)


class Namespace:
    """The key space of one layout and one tenant: computes its root and its block hashes.

    Invariant: `root` depends only on (algo, layout, tenant); it is the same in every process.
    """

    def __init__(self, layout: Layout, tenant: str = "", algo: str = "sha256") -> None:
        if algo not in HASH_FUNCTIONS:
            raise InvalidArgument(f"hash algorithm {algo!r} is not one of {', '.join(HASH_FUNCTIONS)}")
        self.layout = layout
        self.tenant = tenant
        self.algo = algo
        self.digest_size, self._digest = HASH_FUNCTIONS[algo]
        self.block_size = layout.block_size
        self.root = BlockHash(self._digest(
            HEADER + KIND_ROOT
            + field(TAG_ALGO, algo.encode())
            + field(TAG_LAYOUT, layout.fingerprint())
            + field(TAG_TENANT, tenant.encode())))
        # A block message is `_tokens_head + tokens + _parent_head + parent + extras`.
        self._tokens_head = HEADER + KIND_BLOCK + struct.pack("<BI", TAG_TOKENS, TOKEN_ID_BYTES * self.block_size)
        self._parent_head = struct.pack("<BI", TAG_PARENT, self.digest_size)
        self._native_chain = native_chain(algo)  # the same chain in one C loop, where it was built

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        extras: PromptExtras | None = None,
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """The hash chain of the full blocks of `token_ids`; a partial last block gets none.

        To continue a chain (decode filling more blocks), pass the tokens from block
        `start_block` on and `parent`, the hash of block `start_block - 1`.
        """
        if (start_block == 0) != (parent is None):
            raise InvalidArgument("pass parent exactly when start_block > 0")
        if parent is not None and len(parent) != self.digest_size:
            raise InvalidArgument(f"parent hash must be {self.digest_size} bytes, got {len(parent)}")
        tokens = pack_token_ids(token_ids)
        parent_hash = self.root if parent is None else parent
        if extras == _NO_EXTRAS:
            extras = None
        if self._native_chain is None or (extras is not None and (extras.lora_id is not None or extras.mm_inputs)):
            return self._python_chain(tokens, extras, start_block, parent_hash)
        # The C loop hashes blocks without extra fields; a cache salt is a field of block 0 only.
        salted = extras is not None and extras.cache_salt is not None and start_block == 0
        stride = TOKEN_ID_BYTES * self.block_size
        head = self._python_chain(tokens[:stride], extras, 0, parent_hash) if salted else []
        rest = self._native_chain(tokens[stride:] if salted else tokens, stride, self._tokens_head,
                                  self._parent_head, head[-1] if head else parent_hash)
        return cast("list[BlockHash]", head + rest)

    def _python_chain(self, tokens: bytes, extras: PromptExtras | None, start_block: int,
                      parent_hash: bytes) -> list[BlockHash]:
        """The chain hashed block by block in Python (extras of any kind; no C loop built)."""
        prefixes = self._block_prefixes(tokens)
        chain: list[bytes] = []  # BlockHashes, appended as the digests come (no wrapper call per block)
        append = chain.append
        if extras is not None:
            digest = self._digest
            for i, prefix in enumerate(prefixes):
                parent_hash = digest(prefix + parent_hash + extras.encode_block(start_block + i, self.block_size))
                append(parent_hash)
        elif self.algo == "sha256":  # a bound constructor: no Python frame per block
            sha256 = hashlib.sha256
            for prefix in prefixes:
                parent_hash = sha256(prefix + parent_hash).digest()
                append(parent_hash)
        else:
            digest = self._digest
            for prefix in prefixes:
                parent_hash = digest(prefix + parent_hash)
                append(parent_hash)
        return cast("list[BlockHash]", chain)

    def _block_prefixes(self, tokens: bytes) -> list[bytes]:
        """Per full block, its message up to the parent: tokens head, tokens, parent head."""
        stride = TOKEN_ID_BYTES * self.block_size
        num_blocks = len(tokens) // stride
        head, tail = self._tokens_head, self._parent_head
        if num_blocks < 16:  # numpy's fixed cost does not pay for a few blocks
            return [head + tokens[i:i + stride] + tail for i in range(0, num_blocks * stride, stride)]
        width = len(head) + stride + len(tail)
        rows = np.empty((num_blocks, width), dtype=np.uint8)
        rows[:, :len(head)] = np.frombuffer(head, dtype=np.uint8)
        rows[:, len(head):len(head) + stride] = np.frombuffer(
            tokens, dtype=np.uint8, count=num_blocks * stride).reshape(num_blocks, stride)
        rows[:, len(head) + stride:] = np.frombuffer(tail, dtype=np.uint8)
        laid_out = rows.tobytes()
        return [laid_out[i:i + width] for i in range(0, num_blocks * width, width)]

    def foreign_keys(self, scheme: str, keys: Sequence[str]) -> list[BlockHash]:
        """An engine's own content keys (`scheme` names the engine: "sglang") as block hashes of this
        namespace: one digest each of the root, the scheme and the key (kind b"F", see the module)."""
        head = HEADER + KIND_FOREIGN + field(TAG_PARENT, self.root) + field(TAG_SCHEME, scheme.encode())
        digest = self._digest
        return [BlockHash(digest(head + field(TAG_FOREIGN_KEY, key.encode()))) for key in keys]

    def check_hash(self, block_hash: bytes) -> BlockHash:
        """Validate a hash received from outside; InvalidArgument on a wrong length or type."""
        if not isinstance(block_hash, bytes) or len(block_hash) != self.digest_size:
            size = len(block_hash) if isinstance(block_hash, (bytes, bytearray)) else type(block_hash).__name__
            raise InvalidArgument(f"a {self.algo} block hash is {self.digest_size} bytes, got {size}")
        return BlockHash(block_hash)


_NO_EXTRAS = PromptExtras()
