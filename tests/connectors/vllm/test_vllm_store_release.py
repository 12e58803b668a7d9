"""A store's Commit releases its request; against a daemon that does not (it predates the field),
the worker releases it itself."""

from __future__ import annotations

import os

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.connectors.vllm.vllm_fakes import BLOCK_SIZE, Engine, Request, prompt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("module, num_rpcs", [("kvtierd.cli.kvtierd_main", 2),
                                              ("tests.server.commit_without_release_serve", 3)])
def test_a_store_holds_nothing_once_done_and_calls_release_only_when_the_commit_did_not(tmp_path, module, num_rpcs):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with DaemonProcess(small_daemon_args(str(tmp_path)), env=env, module=module) as daemon:
        engine = Engine(daemon.address)
        try:
            request = Request("a", prompt(3, 5 * BLOCK_SIZE + 3))
            engine.finish(request, engine.prefill(request).engine_block_ids)
            engine.drain()
            stats = engine.worker.get_kv_connector_stats()
            with KvtierClient(daemon.address) as client:
                pool = client.stats().pools[0]
                session = client.attach(engine.worker._worker().link.layout, map_pool=False)
                num_held = session.lookup(request.block_hashes, token_ids=request.all_token_ids).total.num_blocks
        finally:
            engine.close()
    assert stats.data["stored_blocks"] == 5 and stats.data["store_rpcs"] == num_rpcs
    assert pool.num_free_blocks == pool.num_blocks and num_held == 5
