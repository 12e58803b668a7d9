"""Geometry, capacity and fragmentation: the worked examples of the seeds come out exactly."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout, llama3_8b
from kvtierd.planning.capacity import PoolCapacity, format_bytes, layout_lines
from kvtierd.planning.fragmentation import fragmentation, num_slots

# 13B-class geometry of seed 003's incident: 819,200 B per token (40 layers x 40 heads x 128 x fp16).
LLAMA2_13B = Layout("meta-llama/Llama-2-13b-hf", num_layers=40, num_kv_heads=40, head_dim=128, block_size=16)


def test_llama3_8b_block_is_2_mib_and_128_kib_a_token():
    layout = llama3_8b()
    assert layout.bytes_per_token == 128 * 1024
    assert layout.bytes_per_block == 2 * 1024 * 1024
    assert layout.block_shape == (32, 2, 16, 8, 128)


def test_fp8_halves_the_bytes():
    assert llama3_8b(dtype="float8_e4m3fn").bytes_per_token == 64 * 1024


def test_seed_worked_example_34_tokens_block_16():
    """34-token requests at block 16: 48 slots, 14/48 ≈ 29% per slot, 14/34 ≈ 41% per token."""
    frag = fragmentation({34: 1000}, 16)
    assert num_slots(34, 16) == 48
    assert (frag.num_allocated_slots, frag.num_wasted_slots) == (48_000, 14_000)
    assert Fraction(frag.num_wasted_slots, frag.num_allocated_slots) == Fraction(14, 48)
    assert Fraction(frag.num_wasted_slots, frag.num_effective_tokens) == Fraction(14, 34)
    assert f"{frag.waste_per_allocated_slot:.0%}" == "29%" and f"{frag.waste_per_effective_token:.0%}" == "41%"


def test_seed_worked_example_34_tokens_block_8():
    frag = fragmentation([34], 8)
    assert frag.num_allocated_slots == 40 and f"{frag.waste_per_allocated_slot:.0%}" == "15%"


def test_seed_worked_example_200_tokens_block_16():
    frag = fragmentation([200], 16)
    assert frag.num_allocated_slots == 208
    assert Fraction(frag.num_wasted_slots, frag.num_allocated_slots) == Fraction(8, 208)
    assert f"{frag.waste_per_allocated_slot:.1%}" == "3.8%" and f"{frag.waste_per_effective_token:.0%}" == "4%"


def test_a_mixed_distribution_sums_requests():
    frag = fragmentation({34: 7, 200: 3}, 16)
    assert frag.num_requests == 10
    assert frag.num_effective_tokens == 7 * 34 + 3 * 200
    assert frag.num_allocated_slots == 7 * 48 + 3 * 208
    assert "per allocated slot" in frag.describe() and "per effective token" in frag.describe()


@pytest.mark.parametrize("block_size, slots, requests", [(16, 48, 915), (8, 40, 1098)])
def test_seed_capacity_40_gb_at_0_9(block_size, slots, requests):
    """40 GB at 819,200 B/token and utilization 0.9: block 16 → ≈915 requests, block 8 → ≈1,098."""
    assert LLAMA2_13B.bytes_per_token == 819_200
    capacity = PoolCapacity.from_budget(dataclasses.replace(LLAMA2_13B, block_size=block_size), 40e9, 0.9)
    assert capacity.blocks_per_request(34) * block_size == slots
    assert capacity.max_requests(34) == requests


def test_capacity_from_a_budget():
    capacity = PoolCapacity.from_budget(llama3_8b(), 48 * 2**30)
    assert capacity.num_blocks == 48 * 512 and capacity.num_tokens == 48 * 512 * 16
    assert capacity.nbytes == 48 * 2**30
    assert capacity.max_concurrency(8192) == pytest.approx(48.0)  # seed 000 §8.1: 393,216 tokens, 48x
    assert capacity.num_tokens == 393_216
    lines = capacity.lines("T0", 8192)
    assert "24,576 blocks = 393,216 tokens (48.0 GiB)" in lines[0]
    assert "maximum concurrency for 8,192 tokens per request: 48.00x" in lines[1]


def test_a_partial_block_is_paid_in_concurrency():
    capacity = PoolCapacity(llama3_8b(), 100)
    assert capacity.blocks_per_request(17) == 2 and capacity.max_concurrency(17) == 50.0


def test_layout_lines_state_bytes_per_token_and_block():
    text = "\n".join(layout_lines(llama3_8b()))
    assert "131,072 (128.0 KiB)" in text and "2,097,152 (2.0 MiB)" in text


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * 2**20, 5 * 2**40)] == ["512 B", "2.0 KiB", "3.0 MiB", "5.0 TiB"]


@pytest.mark.parametrize("call", [
    lambda: fragmentation([0], 16),
    lambda: fragmentation([10], 0),
    lambda: PoolCapacity.from_budget(llama3_8b(), 1e9, 1.5),
    lambda: PoolCapacity(llama3_8b(), 10).blocks_per_request(0),
    lambda: Layout("m", 0, 8, 128, 16),
    lambda: Layout("m", 32, 8, 128, 16, dtype="int3"),
    lambda: Layout("", 32, 8, 128, 16),
    lambda: Layout("m", 32, 8, 128, 16, tp_rank=2, tp_size=2),
])
def test_bad_geometry_is_refused(call):
    with pytest.raises(InvalidArgument):
        call()


def test_fingerprint_separates_every_field():
    base = llama3_8b()
    variants = [dataclasses.replace(base, **change) for change in (
        {"model_id": "x"}, {"num_layers": 31}, {"num_kv_heads": 4}, {"head_dim": 64}, {"block_size": 32},
        {"dtype": "bfloat16"}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2})]
    prints = {base.fingerprint()} | {v.fingerprint() for v in variants}
    assert len(prints) == len(variants) + 1
