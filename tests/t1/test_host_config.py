"""The [host] section (kvtierd/t1/host_config.py): T1's values are checked where they are defined."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.t1.host_config import HostConfig


def test_an_idle_s_of_zero_means_never_idle_and_a_negative_one_is_refused():
    """0 turns idleness off (a valid value); below 0 is an InvalidArgument that names the key."""
    assert HostConfig(idle_s=0).idle_s == 0
    with pytest.raises(InvalidArgument, match=r"host\.idle_s must be >= 0"):
        HostConfig(idle_s=-0.5)


@pytest.mark.parametrize("codec", ["raw", "fp8"])
def test_each_block_codec_is_a_valid_host_codec(codec):
    assert HostConfig(codec=codec).codec == codec


def test_an_unknown_codec_is_refused_with_the_choices():
    """A typo in the daemon file fails at load, naming every codec there is, not at T1's first store."""
    with pytest.raises(InvalidArgument, match=r"host\.codec must be one of raw, fp8; got 'zstd'"):
        HostConfig(codec="zstd")
