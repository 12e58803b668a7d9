"""Byte sizes and alignment (kvtierd/units.py): one meaning of every unit, everywhere."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.units import ALIGNMENT_BYTES, ceil_div, parse_bytes, round_up


@pytest.mark.parametrize("text, num_bytes", [
    (1048576, 1 << 20), ("1048576", 1 << 20), ("40GB", 40 * 10**9), ("40G", 40 * 10**9), ("40gb", 40 * 10**9),
    ("40GiB", 40 << 30), ("40Gi", 40 << 30), ("512k", 512_000), ("512KiB", 512 << 10), ("256MiB", 256 << 20),
    ("3mb", 3_000_000), ("1 GiB", 1 << 30), ("1T", 10**12), ("1TiB", 1 << 40), ("100B", 100), (" 7 ", 7),
    ("1.5GiB", 3 << 29), ("1.5GB", 1_500_000_000), ("4e10", 4 * 10**10), ("0", 0),
])
def test_si_prefixes_are_powers_of_1000_and_iec_prefixes_powers_of_1024(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "abc", "-1", -1, "1 PiB", "5ib", "GiB", "0.5", "1.0000001k", "1e", "inf",
                                  True, 1.5])
def test_what_is_not_a_whole_byte_count_is_refused_with_an_example(text):
    with pytest.raises(InvalidArgument):
        parse_bytes(text)


def test_round_up_reaches_the_next_multiple_of_the_alignment():
    assert [round_up(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    assert round_up(33, 16) == 48 and ceil_div(33, 16) == 3 and ceil_div(32, 16) == 2


def test_t1_slots_and_t2_slots_share_one_alignment():
    """A slot read with O_DIRECT from T2 lands in a T1 slot without staging: the strides agree."""
    from kvtierd.t1.host_slab import slot_stride
    from kvtierd.t2.ssd_files import ALIGNMENT

    assert ALIGNMENT == ALIGNMENT_BYTES == 4096
    for slot_nbytes in (1, 4096, 128 << 10, (128 << 10) + 1, 819_200):
        assert slot_stride(slot_nbytes) == round_up(slot_nbytes, ALIGNMENT) >= slot_nbytes
