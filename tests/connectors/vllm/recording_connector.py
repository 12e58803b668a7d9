"""KvtierdConnector plus a record of the engine's KV, for the model-kind tests: after every step's
forward, a digest of every block of every scheduled request, per KV cache group, as vLLM's own
block tables name them (its null block skipped).

Loaded by vLLM as `kv_connector_module_path="tests.connectors.vllm.recording_connector"` (the repo
root on PYTHONPATH); records go to the JSON-lines file named by KVTIERD_TEST_RECORD, one per
(request, tokens computed after the step, group, chain position): a request is named by a digest
of its prompt, so runs in different engines compare. Test code only: the connector it wraps is
the product, unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from kvtierd.connectors.vllm.connector import KvtierdConnector
from kvtierd.connectors.vllm.kv_groups import NULL_BLOCK_ID
from kvtierd.connectors.vllm.metadata import StepMetadata

RECORD_ENV = "KVTIERD_TEST_RECORD"


def prompt_key(token_ids) -> str:
    return hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:16]


@dataclasses.dataclass(slots=True)
class RecordedStep(StepMetadata):
    """A step's metadata with each scheduled request's (prompt key, tokens computed after the
    step, block ids per group)."""

    tables: dict = dataclasses.field(default_factory=dict)


def _write(record: dict) -> None:
    with open(os.environ[RECORD_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")


class RecordingConnector(KvtierdConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.role_name == "scheduler":
            _write({"kind": "config", "num_blocks": kv_cache_config.num_blocks,
                    "num_groups": len(kv_cache_config.kv_cache_groups),
                    "groups": self.engine_groups.signature(), "layout": self.layout.model_id,
                    "dtype": self.layout.dtype, "replicas": getattr(kv_cache_config, "kv_tp_replicas", 1)})

    def build_connector_meta(self, scheduler_output) -> RecordedStep:
        metadata = super().build_connector_meta(scheduler_output)
        manager = self._kv_cache_manager
        tables = {}
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self.scheduler._tracked.get(request_id)
            if tracked is None or manager is None:
                continue
            request = tracked.request
            tables[request_id] = (prompt_key(request.prompt_token_ids),
                                  min(request.num_computed_tokens + num_scheduled, request.num_tokens),
                                  [list(ids) for ids in manager.get_block_ids(request_id)])
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return RecordedStep(**fields, tables=tables)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        pages = self.worker.pages
        for key, num_computed, tables in self._step().tables.values():
            for group in self.engine_groups.groups:
                for position, block_id in enumerate(tables[group.group_id]):
                    if block_id == NULL_BLOCK_ID or (position + 1) * group.block_size > num_computed:
                        continue  # only full blocks the engine has computed or loaded
                    digest = hashlib.sha256()
                    for layer_pages in pages.pages[group.group_id]:
                        digest.update(layer_pages[block_id].cpu().contiguous().numpy().tobytes())
                    _write({"kind": "block", "prompt": key, "computed": num_computed, "group": group.group_id,
                            "position": position, "rank": self.layout.tp_rank, "digest": digest.hexdigest()[:32]})
