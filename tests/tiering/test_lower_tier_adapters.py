"""The lower tiers behind one interface (tiering/lower_tier.py, lower_tier_adapters.py): chain order,
who takes offers, and each tier's protection of what it claimed until the load released it."""

from __future__ import annotations

import pytest

from kvtierd.movers.copy_engine import Direction
from kvtierd.tier import Tier
from kvtierd.tiering.lower_tier import StoringTier
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.test_tier_manager_ssd import ssd_config
from tests.tiering.tier_factories import make_manager, prefill

PROMPT = tokens(100, 4 * BLOCK_SIZE)
CHAIN = NAMESPACE.hash_blocks(PROMPT)


@pytest.fixture
def manager(tmp_path):
    manager = make_manager(ssd_config=ssd_config(tmp_path), t0_to_t1=EdgePolicy.WRITE_THROUGH)
    prefill(manager, "a", PROMPT)
    manager.release("a")
    manager.drain()  # in T0, T1 and T2
    yield manager
    manager.close()


def rest(manager):
    return manager.promoter._rest(CHAIN, None, 0)


def test_the_tiers_present_come_in_chain_order_and_only_those_below_t1_take_offers(manager):
    levels = manager.promoter.levels
    assert [level.tier for level in levels] == [Tier.T1, Tier.T2]
    assert [isinstance(level, StoringTier) for level in levels] == [False, True]


def test_each_tier_finds_the_whole_chain(manager):
    assert [level.find(rest(manager)) for level in manager.promoter.levels] == [4, 4]


def test_a_t1_claim_pins_its_entries_until_released(manager):
    """A claimed T1 entry is neither removed nor evicted while its load may read it."""
    host_level = manager.promoter.levels[0]
    segment = host_level.claim(rest(manager))
    assert len(segment.metas) == 4 and len(segment.pinned) == 4
    assert manager.tiers.host.index.remove(CHAIN) == []
    host_level.release(segment)
    assert len(manager.tiers.host.index.remove(CHAIN)) == 4


def test_each_tier_s_load_path_is_its_hops_into_t0_at_their_own_bandwidths(manager):
    """T1: an upload of its slots; T2: an SSD read of its slots, then an upload of the blocks."""
    tiers = manager.tiers
    upload = tiers.engine.bandwidth[Direction.HOST_TO_DEVICE]
    host_level, ssd_level = manager.promoter.levels
    assert host_level.load_path(3) == [(upload, 3 * tiers.host.codec.slot_nbytes)]
    assert ssd_level.load_path(3) == [(tiers.ssd_read, 3 * tiers.ssd_codec.slot_nbytes),
                                      (upload, 3 * tiers.layout.bytes_per_block)]


def test_a_t1_read_is_its_own_slots_at_once(manager):
    """T1's blocks are host rows already: no read is started, the upload decodes from its slots."""
    host_level = manager.promoter.levels[0]
    segment = host_level.claim(rest(manager))
    try:
        assert host_level.read(segment) is None
        rows, ids, codec = segment.source
        assert rows is manager.tiers.host.slots and ids == [e.slot for e in segment.pinned]
    finally:
        host_level.release(segment)
