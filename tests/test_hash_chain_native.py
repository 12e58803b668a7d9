"""The block-hash chain's C loop (kvtierd._hash_chain): the same digests as the Python loop and as
the bare hash functions, the same packing and refusals as array("I"), and built wherever a C
compiler was there at install."""

from __future__ import annotations

import array
import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.block_hash import MultimodalInput, Namespace, PromptExtras
from kvtierd.errors import InvalidArgument
from kvtierd.hash_chain_native import native_chain, native_pack_u32
from kvtierd.layout import llama3_8b
from kvtierd.token_bytes import pack_token_ids

ALGOS = ["sha256", "xxh3_128"]
BARE = {"sha256": lambda m: hashlib.sha256(m).digest(), "xxh3_128": xxhash.xxh3_128_digest}
BLOCK_SIZE = 16
COMPILER = shutil.which("cc") or shutil.which("gcc")


def python_loop(namespace: Namespace) -> Namespace:
    """The namespace with its C loop set aside: hash_blocks runs the Python loop."""
    namespace._native_chain = None
    return namespace


def chain_by_hand(algo: str, tokens: bytes, parent: bytes, head: bytes, tail: bytes) -> list[bytes]:
    """Each block's message `head + tokens + tail + parent`, hashed by the bare function."""
    stride = 4 * BLOCK_SIZE
    chain = []
    for start in range(0, len(tokens) - stride + 1, stride):
        parent = BARE[algo](head + tokens[start:start + stride] + tail + parent)
        chain.append(parent)
    return chain


def test_the_c_loop_is_built_where_a_compiler_is():
    """An install on a machine with a C compiler has the C loop for both algorithms and the packer
    (a failed build would fall back silently, slower: this is where it shows)."""
    if COMPILER is None:
        pytest.skip("no C compiler on this machine: the package installs without the C loop")
    assert native_chain("sha256") is not None
    assert native_chain("xxh3_128") is not None
    assert native_pack_u32() is not None


@pytest.mark.parametrize("algo", ALGOS)
@given(num_tokens=st.integers(0, 40 * BLOCK_SIZE + 15), seed=st.integers(0, 2**32 - 1))
def test_the_c_loop_hashes_as_the_bare_function(algo, num_tokens, seed):
    chain = native_chain(algo)
    if chain is None:
        pytest.skip("the C loop is not built here")
    namespace = Namespace(llama3_8b(BLOCK_SIZE), tenant="t", algo=algo)
    tokens = np.random.default_rng(seed).integers(0, 2**32, num_tokens, dtype=np.uint32).astype("<u4").tobytes()
    head, tail = namespace._tokens_head, namespace._parent_head
    expected = chain_by_hand(algo, tokens, namespace.root, head, tail)
    assert chain(tokens, 4 * BLOCK_SIZE, head, tail, namespace.root) == expected
    assert len(expected) == num_tokens // BLOCK_SIZE


@pytest.mark.parametrize("algo", ALGOS)
def test_hash_blocks_gives_the_same_chain_through_either_loop(algo):
    """Whole chains and continued ones (start_block, parent), list and array input."""
    token_ids = np.random.default_rng(7).integers(0, 128_256, 4096 + 9, dtype=np.uint32)
    native = Namespace(llama3_8b(BLOCK_SIZE), tenant="t", algo=algo)
    python = python_loop(Namespace(llama3_8b(BLOCK_SIZE), tenant="t", algo=algo))
    whole = python.hash_blocks(token_ids.tolist())
    assert native.hash_blocks(token_ids.tolist()) == whole
    assert native.hash_blocks(token_ids) == whole
    assert len(whole) == 256
    tail = native.hash_blocks(token_ids[100 * BLOCK_SIZE:], start_block=100, parent=whole[99])
    assert tail == whole[100:]
    assert python.hash_blocks(token_ids[100 * BLOCK_SIZE:], start_block=100, parent=whole[99]) == tail


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("extras", [PromptExtras(cache_salt="s"), PromptExtras(cache_salt=""),
                                    PromptExtras(lora_id="a", cache_salt="s"),
                                    PromptExtras(mm_inputs=(MultimodalInput("img", 40, 20),))])
