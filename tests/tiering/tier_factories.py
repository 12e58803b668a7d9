"""Factories for tier tests: a manager over a small layout, and KV bytes derived from a hash."""

from __future__ import annotations

import torch

from kvtierd.movers.copy_engine import Bandwidth
from kvtierd.tiering.load_decision import MIN_SAMPLES
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.tiering.tier_manager import TierManager
from tests.factories import BLOCK_SIZE, NAMESPACE, small_layout

LAYOUT = small_layout(BLOCK_SIZE)


def content_for(block_hash: bytes) -> torch.Tensor:
    """The KV a block with this hash holds in these tests: integers exact in fp16."""
    seed = int.from_bytes(block_hash[:4], "little") % 1024
    numel = torch.Size(LAYOUT.block_shape).numel()
    return ((torch.arange(numel) * 7 + seed) % 2048).to(LAYOUT.torch_dtype).view(LAYOUT.block_shape)


def measure(bandwidth: Bandwidth, bytes_per_s: float) -> Bandwidth:
    """Record MIN_SAMPLES samples of `bytes_per_s` (as many copies of that many bytes in 1 s each):
    the fewest a load decision weighs."""
    for _ in range(MIN_SAMPLES):
        bandwidth.record(int(bytes_per_s), 1.0)
    return bandwidth


def make_manager(num_device_blocks: int = 8, host_blocks: int = 32, ssd_config=None, **config) -> TierManager:
    config.setdefault("host_capacity_bytes", host_blocks * 4096)  # slots are page-rounded: 4 KiB each
    return TierManager(LAYOUT, num_device_blocks, TierConfig(**config), ssd_config=ssd_config, device="shm",
                       root=NAMESPACE.root)


def prefill(manager: TierManager, request_id, token_ids: list[int], num_extra_blocks: int = 0):
    """What a runner does: acquire, wait for promotions, compute and commit the rest."""
    chain = NAMESPACE.hash_blocks(token_ids)
    acquisition = manager.acquire(request_id, chain, num_extra_blocks, token_ids)
    num_ready = acquisition.ticket.wait(10)
    for position in range(num_ready, len(chain)):
        manager.device_pool.tensor[acquisition.block_ids[position]] = content_for(chain[position])
    if num_ready < len(chain):
        parent = chain[num_ready - 1] if num_ready else NAMESPACE.root
        manager.commit(request_id, num_ready, chain[num_ready:],
                       token_ids[num_ready * BLOCK_SIZE:len(chain) * BLOCK_SIZE], parent)
    return acquisition, num_ready, chain


def assert_holds(manager: TierManager, block_ids: list[int], chain: list[bytes]) -> None:
    for block_id, block_hash in zip(block_ids, chain):
        assert torch.equal(manager.device_pool.tensor[block_id], content_for(block_hash)), block_id


def promote_exactly(manager: TierManager, request_id, token_ids: list[int]):
    """Acquire a prompt held below T0, wait, and check that every block came back with its own
    bytes. The request still holds the blocks; the acquisition is returned for more checks."""
    chain = NAMESPACE.hash_blocks(token_ids)
    acquisition = manager.acquire(request_id, chain, 0, token_ids)
    assert acquisition.ticket.wait(10) == len(chain)
    assert_holds(manager, acquisition.block_ids, chain)
    return acquisition
