"""The block-hash chain's C loop (kernels/hash_chain.c, built at install as `kvtierd._hash_chain`).

Hashing a chain in Python costs a loop step per block (a concatenation, a call, an append) on top
of the hash itself: 4-5x the bare xxh3 call for a 16-token block. The C loop hashes the same
messages with the same functions Python uses — xxh3-128 from the xxhash package's extension,
SHA-256 from the libcrypto behind hashlib — found here with ctypes and handed to the module by
address, so it links nothing and the digests are those of `xxhash.xxh3_128_digest` and
`hashlib.sha256` (tests/test_hash_chain_native.py compares them). The module also packs a list of
token ids into u32 bytes (kvtierd.token_bytes.pack_token_ids), the step before the chain: ~1.6 ns a
token against array("I", ...)'s ~6.

The extension is optional: without a C compiler at install time, or where a hash function cannot
be found (an xxhash build that hides its symbols, a hashlib without OpenSSL), `native_chain`
answers None for that algorithm and kvtierd.block_hash keeps its Python loop. Set
KVTIERD_PURE_PYTHON_HASH=1 to force the Python loop.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType

NativeChain = Callable[[bytes, int, bytes, bytes, bytes], list[bytes]]  # tokens, stride, head, tail, parent
PackU32 = Callable[[Sequence[int]], bytes]  # a list or tuple of ints -> u32 little-endian each


def _load_module() -> ModuleType | None:
    if os.environ.get("KVTIERD_PURE_PYTHON_HASH") == "1":
        return None
    try:
        from kvtierd import _hash_chain  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _hash_chain


def _function_address(extension_module: str, name: str) -> int:
    """The address of a function exported by an extension module's library (or a library it
    links, found through its handle), once that module is loaded; 0 when absent."""
    try:
        library_path = importlib.import_module(extension_module).__file__
        assert library_path is not None
        library = ctypes.CDLL(library_path, mode=os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 0))
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0
    except (ImportError, OSError, AttributeError):  # no such module or symbol: that algorithm stays in Python
        return 0


def _bind(module: ModuleType) -> dict[str, int]:
    """Hands the module the hash functions' addresses; the algorithms it can then run."""
    xxh3 = _function_address("xxhash._xxhash", "XXH3_128bits")
    # CPython's OpenSSL binding: hashlib.sha256 runs in the libcrypto it links
    sha256 = [_function_address("_hashlib", name) for name in ("SHA256_Init", "SHA256_Update", "SHA256_Final")]
    if not all(sha256):
        sha256 = [0, 0, 0]
    module.bind(xxh3, *sha256)
    algos = {}
    if xxh3:
        algos["xxh3_128"] = module.XXH3_128
    if all(sha256):
        algos["sha256"] = module.SHA256
    return algos


def _native_chains(module: ModuleType | None) -> dict[str, NativeChain]:
    if module is None:
        return {}
    return {algo: functools.partial(module.chain, code) for algo, code in _bind(module).items()}


_MODULE = _load_module()
_CHAINS = _native_chains(_MODULE)


def native_chain(algo: str) -> NativeChain | None:
    """The C loop for `algo` ("sha256", "xxh3_128"), or None where it is not available."""
    return _CHAINS.get(algo)


def native_pack_u32() -> PackU32 | None:
    """The C packer of token ids (OverflowError outside [0, 2**32), TypeError for a non-integer,
    as array("I", ...) raises), or None where it was not built."""
    return _MODULE.pack_u32 if _MODULE is not None else None
