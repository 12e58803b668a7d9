"""End to end: real vLLM engines (the CPU build, in .venv-vllm) through KvtierdConnector to a real
`kvtierd serve`.

Each engine is its own process tree (tests/connectors/vllm/vllm_engine_main.py), started in a session of its
own so that a timeout or a SIGKILL reaches all of it. At TP 1 vLLM runs the worker in the engine
core's process (the "uni" executor), so both connector roles share that process; the engine core
runs in the LLM process here (VLLM_ENABLE_V1_MULTIPROCESSING=0: it starts in ~15 s instead of
~40 s on 2 cores) except in the first test, which keeps vLLM's default split of the LLM process
and the engine core process, as `vllm serve` runs it.
The model is a tiny random Llama; decoding is greedy, so every engine must produce exactly the
tokens of the engine without a connector (the reference), whatever it loaded from the daemon.
vLLM's prefix cache is off in every engine: a cached token can only come from the daemon.
Engines run one at a time (2 cores here) except in the concurrency test.
"""

from __future__ import annotations

import json
import pathlib
import random
import subprocess

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until, written_through
from kvtierd.tiering.load_decision import MIN_SAMPLES
from tests.connectors.vllm.engine_process import EngineProcess, engine_env

ENGINE_MAIN = pathlib.Path(__file__).with_name("vllm_engine_main.py")
REPO = ENGINE_MAIN.parents[3]
READY_LINE = "vllm_engine_main: ready"  # printed by ENGINE_MAIN once the LLM is built

# The tiny Llama: CPU_ATTN takes head sizes 32, 64, 80, ... and block sizes that are multiples of 32.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 32
BYTES_PER_BLOCK = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # K and V, float32: 128 KiB
NUM_T0_BLOCKS = 320
MAX_TOKENS = 48
SHARED_PREFIX_LEN = 256  # 8 blocks
ENGINE_TIMEOUT_S = 300  # one engine: ~15-30 s start-up on 2 cores, well under a second of generation

# Saved with .venv-vllm's transformers, the version vLLM reads. initializer_range 0.1 (not 0.02):
# a model with near-uniform attention repeats one token whatever its context, and then a wrong
# KV block would not change the output.
SAVE_TINY_LLAMA = f"""
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
    num_hidden_layers={NUM_LAYERS}, num_attention_heads=4, num_key_value_heads={NUM_KV_HEADS}, head_dim={HEAD_DIM},
    max_position_embeddings=1024, initializer_range=0.1, dtype="float32")
transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(sys.argv[1])
"""


def random_tokens(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_tokens)]


# Three prompts behind one 256-token prefix (a system prompt), each with a suffix of its own.
SHARED_PREFIX = random_tokens(1, SHARED_PREFIX_LEN)
SHARED_PROMPTS = [SHARED_PREFIX + random_tokens(10 + i, n) for i, n in enumerate((20, 37, 54))]
# Four unrelated prompts of 272 tokens (9 blocks; 10 once 48 tokens are generated): a 20-block KV
# cache (19 usable) admits two at once and must preempt one when both grow to their tenth block.
PREEMPTION_PROMPTS = [random_tokens(20 + i, 272) for i in range(4)]
PREEMPTION_NUM_GPU_BLOCKS = 20


