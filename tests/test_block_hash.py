"""Block keys: the pinned encoding, chain properties, extra keys and isolation."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from kvtierd.block_hash import MultimodalInput, Namespace, PromptExtras
from kvtierd.errors import InvalidArgument
from kvtierd.layout import llama3_8b
from kvtierd.token_bytes import pack_token_ids

ALGOS = ["sha256", "xxh3_128"]
PROMPT = list(range(1000, 1000 + 16 * 6 + 5))  # six full blocks of 16 and a partial one


def namespace(algo="sha256", tenant="", **layout_changes) -> Namespace:
    return Namespace(dataclasses.replace(llama3_8b(), **layout_changes), tenant=tenant, algo=algo)


# Pinned test vectors: these digests are the contract with every process and every restart.
# If one changes, hashes computed before the change no longer hit: bump VERSION instead.
PINNED = {
    "sha256": {
        "root": "0627808bbc61855bbbd0f8740eab29bea7ea43ce49e1bdae29296e721eea36c4",
        "chain": ["a1c75dedcbbff1c2fea7e9ac1a30da2160fbe2e9be44674f4c263bb8df6311a3",
                  "62513f7e146617a8cfb7da89d45096c160197fd30a1055a662eb13cf583aa505"],
    },
    "xxh3_128": {
        "root": "98f2750a6e0c59d0982ec44b3c8f93fd",
        "chain": ["2f939e48b54357af606451f9f3534501", "612364c8fa179c7fffa271c14bbc51d8"],
    },
}


@pytest.mark.parametrize("algo", ALGOS)
def test_pinned_vectors(algo):
    """The root and first hashes of Llama-3-8B, tenant "", tokens 0..39 never change."""
    ns = namespace(algo)
    assert ns.root.hex() == PINNED[algo]["root"]
    assert [h.hex() for h in ns.hash_blocks(range(40))] == PINNED[algo]["chain"]


def spec_field(tag: int, value: bytes) -> bytes:
    return bytes([tag]) + len(value).to_bytes(4, "little") + value


@pytest.mark.parametrize("algo", ALGOS)
def test_hashes_follow_the_documented_encoding(algo):
    """An independent rebuild of the documented byte encoding gives the same digests."""
    digest = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxh3_128": xxhash.xxh3_128_digest}[algo]
    layout = llama3_8b()
    model = layout.model_id.encode()
    fingerprint = (struct.pack("<I", len(model)) + model
                   + struct.pack("<7I", 32, 8, 128, 16, 0, 1, 7) + b"float16"
                   + struct.pack("<I", 26) + b"layers,kv,tokens,heads,dim")
    header = b"kvtierd\x00\x01"
    root = digest(header + b"R" + spec_field(1, algo.encode()) + spec_field(2, fingerprint)
                  + spec_field(3, b"acme"))
    extras = PromptExtras(lora_id="sql-lora", mm_inputs=(MultimodalInput(b"\xaa" * 8, 20, 4),),
                          cache_salt="s1")
    tokens = PROMPT[:32]
    block0 = digest(header + b"B"
                    + spec_field(0x11, b"".join(t.to_bytes(4, "little") for t in tokens[:16]))
                    + spec_field(0x10, root)
                    + spec_field(0x12, b"sql-lora") + spec_field(0x14, b"s1"))
    block1 = digest(header + b"B"
                    + spec_field(0x11, b"".join(t.to_bytes(4, "little") for t in tokens[16:]))
                    + spec_field(0x10, block0)
                    + spec_field(0x12, b"sql-lora")
                    + spec_field(0x13, b"\xaa" * 8 + struct.pack("<II", 20, 4)))
    ns = Namespace(layout, tenant="acme", algo=algo)
    assert ns.root == root
    assert ns.hash_blocks(tokens, extras) == [block0, block1]


@pytest.mark.parametrize("algo", ALGOS)
def test_foreign_keys_follow_the_documented_encoding_and_depend_on_every_part(algo):
    """An engine's own keys (SGLang's page hashes): one digest of kind F over the root, the scheme and
    the key; another layout, tenant or scheme gives other hashes, and none is a chain hash."""
    digest = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxh3_128": xxhash.xxh3_128_digest}[algo]
    ns = namespace(algo, tenant="acme")
    keys = ["ab" * 32, "page-2"]
    expected = [digest(b"kvtierd\x00\x01" + b"F" + spec_field(0x10, ns.root) + spec_field(0x20, b"sglang")
                       + spec_field(0x21, key.encode())) for key in keys]
    assert ns.foreign_keys("sglang", keys) == expected
    others = [namespace(algo, tenant="globex").foreign_keys("sglang", keys),
              namespace(algo, tenant="acme", num_layers=16).foreign_keys("sglang", keys),
              ns.foreign_keys("other-engine", keys)]
    assert all(set(other).isdisjoint(expected) for other in others)


@pytest.mark.parametrize("algo", ALGOS)
def test_digest_sizes(algo):
    ns = namespace(algo)
    assert {len(h) for h in ns.hash_blocks(PROMPT)} == {ns.digest_size}
    assert ns.digest_size == {"sha256": 32, "xxh3_128": 16}[algo]


@pytest.mark.parametrize("algo", ALGOS)
def test_partial_last_block_gets_no_hash(algo):
    ns = namespace(algo)
    assert len(ns.hash_blocks(PROMPT)) == 6
    assert len(ns.hash_blocks(PROMPT[:16 * 6])) == 6
    assert len(ns.hash_blocks(PROMPT[:16 * 6 - 1])) == 5
    assert ns.hash_blocks(PROMPT[:15]) == []


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("k", [0, 2, 5])
def test_changing_one_token_in_block_k_changes_hashes_from_k_on(algo, k):
    ns = namespace(algo)
    base = ns.hash_blocks(PROMPT)
    changed = list(PROMPT)
    changed[k * 16 + 7] += 1
    after = ns.hash_blocks(changed)
    assert after[:k] == base[:k]
    assert all(a != b for a, b in zip(after[k:], base[k:]))


def test_a_token_in_the_partial_block_changes_nothing():
    ns = namespace()
    changed = list(PROMPT)
    changed[-1] += 1
    assert ns.hash_blocks(changed) == ns.hash_blocks(PROMPT)


BASE_EXTRAS = PromptExtras(lora_id="lora-1", cache_salt="salt-1")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("tenant, extras, layout_changes, swap_algo", [
    ("tenant-b", BASE_EXTRAS, {}, False),
    ("tenant-a", PromptExtras(lora_id="lora-1", cache_salt="salt-2"), {}, False),
    ("tenant-a", PromptExtras(lora_id="lora-2", cache_salt="salt-1"), {}, False),
    ("tenant-a", BASE_EXTRAS, dict(dtype="bfloat16"), False),
    ("tenant-a", BASE_EXTRAS, dict(model_id="other-model"), False),
    ("tenant-a", BASE_EXTRAS, dict(tp_rank=1, tp_size=2), False),
    ("tenant-a", BASE_EXTRAS, {}, True),
], ids=["tenant", "salt", "lora", "dtype", "model", "tp", "algo"])
def test_namespace_and_extras_change_every_hash(algo, tenant, extras, layout_changes, swap_algo):
    """A different salt, LoRA, tenant, layout or hash function shares no block hash."""
    base = Namespace(llama3_8b(), tenant="tenant-a", algo=algo).hash_blocks(PROMPT, BASE_EXTRAS)
    other_algo = {"sha256": "xxh3_128", "xxh3_128": "sha256"}[algo] if swap_algo else algo
    layout = dataclasses.replace(llama3_8b(), **layout_changes)
    other = Namespace(layout, tenant=tenant, algo=other_algo).hash_blocks(PROMPT, extras)
    assert len(other) == len(base)
    assert not set(base) & set(other)


def test_same_text_in_lora_salt_and_tenant_never_collides():
    """The untagged-string collision (vLLM #44701) is impossible: fields are tagged and framed."""
    layout = llama3_8b()
    chains = {
        "lora": Namespace(layout).hash_blocks(PROMPT, PromptExtras(lora_id="x")),
        "salt": Namespace(layout).hash_blocks(PROMPT, PromptExtras(cache_salt="x")),
        "tenant": Namespace(layout, tenant="x").hash_blocks(PROMPT),
        "lora+salt split 1": Namespace(layout).hash_blocks(PROMPT, PromptExtras(lora_id="ab", cache_salt="c")),
        "lora+salt split 2": Namespace(layout).hash_blocks(PROMPT, PromptExtras(lora_id="a", cache_salt="bc")),
        "mm as salt": Namespace(layout).hash_blocks(
            PROMPT, PromptExtras(mm_inputs=(MultimodalInput("x", 0, 4),))),
    }
    first_blocks = [chain[0] for chain in chains.values()]
    assert len(set(first_blocks)) == len(first_blocks)


def test_model_and_tenant_boundaries_are_framed():
    roots = {Namespace(dataclasses.replace(llama3_8b(), model_id=m), tenant=t).root
             for m, t in [("ab", "c"), ("a", "bc"), ("abc", "")]}
    assert len(roots) == 3


def test_multimodal_input_changes_only_the_blocks_it_overlaps_and_after():
    ns = namespace()
    plain = ns.hash_blocks(PROMPT)
    with_image = ns.hash_blocks(PROMPT, PromptExtras(mm_inputs=(MultimodalInput("img-1", 40, 8),)))
    assert with_image[:2] == plain[:2]  # tokens 0..31 do not overlap [40, 48)
    assert all(a != b for a, b in zip(with_image[2:], plain[2:]))
    other_image = ns.hash_blocks(PROMPT, PromptExtras(mm_inputs=(MultimodalInput("img-2", 40, 8),)))
    assert other_image[:2] == plain[:2] and other_image[2] != with_image[2]


def test_cache_salt_is_on_block_zero_only_but_changes_the_chain():
    ns = namespace()
    salted = ns.hash_blocks(PROMPT, PromptExtras(cache_salt="s"))
    # Continuing a salted chain from block 2 needs no salt: only block 0 carries it.
    assert ns.hash_blocks(PROMPT[32:], start_block=2, parent=salted[1]) == salted[2:]


@pytest.mark.parametrize("algo", ALGOS)
def test_continuing_a_chain_equals_hashing_it_whole(algo):
    ns = namespace(algo)
    whole = ns.hash_blocks(PROMPT, PromptExtras(lora_id="l"))
    assert ns.hash_blocks(PROMPT[48:], PromptExtras(lora_id="l"), start_block=3, parent=whole[2]) == whole[3:]


def test_token_containers_hash_alike():
    ns = namespace()
    expected = ns.hash_blocks(PROMPT)
    assert ns.hash_blocks(np.array(PROMPT, dtype=np.int64)) == expected
    assert ns.hash_blocks(np.array(PROMPT, dtype=np.uint32)) == expected
    assert ns.hash_blocks(torch.tensor(PROMPT)) == expected
    assert ns.hash_blocks(tuple(PROMPT)) == expected


def test_the_root_is_the_same_in_another_process():
    """No per-process seed: a second interpreter (a restarted daemon) computes the same hashes."""
    code = ("from kvtierd.block_hash import Namespace; from kvtierd.layout import llama3_8b; "
            "ns = Namespace(llama3_8b(), tenant='t'); print(ns.hash_blocks(range(64))[-1].hex())")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out == Namespace(llama3_8b(), tenant="t").hash_blocks(range(64))[-1].hex()


@pytest.mark.parametrize("bad", [[-1, 2, 3], [2**32], [1.5, 2.0], [[1, 2], [3, 4]]])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(InvalidArgument):
        pack_token_ids(bad)


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgument):
        Namespace(llama3_8b(), algo="md5")
    ns = namespace()
    with pytest.raises(InvalidArgument):
        ns.hash_blocks(PROMPT, start_block=1, parent=b"short")
    with pytest.raises(InvalidArgument):
        ns.hash_blocks(PROMPT, start_block=1)
    with pytest.raises(InvalidArgument):
        MultimodalInput("img", -1, 4)
    with pytest.raises(InvalidArgument):
        ns.check_hash(b"\x00" * 16)
    assert ns.check_hash(b"\x00" * 32) == b"\x00" * 32


@pytest.mark.parametrize("algo", ALGOS)
def test_a_long_prompt_hashes_as_block_by_block(algo):
    """The bulk layout (many blocks) and the per-block path give the same chain."""
    ns = namespace(algo)
    prompt = list(range(7, 7 + 16 * 40))
    one_at_a_time, parent = [], None
    for block in range(40):
        parent = ns.hash_blocks(prompt[block * 16:(block + 1) * 16], start_block=block, parent=parent)[0]
        one_at_a_time.append(parent)
    assert ns.hash_blocks(prompt) == one_at_a_time
