"""End to end: real SGLang engines (sglang 0.5.23 on the CPU, in .venv-sglang) with kvtierd as their
HiCache storage tier (KvtierdHiCacheStorage), against a real `kvtierd serve`.

Each engine is its own process tree (sglang_engine_main.py), one at a time (2 cores). The model is a
tiny Llama with real random weights; decoding is greedy, so an engine whose prefix came from the
daemon must give exactly the tokens of the engine that computed it. A new engine process has empty
device and host pools: its cached tokens can only come from storage, and SGLang says so
(`cached_tokens_details["storage"]`).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import urllib.request

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until
from tests.connectors.sglang.sglang_engine_main import engine_kwargs, server_flags
from tests.connectors.vllm.engine_process import EngineProcess

ENGINE_MAIN = pathlib.Path(__file__).with_name("sglang_engine_main.py")
REPO = ENGINE_MAIN.parents[3]
READY_LINE, PAUSED_LINE = "sglang_engine_main: ready", "sglang_engine_main: paused"
PAGE_SIZE = 16
ENGINE_TIMEOUT_S = 300
MAX_TOKENS = 8  # sglang_engine_main.py's default

WRITE_MODEL = """
import pathlib, sys
sys.path.insert(0, sys.argv[2])
from smoke import write_tiny_llama
write_tiny_llama(pathlib.Path(sys.argv[1]))
"""


def random_tokens(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(num_tokens)]


# Three prompts behind one 256-token prefix (16 pages), each with a suffix of its own.
PREFIX = random_tokens(1, 256)
PROMPTS = [PREFIX + random_tokens(10 + i, n) for i, n in enumerate((20, 37, 54))]
PREFIX_PAGES = len(PREFIX) // PAGE_SIZE
ALL_PAGES = PREFIX_PAGES + sum((len(p) - len(PREFIX)) // PAGE_SIZE for p in PROMPTS)


class Engine(EngineProcess):
    def __init__(self, python: str, model_dir: pathlib.Path, directory: pathlib.Path, name: str,
                 prompts: list[list[int]], *flags: str) -> None:
        prompts_json = directory / f"{name}.prompts.json"
        prompts_json.write_text(json.dumps(prompts))
        command = [python, str(ENGINE_MAIN), str(model_dir), str(directory / f"{name}.json"), "--prompts",
                   str(prompts_json), *flags]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(directory), "KVTIERD_LOG_LEVEL": "INFO"}
        super().__init__(command, directory, name, env, timeout_s=ENGINE_TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny_llama(sglang_python, tmp_path_factory) -> pathlib.Path:
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    done = subprocess.run([sglang_python, "-c", WRITE_MODEL, str(model_dir), str(REPO / "scripts" / "sglang_cpu")],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"writing the tiny Llama failed:\n{done.stdout}\n{done.stderr}")
    return model_dir


@pytest.fixture
def run_engine(sglang_python, tiny_llama, tmp_path):
    """Runs an engine to its end (`run_engine(name, prompts, *flags)` -> its result); `start` starts one."""
    started: list[Engine] = []

    def start(name: str, prompts: list[list[int]], *flags: str) -> Engine:
        engine = Engine(sglang_python, tiny_llama, tmp_path, name, prompts, *flags)
        started.append(engine)
        return engine

    def run(name: str, prompts: list[list[int]], *flags: str) -> dict:
        return start(name, prompts, *flags).result()

    run.start = start  # type: ignore[attr-defined]
    yield run
    for engine in started:
        if engine.process.poll() is None:
            engine.kill()


def storage_tokens(result: dict) -> list[int]:
    return [details.get("storage", 0) for details in result["cached_tokens_details"]]


def test_engines_share_pages_through_the_daemon_and_never_across_tenants(run_engine, tmp_path):
    """Engine A (tenant acme) computes the prompts and its pages reach the daemon; a new engine of
    another tenant finds none of them; a new engine of acme's loads the shared prefix from storage
    and produces exactly A's tokens."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--tokens-file", str(tokens_file)])) as daemon:
        first = run_engine("acme-1", PROMPTS, "--address", daemon.address, "--token", "a-token",
                           "--wait-stored", str(ALL_PAGES))
        assert first["cached_tokens"][0] == 0 and first["stored"]

        other = run_engine("globex", PROMPTS, "--address", daemon.address, "--token", "g-token")
        assert storage_tokens(other)[0] == 0
        assert other["output_token_ids"] == first["output_token_ids"]

        second = run_engine("acme-2", PROMPTS, "--address", daemon.address, "--token", "a-token")
        assert storage_tokens(second)[0] >= len(PREFIX)
        assert second["output_token_ids"] == first["output_token_ids"]
        with KvtierClient(daemon.address, token="a-token") as client:
            acme = next(u for u in client.tenant_stats() if u.tenant == "acme")
        assert acme.num_t0_cached_blocks >= ALL_PAGES