def test_a_salted_or_extra_keyed_chain_is_the_same_through_either_loop(algo, extras):
    """A salt keys block 0 only (the C loop takes the rest); LoRA and multimodal inputs keep the
    Python loop. Either way the chain equals the Python loop's, whole and continued."""
    token_ids = list(range(7, 7 + 16 * 20 + 3))
    native = Namespace(llama3_8b(BLOCK_SIZE), algo=algo)
    python = python_loop(Namespace(llama3_8b(BLOCK_SIZE), algo=algo))
    whole = python.hash_blocks(token_ids, extras)
    assert native.hash_blocks(token_ids, extras) == whole
    assert whole != python.hash_blocks(token_ids)  # the extras did key the chain
    assert native.hash_blocks(token_ids[16 * 5:], extras, start_block=5, parent=whole[4]) == whole[5:]
    assert native.hash_blocks(token_ids[:10], extras) == []


def test_the_c_loop_refuses_a_wrong_parent_or_stride():
    chain = native_chain("xxh3_128")
    if chain is None:
        pytest.skip("the C loop is not built here")
    with pytest.raises(ValueError):
        chain(b"\0" * 64, 64, b"h", b"t", b"\0" * 32)  # a sha256-sized parent for xxh3
    with pytest.raises(ValueError):
        chain(b"\0" * 64, 0, b"h", b"t", b"\0" * 16)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_packing_gives_array_u32_bytes(token_ids):
    expected = array.array("I", token_ids)
    if sys.byteorder == "big":
        expected.byteswap()
    assert pack_token_ids(token_ids) == expected.tobytes()
    assert pack_token_ids(tuple(token_ids)) == expected.tobytes()


def test_packing_takes_numpy_and_bool_items_as_array_does():
    assert pack_token_ids([np.int64(3), np.uint32(2**32 - 1), True]) == array.array("I", [3, 2**32 - 1, 1]).tobytes()


@pytest.mark.parametrize("bad", [[-1], [0, 2**32], [-2**40], [1.5], ["7"], [None], [2**64]])
def test_packing_refuses_what_is_not_a_u32(bad):
    with pytest.raises(InvalidArgument, match="token ids must be integers"):
        pack_token_ids(bad)


def test_the_python_loop_is_what_runs_without_the_c_loop():
    """KVTIERD_PURE_PYTHON_HASH=1 (or a package built without a compiler): no C loop, same chain."""
    code = ("from kvtierd.hash_chain_native import native_chain, native_pack_u32\n"
            "from kvtierd.block_hash import Namespace\nfrom kvtierd.layout import llama3_8b\n"
            "assert native_chain('xxh3_128') is None and native_pack_u32() is None\n"
            "print(Namespace(llama3_8b(16), algo='xxh3_128').hash_blocks(list(range(100)))[-1].hex())")
    environment = {**os.environ, "KVTIERD_PURE_PYTHON_HASH": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                            check=True)
    expected = Namespace(llama3_8b(16), algo="xxh3_128").hash_blocks(list(range(100)))[-1].hex()
    assert result.stdout.strip() == expected


def test_packing_a_list_that_an_item_empties_is_an_error_not_a_crash():
    """An item's __index__ runs Python, which may change the list being packed."""
    pack_u32 = native_pack_u32()
    if pack_u32 is None:
        pytest.skip("the C packer is not built here")

    class EmptiesTheList:
        def __init__(self, token_ids: list) -> None:
            self.token_ids = token_ids

        def __index__(self) -> int:
            self.token_ids.clear()
            return 1

    token_ids: list = [1, 2]
    token_ids += [EmptiesTheList(token_ids), 3, 4]
    with pytest.raises(RuntimeError, match="changed while being packed"):
        pack_u32(token_ids)
