"""The model kinds users serve, through real vLLM engines (the CPU build, .venv-vllm) and KvtierdConnector
to a real `kvtierd serve`: sliding window + full attention (Gemma-3-, gpt-oss-style), linear attention +
full attention (Qwen3-Next-style), MLA (DeepSeek-V2-style), at TP 1 and 2 (tests/connectors/vllm/model_kinds.py).

Per kind, two engine processes with vLLM's prefix cache on and the connector: one that stores (P2
prefilled fresh; P1, whose prefix shared with P2 is vLLM's own hit; P2 and P1 again, all of them
vLLM's own hits), and a new one that restores P2 from kvtierd, then P1. The models have real random
weights (written with transformers), and text from them is meaningless, so what is compared is what
decides it: the sampled tokens' logprobs, bit for bit against the storing engine's run that vLLM
computed the same way (as many tokens from its own cache), and the KV bytes of every block of every
KV cache group after every engine step (tests/connectors/vllm/recording_connector.py). For the
hybrid kinds a third engine without the connector shows that vLLM keeps its hybrid allocator on
(the same KV cache size) and computes P2 as the storing engine did.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
import shutil
import subprocess
import tempfile

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.conftest import REPO
from tests.connectors.vllm.engine_process import EngineProcess, engine_env
from tests.connectors.vllm.model_kinds import KINDS, ModelKind

KINDS_MAIN = pathlib.Path(__file__).with_name("kinds_engine_main.py")
PREFIX_LEN, SUFFIX_LEN = 352, 40  # 11 blocks of 32 (2 of 160 and a part, for Qwen3-Next's forced block size)
_rng = random.Random(21)
PREFIX = [_rng.randrange(3, 1000) for _ in range(PREFIX_LEN)]
P1 = PREFIX + [_rng.randrange(3, 1000) for _ in range(SUFFIX_LEN)]
P2 = PREFIX + [_rng.randrange(3, 1000) for _ in range(SUFFIX_LEN)]
# The storing engine's prompts: each fresh, then each again on vLLM's own prefix cache (P1 first hits
# the prefix P2 left, then its whole self).
STORED = [P2, P1, P2, P1]
GROUPS = {"gemma3": 2, "gptoss": 2, "qwen3next": 2, "deepseekv2": 1, "deepseekv2-tp2": 1, "llama-tp2": 1}
KV_CACHE_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


@pytest.fixture
def short_dir():
    """A directory with a short path: a unix socket path must fit in 108 bytes."""
    directory = tempfile.mkdtemp(prefix="kvk-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def kind_engine(vllm_python: str, kind: ModelKind, model_dir: pathlib.Path, directory: pathlib.Path, name: str,
                prompts: list[list[int]], address: str | None, *flags: str) -> EngineProcess:
    prompts_json = directory / f"{name}.prompts.json"
    prompts_json.write_text(json.dumps(prompts))
    command = [vllm_python, "-P", str(KINDS_MAIN), kind.name, str(model_dir), str(directory / f"{name}.json"),
               "--prompts", str(prompts_json)]
    if address is not None:
        command += ["--address", address]
    command += flags
    env = engine_env(**kind.env(), KVTIERD_REPO=str(REPO), PYTHONPATH=str(REPO),
                     KVTIERD_TEST_RECORD=str(directory / f"{name}.records"))
    return EngineProcess(command, directory, name, env, timeout_s=600)


def recorded(directory: pathlib.Path, name: str) -> tuple[dict, dict[tuple, set[str]]]:
    """(the connector's config record, block digests by (prompt, tokens computed, group, position, rank)).

    A key can have more than one digest: the storing engine runs P2 twice, and vLLM's CPU kernels
    are not batch-invariant, so the second run, batched beside other requests as the machine's load
    decides, may compute low bits of a block differently. kvtierd holds one of those runs' bytes."""
    config, blocks = {}, {}
    for line in (directory / f"{name}.records").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "config":
            config = record
        else:
            key = (record["prompt"], record["computed"], record["group"], record["position"], record["rank"])
            blocks.setdefault(key, set()).add(record["digest"])
    return config, blocks


def kv_cache_tokens(engine: EngineProcess) -> int:
    """The KV cache size vLLM reports at start ("CPU KV cache size: 516,222 tokens")."""
    found = KV_CACHE_TOKENS.search(engine.log())
    assert found, engine.failure_report()
    return int(found.group(1).replace(",", ""))


def connector_lines(engine: EngineProcess) -> list[str]:
    """The connector's own log lines (attaches, lookups counted as misses, dropped stores)."""
    return [line for line in engine.log().splitlines() if "kvtierd connector" in line]


def write_model(vllm_python: str, kind: ModelKind, directory: pathlib.Path) -> pathlib.Path:
    done = subprocess.run([vllm_python, "-m", "tests.connectors.vllm.model_kinds", kind.name, str(directory)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return directory


def vllm_computed_alike(stored: dict, prompt: list[int], num_cached_tokens: int) -> int:
    """The storing engine's run of `prompt` that vLLM computed as the restoring engine did: with as many
    tokens from its own prefix cache (a restore from kvtierd is then bit for bit that run), else its
    fresh prefill (a kind whose vLLM keeps nothing to hit: Qwen3-Next's linear attention). Not always
    the fresh run: MLA's prefix path differs from its fresh prefill by up to 0.3 nats on these
    weights, in vLLM alone as much as with kvtierd."""
    runs = [i for i, p in enumerate(STORED) if p == prompt]
    alike = [i for i in runs if stored["num_cached_tokens"][i] == num_cached_tokens]
    return alike[0] if alike else runs[0]


def kind_params(names) -> list:
    """The kinds, those at TP 2 marked `alone`: their ranks bind an OpenMP thread set to each of the
    2 cores, and beside another engine the daemon starves (Attach and KeepAlive time out)."""
    return [pytest.param(name, marks=pytest.mark.alone) if KINDS[name].tensor_parallel_size > 1 else name
            for name in names]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("kind_name", kind_params(sorted(GROUPS)))
def test_a_new_engine_restores_a_prefix_with_the_bytes_and_logprobs_of_vllm(vllm_python, tmp_path, short_dir,
                                                                           kind_name):
    """The restoring engine's logprobs equal vLLM's own prefix-cache hit's, bit for bit (a fresh
    prefill's where vLLM keeps nothing to hit); every block it holds after every step has the storing
    engine's bytes, in every group on every rank."""
    kind = KINDS[kind_name]
    model_dir = write_model(vllm_python, kind, tmp_path / "model")
    args = small_daemon_args(short_dir, t0_bytes="64MiB", host_bytes="64MiB", ssd_bytes="128MiB")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        storing = kind_engine(vllm_python, kind, model_dir, tmp_path, "stored", STORED, daemon.address)
        stored = storing.result()
        restoring = kind_engine(vllm_python, kind, model_dir, tmp_path, "restored", [P2, P1], daemon.address)
        restored = restoring.result()
        pools = [(pool.layout.tp_rank, pool.layout.tp_size) for pool in client.stats().pools]
    config, stored_blocks = recorded(tmp_path, "stored")
    _, restored_blocks = recorded(tmp_path, "restored")
    assert config["num_groups"] == GROUPS[kind_name], config  # vLLM kept every group: the hybrid allocator is on
    num_shards = kind.tensor_parallel_size // config["replicas"]  # MLA's latent is one copy for every rank
    assert sorted(pools) == [(rank, num_shards) for rank in range(num_shards)], pools  # every group in one pool

    assert stored["num_cached_tokens"][0] == 0 and restored["num_cached_tokens"][0] > 0, \
        (stored["num_cached_tokens"], restored["num_cached_tokens"], connector_lines(storing),
         connector_lines(restoring))
    assert sum(restored["cached_tokens_by_source"].values()) >= restored["num_cached_tokens"][0]  # from kvtierd
    for position, prompt in enumerate([P2, P1]):
        same = vllm_computed_alike(stored, prompt, restored["num_cached_tokens"][position])
        assert restored["logprobs"][position] == stored["logprobs"][same], (position, same, stored["num_cached_tokens"])
        assert restored["output_token_ids"][position] == stored["output_token_ids"][same]

    assert restored_blocks, "the restoring engine recorded no block"
    assert {key[2] for key in restored_blocks} == {key[2] for key in stored_blocks}  # every group
    assert {key[4] for key in restored_blocks} == set(range(num_shards))
    differing = [key for key, digests in restored_blocks.items() if not digests <= stored_blocks.get(key, set())]
    assert not differing, differing[:5]

    if GROUPS[kind_name] > 1:
        # vLLM turns its hybrid allocator off for a connector without SupportsHMA (one group, fewer
        # tokens of KV cache in the same memory); with kvtierd's the engine keeps the size it has
        # without a connector, and computes what it computes without one.
        without = kind_engine(vllm_python, kind, model_dir, tmp_path, "without", [P2], None)
        alone = without.result()
        assert kv_cache_tokens(storing) == kv_cache_tokens(without) > 0
        assert alone["logprobs"][0] == stored["logprobs"][0]  # P2 fresh both times
        assert alone["output_token_ids"][0] == stored["output_token_ids"][0]


@pytest.mark.timeout(600)
def test_a_linear_attention_model_without_prefix_caching_is_refused_at_start_in_one_line(vllm_python, tmp_path,
                                                                                       short_dir):
    """Qwen3-Next-style with vLLM's prefix caching off has no state at block boundaries to store: the
    engine does not start, and its log names the kind and the fix in one line; nothing was half served."""
    kind = KINDS["qwen3next"]
    model_dir = write_model(vllm_python, kind, tmp_path / "model")
    args = small_daemon_args(short_dir)
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        engine = kind_engine(vllm_python, kind, model_dir, tmp_path, "refused", [P1], daemon.address,
                             "--no-prefix-caching")
        assert engine.process.wait(300) != 0
        assert list(client.stats().pools) == []  # no layout was ever attached
    lines = [line for line in engine.log().splitlines() if "UnsupportedModel:" in line]
    assert lines and "linear-attention / Mamba" in lines[-1] and "--enable-prefix-caching" in lines[-1], \
        engine.failure_report()