def test_after_a_daemon_restart_sglangs_http_server_loads_the_prefix_from_t2(run_engine, sglang_python, tiny_llama,
                                                                                tmp_path):
    """An engine's pages reach T2; the daemon restarts; `python -m sglang.launch_server`, a new process,
    answers /generate with the prefix loaded from T2 and the engine's tokens."""
    args = small_daemon_args(str(tmp_path), extra=WRITE_THROUGH)
    num_pages = len(PROMPTS[0]) // PAGE_SIZE
    with DaemonProcess(args) as daemon:
        first = run_engine("before", PROMPTS[:1], "--address", daemon.address, "--wait-stored", str(num_pages))
        with KvtierClient(daemon.address) as client:
            assert wait_until(lambda: t2_pages(client) >= num_pages, timeout_s=60)
    with DaemonProcess(args) as daemon:
        with SglangServer(sglang_python, tiny_llama, tmp_path, daemon.address) as server:
            answer = server.generate(PROMPTS[0], max_new_tokens=MAX_TOKENS)
        with KvtierClient(daemon.address) as client:
            # A restarted daemon's T0 and T1 start empty: every hit came from T2, loaded directly or first
            # moved to T1 by the Lookup's prefetch (SGLang's batch_exists), so counted as T1's.
            lower_hits = sum(t.num_hit_blocks for p in client.stats().pools for t in p.tiers if t.tier in ("t1", "t2"))
    assert answer["meta_info"]["cached_tokens_details"]["storage"] >= (num_pages - 1) * PAGE_SIZE
    assert lower_hits >= len(PREFIX) // PAGE_SIZE
    assert list(answer["output_ids"]) == first["output_token_ids"][0]


class SglangServer:
    """`python -m sglang.launch_server` on a free loopback port, with kvtierd as its storage tier."""

    def __init__(self, python: str, model_dir: pathlib.Path, directory: pathlib.Path, address: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        flags = server_flags(engine_kwargs(str(model_dir), address))
        command = [python, "-m", "sglang.launch_server", *flags, "--host", "127.0.0.1", "--port", str(self.port)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(directory), "SGLANG_USE_CPU_ENGINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = directory / "server.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=directory,
                                            start_new_session=True)

    def __enter__(self) -> SglangServer:
        if not wait_until(self._healthy, timeout_s=ENGINE_TIMEOUT_S, period_s=0.5):
            self.close()
            pytest.fail(f"sglang.launch_server did not answer /health:\n{self.log_path.read_text()[-4000:]}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            return True  # exited: __enter__'s generate fails with its log
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict:
        body = json.dumps({"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "ignore_eos": True,
                                                                       "max_new_tokens": max_new_tokens}})
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def t2_pages(client: KvtierClient) -> int:
    return sum(t.num_cached_blocks for p in client.stats().pools for t in p.tiers if t.tier == "t2")


def test_a_daemon_killed_mid_run_leaves_sglang_serving(run_engine, tmp_path):
    """The daemon is SIGKILLed between two requests: the engine serves the rest, every page its own
    computation (no storage hit: nothing can have come from a dead daemon), without error or hang, and
    the answers of the prompts after the kill follow from their prefix as before it (the first prompt's
    pages were stored, the later ones share its prefix from SGLang's own device cache)."""
    resume = tmp_path / "resume"
    daemon = DaemonProcess(small_daemon_args(str(tmp_path)))
    with daemon:
        engine = run_engine.start("killed", PROMPTS, "--address", daemon.address, "--pause-after", "1",
                                  "--resume-file", str(resume))
        assert wait_until(lambda: PAUSED_LINE in engine.log() or engine.process.poll() is not None, timeout_s=240)
        daemon.kill()
        resume.write_text("")
        killed = engine.result()
    assert len(killed["output_token_ids"]) == len(PROMPTS)
    assert storage_tokens(killed) == [0, 0, 0]
    assert killed["cached_tokens"][1] >= len(PREFIX) - PAGE_SIZE  # SGLang's own cache still served the prefix