def hit_cap(prompt: list[int]) -> int:
    """The most tokens a sync connector may claim: whole blocks, one token short of the prompt."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def llama_engine_env(engine_core_process: bool = False) -> dict[str, str]:
    return engine_env() if engine_core_process else engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")


class Engine(EngineProcess):
    """One running tests/connectors/vllm/vllm_engine_main.py; its output (vLLM's logs too) goes to `log_path`."""

    def __init__(self, vllm_python: str, model_dir: pathlib.Path, directory: pathlib.Path, name: str,
                 prompts: list[list[int]], address: str | None, *flags: str, engine_core_process: bool = False) -> None:
        prompts_json = directory / f"{name}.prompts.json"
        prompts_json.write_text(json.dumps(prompts))
        command = [vllm_python, "-P", str(ENGINE_MAIN), str(model_dir), str(directory / f"{name}.json"),
                   "--prompts", str(prompts_json), "--max-tokens", str(MAX_TOKENS), *flags]
        if address is not None:
            command += ["--address", address]
        super().__init__(command, directory, name, llama_engine_env(engine_core_process), timeout_s=ENGINE_TIMEOUT_S)

    def is_ready(self) -> bool:
        return READY_LINE in self.log()


@pytest.fixture
def engines(vllm_python, tiny_llama, tmp_path):
    """Starts engines (`engines(name, prompts, address, *flags)`); kills what still runs at teardown."""
    started: list[Engine] = []

    def start(name: str, prompts: list[list[int]], address: str | None, *flags: str,
              engine_core_process: bool = False) -> Engine:
        engine = Engine(vllm_python, tiny_llama, tmp_path, name, prompts, address, *flags,
                        engine_core_process=engine_core_process)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        if engine.process.poll() is None:
            engine.kill()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python, tmp_path_factory) -> pathlib.Path:
    """A random 4-layer Llama (float32, 2 KV heads of 64) saved by LlamaForCausalLM.save_pretrained."""
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    done = subprocess.run([vllm_python, "-P", "-c", SAVE_TINY_LLAMA, str(model_dir)], check=False,
                          capture_output=True, text=True, timeout=300, cwd=model_dir)
    if done.returncode != 0:
        pytest.fail(f"saving the tiny Llama failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return model_dir


@pytest.fixture(scope="session")
def reference(vllm_python, tiny_llama, tmp_path_factory) -> dict[tuple[int, ...], list[int]]:
    """prompt -> output tokens of one engine without a connector, over every prompt of this file."""
    prompts = SHARED_PROMPTS + PREEMPTION_PROMPTS
    engine = Engine(vllm_python, tiny_llama, tmp_path_factory.mktemp("reference"), "reference", prompts, None)
    result = engine.result()
    assert result["num_cached_tokens"] == [0] * len(prompts)
    return {tuple(prompt): tokens for prompt, tokens in zip(prompts, result["output_token_ids"])}


def expected(reference, prompts: list[list[int]]) -> list[list[int]]:
    return [reference[tuple(prompt)] for prompt in prompts]


def start_daemon(directory: str, extra: list[str] = ()) -> DaemonProcess:
    return DaemonProcess(small_daemon_args(directory, t0_bytes=f"{NUM_T0_BLOCKS * BYTES_PER_BLOCK}B",
                                           host_bytes="64MiB", ssd_bytes="128MiB", extra=list(extra)))


@pytest.fixture
def daemon(short_dir):
    with start_daemon(short_dir) as process:
        yield process


def tier(pool, name: str):
    return next(t for t in pool.tiers if t.tier == name)


def the_pool(client: KvtierClient):
    """The one pool (layout) the engines attached."""
    pools = list(client.stats().pools)
    assert len(pools) == 1, pools
    assert pools[0].num_blocks == NUM_T0_BLOCKS
    return pools[0]


def assert_hits_the_prefix(result: dict, prompts: list[list[int]]) -> None:
    for prompt, num_cached in zip(prompts, result["num_cached_tokens"]):
        assert num_cached % BLOCK_SIZE == 0 and SHARED_PREFIX_LEN <= num_cached <= hit_cap(prompt), \
            result["num_cached_tokens"]


@pytest.mark.timeout(900)
def test_a_new_engine_hits_the_prefix_another_engine_stored_and_decodes_the_same(reference, engines, daemon):
    """Engine A (cold) stores; a new engine process B loads >= the shared prefix; both match the reference.
    Both run vLLM's engine core in a process of its own, as `vllm serve` does."""
    cold = engines("cold", SHARED_PROMPTS, daemon.address, engine_core_process=True).result()
    assert cold["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    warm = engines("warm", SHARED_PROMPTS, daemon.address, engine_core_process=True).result()
    assert_hits_the_prefix(warm, SHARED_PROMPTS)
    assert warm["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    # vLLM's own metric names the tier: everything came from the daemon's T0 ("device").
    assert warm["cached_tokens_by_source"] == {"device": sum(warm["num_cached_tokens"])}, warm
    # and the connector's own metric, on the same registry, counts the same tokens loaded from T0
    assert warm["kvtierd_loaded_tokens"] == {"t0": sum(warm["num_cached_tokens"])}, warm


@pytest.mark.timeout(900)
def test_after_a_daemon_restart_a_new_engine_hits_from_t2(reference, engines, short_dir):
    """Blocks engine A stored reach T2; after a restart (T0 and T1 empty) engine B loads them from T2."""
    with start_daemon(short_dir, WRITE_THROUGH) as daemon:
        cold = engines("cold", SHARED_PROMPTS, daemon.address).result()
        assert cold["output_token_ids"] == expected(reference, SHARED_PROMPTS)
        with KvtierClient(daemon.address) as client:
            assert wait_until(lambda: written_through(client), timeout_s=30), the_pool(client)
        assert daemon.stop() == 0
    with start_daemon(short_dir, WRITE_THROUGH) as daemon, KvtierClient(daemon.address) as client:
        assert all(tier(pool, name).num_cached_blocks == 0 for pool in client.stats().pools for name in ("t0", "t1"))
        warm = engines("warm", SHARED_PROMPTS, daemon.address).result()
        # T0 and T1 started empty, so every block loaded from below T0 came up from the SSD: read
        # from T2 by the load, or first copied to T1 by the Lookup's prefetch (which of the two wins
        # is a race). Only loads count as hits (a store's Acquire counts nothing).
        num_lower_hit_blocks = sum(tier(the_pool(client), name).num_hit_blocks for name in ("t1", "t2"))
    assert_hits_the_prefix(warm, SHARED_PROMPTS)
    assert warm["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert num_lower_hit_blocks > 0
    by_source = warm["cached_tokens_by_source"]  # as vLLM reports it: T2 is "disk"
    assert by_source.get("disk", 0) > 0 and sum(by_source.values()) == sum(warm["num_cached_tokens"]), warm


def store_then_corrupt_t2(client: KvtierClient, engines, address: str, short_dir: str) -> None:
    """Engine A's blocks reach T2, then leave T0 and T1 (Evict), and a byte of every slot on disk is
    flipped under the running daemon: its index still lists them."""
    engines("cold", SHARED_PROMPTS, address).result()
    assert wait_until(lambda: written_through(client), timeout_s=30), the_pool(client)
    client.evict(tiers=["t0", "t1"])
    pool = the_pool(client)
    assert tier(pool, "t0").num_cached_blocks == tier(pool, "t1").num_cached_blocks == 0, pool
    slot_files = list(pathlib.Path(short_dir, "ssd").rglob("kvtierd-slots.bin"))
    assert slot_files
    for path in slot_files:
        with open(path, "r+b") as f:
            for offset in range(100, path.stat().st_size, BYTES_PER_BLOCK):  # a byte inside every slot
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ 0x5A]))


@pytest.mark.timeout(900)
def test_a_promised_hit_whose_blocks_are_corrupt_on_ssd_is_recomputed_to_the_same_tokens(
        reference, engines, short_dir):
    """With the Lookup's prefetch off (a Lookup has no side effect), the daemon promises B every full
    block from T2; the load then meets the corrupt bytes, fails their checksums and reports load
    errors, and vLLM (kv_load_failure_policy recompute) recomputes: B's tokens are the reference's,
    and the daemon counts the corrupt blocks."""
    with start_daemon(short_dir, WRITE_THROUGH) as daemon, KvtierClient(daemon.address) as client:
        store_then_corrupt_t2(client, engines, daemon.address, short_dir)
        warm = engines("warm-corrupt", SHARED_PROMPTS, daemon.address,
                       "--extra-config", json.dumps({"prefetch": False})).result()
        pool = the_pool(client)
    # The first request was promised every full block, from T2 (vLLM's by-source counter records the
    # promise), and none arrived: num_cached_tokens counts the tokens vLLM did not compute. The
    # blocks vLLM recomputed are stored again, so a later request may hit them (good bytes, in T0,
    # or in fresh T2 slots the corruption never touched): every token is still the reference's.
    by_source = warm["cached_tokens_by_source"]
    assert warm["num_cached_tokens"][0] == 0, warm
    assert by_source.get("disk", 0) >= hit_cap(SHARED_PROMPTS[0]), warm
    assert sum(warm["num_cached_tokens"]) <= sum(by_source.values()) - hit_cap(SHARED_PROMPTS[0]), warm
    assert warm["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert pool.num_corrupted_blocks > 0, pool


@pytest.mark.timeout(900)
def test_blocks_corrupted_on_ssd_never_reach_the_engine_with_prefetch_on(reference, engines, short_dir):
    """The same corruption with the default prefetch: how much vLLM is promised depends on when a
    Lookup's prefetch meets the corrupt bytes (before or after a later request's Lookup answers);
    either way no corrupt byte reaches the engine and the daemon counts what it dropped."""
    with start_daemon(short_dir, WRITE_THROUGH) as daemon, KvtierClient(daemon.address) as client:
        store_then_corrupt_t2(client, engines, daemon.address, short_dir)
        warm = engines("warm-corrupt", SHARED_PROMPTS, daemon.address).result()
        pool = the_pool(client)
    assert all(n in (0, *range(SHARED_PREFIX_LEN, hit_cap(p) + 1, BLOCK_SIZE))
               for n, p in zip(warm["num_cached_tokens"], SHARED_PROMPTS)), warm
    assert warm["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert pool.num_corrupted_blocks > 0, pool


@pytest.mark.timeout(900)
def test_a_disk_slower_than_vllm_s_prefill_is_not_promised_and_vllm_computes_the_same_tokens(
        reference, engines, short_dir):
    """SSD reads slowed on purpose (tests/server/slow_t2_serve.py). A stores; B0 loads the
    prefixes from T2 (the disk never measured: a first guess declines nothing), and B0..B2 in
    turn read it until it is measured MIN_SAMPLES times (each reads it while it is measured
    fewer); C, a new engine, is weighed against the cost the workers measured and reported for the
    model: the Lookup declines T2, vLLM computes those blocks, no load fails, the tokens are the
    reference's, and the connector's vllm:kvtierd_declined_slow_tokens counts them."""
    args = small_daemon_args(short_dir, t0_bytes=f"{NUM_T0_BLOCKS * BYTES_PER_BLOCK}B", host_bytes="64MiB",
                             ssd_bytes="128MiB", extra=WRITE_THROUGH)
    env = {"SLOW_T2_READ_DELAY_S": "2.0", "PYTHONPATH": str(REPO)}  # a margin over recompute on a busy CPU
    with DaemonProcess(args, env=env, module="tests.server.slow_t2_serve") as daemon, \
            KvtierClient(daemon.address) as client:
        def only_in_t2() -> None:
            assert wait_until(lambda: written_through(client), timeout_s=30), the_pool(client)
            client.evict(tiers=["t0", "t1"])

        engines("a", SHARED_PROMPTS, daemon.address).result()
        only_in_t2()
        for i in range(MIN_SAMPLES):  # each engine reads T2 at least once until it is measured enough
            measuring = engines(f"b{i}", SHARED_PROMPTS, daemon.address).result()
            loaded = measuring["kvtierd_loaded_tokens"]  # from T2, or from T1 where the prefetch from T2 landed first
            assert i or loaded.get("t1", 0) + loaded.get("t2", 0) > 0, measuring  # B0's disk is never measured
            assert measuring["output_token_ids"] == expected(reference, SHARED_PROMPTS)
            only_in_t2()
        declined = engines("c", SHARED_PROMPTS, daemon.address).result()
        pool = the_pool(client)
    assert declined["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert declined["kvtierd_declined_tokens"].get("t2", 0) >= SHARED_PREFIX_LEN, declined
    assert "t2" not in declined["kvtierd_loaded_tokens"] and "disk" not in declined["cached_tokens_by_source"]
    assert declined["kvtierd_failed_load_blocks"] == 0 and pool.num_failed_load_blocks == 0, (declined, pool)
    assert tier(pool, "t2").num_declined_blocks > 0 and pool.recompute_source == "measured", pool


@pytest.mark.timeout(600)
def test_without_a_daemon_the_engine_serves_uncached_and_does_not_hang(reference, engines, short_dir):
    """No daemon at the address: the engine finishes in bounded time, 0 cached tokens, reference tokens."""
    address = f"unix://{short_dir}/nobody.sock"
    result = engines("no-daemon", SHARED_PROMPTS, address).result()
    assert result["num_cached_tokens"] == [0] * len(SHARED_PROMPTS)
    assert result["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert result["generate_s"] < 60, result


@pytest.mark.timeout(900)
def test_two_engines_at_once_share_the_system_prompt_a_third_stored(reference, engines, daemon):
    """After A stored the system prompt, B and C run concurrently: both load exactly it, both decode right."""
    first, second, third = ([prompt] for prompt in SHARED_PROMPTS)
    result_a = engines("a", first, daemon.address).result()
    assert result_a["output_token_ids"] == expected(reference, first)
    engine_b = engines("b", second, daemon.address)
    engine_c = engines("c", third, daemon.address)
    result_b, result_c = engine_b.result(), engine_c.result()
    # Only the system prompt is common to A's and each of B's and C's prompts.
    assert result_b["num_cached_tokens"] == result_c["num_cached_tokens"] == [SHARED_PREFIX_LEN]
    assert result_b["output_token_ids"] == expected(reference, second)
    assert result_c["output_token_ids"] == expected(reference, third)


@pytest.mark.timeout(600)
def test_an_engine_killed_mid_request_leaves_no_block_held(engines, short_dir):
    """SIGKILL of the whole engine while it stores: once its sessions are gone every T0 block is free."""
    # 16 short prompts of staggered lengths decoding 900 tokens (~7 s here; the kill comes after
    # the first few decode blocks, so the margin is for a busy machine: with 448 tokens a CI run saw
    # the engine finish first): a block fills, and is stored, every other step, so the kill comes
    # while the engine's sessions are storing.
    prompts = [random_tokens(40 + i, 64 + 2 * i) for i in range(16)]
    with start_daemon(short_dir, ["--lease-s", "2"]) as daemon, KvtierClient(daemon.address) as client:
        engine = engines("killed", prompts, daemon.address, "--max-tokens", "900", "--max-model-len", "1024")
        assert wait_until(lambda: engine.is_ready() or engine.process.poll() is not None, timeout_s=ENGINE_TIMEOUT_S)
        assert engine.process.poll() is None, engine.failure_report()
        # Past the prompts' 32 full blocks: decode-time stores are under way.
        assert wait_until(lambda: client.stats().pools and tier(the_pool(client), "t0").num_cached_blocks > 40,
                          timeout_s=120), engine.failure_report()

        def num_held_blocks() -> int:
            pool = the_pool(client)
            return pool.num_blocks - pool.num_free_blocks

        # Best effort: aim the kill at a moment a store holds blocks (a store takes milliseconds).
        held_before_kill = wait_until(lambda: num_held_blocks() > 0, timeout_s=2, period_s=0.002)
        engine.kill()
        assert not engine.out_json.exists(), "the engine finished before the kill"
        assert wait_until(lambda: client.stats().num_sessions == 0, timeout_s=30), client.stats()
        pool = the_pool(client)
        assert pool.num_free_blocks == pool.num_blocks, (held_before_kill, client.stats())
        assert tier(pool, "t0").num_cached_blocks > 0  # what it committed before the kill stays cached


@pytest.mark.timeout(600)
def test_preempted_requests_decode_the_reference_tokens(reference, engines, daemon):
    """A 20-block KV cache preempts some of 4 concurrent requests; every output still equals the reference."""
    result = engines("preempted", PREEMPTION_PROMPTS, daemon.address,
                     "--num-gpu-blocks", str(PREEMPTION_NUM_GPU_BLOCKS)).result()
    assert result["num_preemptions"] > 0, result
    assert result["output_token_ids"] == expected(reference, PREEMPTION_PROMPTS)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory) -> pathlib.Path:
    """SmolLM2-135M-Instruct dequantized to fp32 and saved as a Hugging Face directory, which vLLM reads."""
    from kvtierd.connectors.reference.model_files import load_model_files, save_hf_directory

    return save_hf_directory(load_model_files(smollm2_gguf), tmp_path_factory.mktemp("smollm2-hf"))


@pytest.mark.timeout(900)
def test_smollm2_through_vllm_answers_the_same_with_the_prefix_from_kvtierd(vllm_python, smollm2_hf, tmp_path,
                                                                             short_dir):
    """The real model, real chat prompts: the demo's 1,092-token handbook before two questions, and
    the capital of France. A new engine loads the handbook from kvtierd and says what recompute says."""
    from kvtierd.connectors.demo import demo_texts
    from kvtierd.connectors.reference.chat_tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_directory(smollm2_hf)
    system = {"role": "system", "content": demo_texts.SYSTEM_PROMPT}
    prompts = [tokenizer.prompt([system, {"role": "user", "content": question}])
               for question in demo_texts.QUESTIONS[:2]]
    prompts.append(tokenizer.prompt([{"role": "user", "content": "What is the capital of France?"}]))
    layout_bytes = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32
    flags = ("--max-model-len", "1536")

    def engine(name: str, address: str | None) -> dict:
        return Engine(vllm_python, smollm2_hf, tmp_path, name, prompts, address, *flags).result()

    reference_run = engine("smollm2-reference", None)
    assert tokenizer.decode(reference_run["output_token_ids"][2]).startswith("The capital of France is Paris.")
    args = small_daemon_args(short_dir, t0_bytes=f"{256 * layout_bytes}B", host_bytes="256MiB", ssd_bytes="512MiB")
    with DaemonProcess(args) as daemon:
        cold = engine("smollm2-cold", daemon.address)
        warm = engine("smollm2-warm", daemon.address)
    assert cold["output_token_ids"] == warm["output_token_ids"] == reference_run["output_token_ids"]
    assert cold["num_cached_tokens"] == [0, 0, 0]  # one batch: nothing stored yet when it was scheduled
    for prompt, num_cached in zip(prompts, warm["num_cached_tokens"]):
        assert num_cached == hit_cap(prompt), warm["num_cached_tokens"]  # every full block, from the other engine
