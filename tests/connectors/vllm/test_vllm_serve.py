"""`vllm serve` as users run it: vLLM's OpenAI server (API server, engine core and worker processes,
vLLM's own prefix cache on) on the real SmolLM2-135M, through `kvtierd-vllm`, with a real
`kvtierd serve`, called over HTTP as any OpenAI client calls it.

- Greedy completions are the same with and without the connector; a second server process loads
  what the first stored (vLLM's own `vllm:external_prefix_cache_hits_total`, its cache being empty),
  and the daemon's hit count is exactly what vLLM loaded (stores are not hits); its query count
  is vLLM's external_prefix_cache_queries but for each prompt's tail past its last full block
  before the last token (no block can hit there), so `kvtierctl stats`' hit rate is vLLM's external
  hits over the tokens it asked the connector about.
- After the daemon's restart (T0 and T1 empty, the SSD tier kept) a new server's hits come from T2
  ("disk"); a daemon killed while requests run leaves the server answering, with the same text.
"""

from __future__ import annotations

import concurrent.futures
import fractions
import json
import re
import urllib.request

import pytest

from kvtierd.client import KvtierClient
from kvtierd.connectors.demo import demo_texts
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until, written_through
from tests.cli.test_kvtierctl import kvtierctl
from tests.connectors.vllm.openai_server import OpenAIServer
from tests.connectors.vllm.test_vllm_engines import tier

pytestmark = [pytest.mark.vllm, pytest.mark.weights, pytest.mark.timeout(1800)]

BLOCK_SIZE = 32
QUESTIONS = demo_texts.QUESTIONS[:3]


def prompt(question: str) -> str:
    """The demo's 1,092-token handbook, then a question: the shared prefix of every request."""
    return f"{demo_texts.SYSTEM_PROMPT}\nQuestion: {question}\nAnswer:"


@pytest.fixture(scope="module")
def smollm2_hf():
    from kvtierd.connectors.demo.model_fetch import ModelFetchError, hf_model_directory

    try:
        return hf_model_directory(progress=lambda line: None)
    except ModelFetchError as e:
        pytest.fail(f"the vllm serve tests need SmolLM2: {e}")


@pytest.fixture
def serve(vllm_python, smollm2_hf, tmp_path):
    """serve(name, address) -> a ready OpenAIServer; every one is stopped after the test."""
    servers = []

    def start(name: str, address: str | None) -> OpenAIServer:
        server = OpenAIServer(vllm_python, smollm2_hf, tmp_path / f"{name}.log", address=address)
        servers.append(server)
        return server.wait_ready()

    yield start
    for server in servers:
        server.stop()


def start_daemon(directory: str) -> DaemonProcess:
    return DaemonProcess(small_daemon_args(directory, t0_bytes="256MiB", host_bytes="256MiB", ssd_bytes="512MiB",
                                           extra=WRITE_THROUGH))


def the_pool(client: KvtierClient):
    pools = client.stats().pools
    assert len(pools) == 1, pools
    return pools[0]


def external_hits(server: OpenAIServer) -> float:
    return server.metric_sum("vllm:external_prefix_cache_hits_total")


def num_prompt_tokens(text: str, server: OpenAIServer) -> int:
    request = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"model": "model", "prompt": text})
                                     .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)["count"]


def whole_blocks_before_the_last_token(text: str, server: OpenAIServer) -> int:
    """The tokens a hit of `text`'s prompt can be: its full blocks, short of the last token."""
    return (num_prompt_tokens(text, server) - 1) // BLOCK_SIZE * BLOCK_SIZE


def queries_beyond_whole_blocks(texts: list[str], server: OpenAIServer) -> int:
    """What vLLM's external_prefix_cache_queries counts of each request and the daemon's query does
    not: vLLM counts every token beyond its own hit (a block multiple), the daemon the whole blocks
    a hit could load (short of the last token). The difference is each prompt's tail."""
    return sum(num_prompt_tokens(t, server) - whole_blocks_before_the_last_token(t, server) for t in texts)


def kvtierctl_hit_rate(address: str) -> tuple[str, str]:
    """(the hit rate, the query tokens) `kvtierctl stats` prints for the one pool."""
    done = kvtierctl("stats", address=address)
    assert done.returncode == 0, done.stderr
    (found,) = re.findall(r"hit rate ([0-9.]+%) \(an unbounded cache: [0-9.]+%\) of ([0-9,]+) query tokens",
                          done.stdout)
    return found


def test_completions_match_vllm_alone_and_a_second_server_loads_what_the_first_stored(serve, short_dir):
    prompts = [prompt(q) for q in QUESTIONS]
    alone = serve("alone", None)
    reference = [alone.complete(p) for p in prompts]
    expected_hit = whole_blocks_before_the_last_token(prompts[0], alone)
    alone.stop()
    assert all(reference) and len(set(reference)) == len(reference), reference

    with start_daemon(short_dir) as daemon, KvtierClient(daemon.address) as client:
        first = serve("first", daemon.address)
        assert [first.complete(p) for p in prompts] == reference
        # vLLM's own cache served the later questions' handbook; the first stored it in kvtierd.
        assert external_hits(first) == 0
        assert wait_until(lambda: tier(the_pool(client), "t0").num_cached_blocks >= expected_hit // BLOCK_SIZE,
                          timeout_s=30), the_pool(client)
        vllm_queries = first.metric_sum("vllm:external_prefix_cache_queries_total")
        tails = queries_beyond_whole_blocks(prompts, first)
        first.stop()

        second = serve("second", daemon.address)
        assert second.complete(prompts[0]) == reference[0]
        assert external_hits(second) == expected_hit  # all of it from kvtierd: this process's cache was empty
        assert second.metric_sum("vllm:prompt_tokens_cached_by_source_total", source="device") == expected_hit
        assert [second.complete(p) for p in prompts[1:]] == reference[1:]
        assert "kvtierd connector: attached to kvtierd at" in second.log()
        # Hits counted honestly: the daemon's hit blocks are what vLLM loaded, the stores' Acquires
        # (every block of every request, the first server's too) count for nothing.
        daemon_hit_tokens = sum(t.num_hit_blocks for t in the_pool(client).tiers) * BLOCK_SIZE
        assert daemon_hit_tokens == external_hits(second) == expected_hit, the_pool(client)
        # The connector's own metrics on vLLM's /metrics say the same, by tier; its stores are counted.
        assert wait_until(lambda: second.metric_sum("vllm:kvtierd_loaded_tokens_total") == expected_hit,
                          timeout_s=30), second.metrics()
        assert second.metric_sum("vllm:kvtierd_loaded_tokens_total", tier="t0") == expected_hit
        assert second.metric_sum("vllm:kvtierd_bytes_total", direction="load") > 0
        # A Lookup goes out for a request with full blocks beyond vLLM's own hit: the first question
        # here; the later ones share the handbook's 34 blocks with it and end within block 35.
        assert second.metric_sum("vllm:kvtierd_lookup_seconds_count") >= 1
        # And the queries: each request's first ask, the same as vLLM's but for each prompt's tail.
        vllm_queries += second.metric_sum("vllm:external_prefix_cache_queries_total")
        daemon_query_tokens = the_pool(client).num_query_blocks * BLOCK_SIZE
        assert vllm_queries - daemon_query_tokens == tails * 2, (vllm_queries, daemon_query_tokens, tails)
        # So the hit rate kvtierctl prints is vLLM's over the tokens it asked the connector about.
        vllm_hits = external_hits(second)  # the first server's were 0 (above)
        assert fractions.Fraction(daemon_hit_tokens, daemon_query_tokens) == \
            fractions.Fraction(int(vllm_hits), int(vllm_queries) - tails * 2) == fractions.Fraction(1, 2)
        assert kvtierctl_hit_rate(daemon.address) == (f"{vllm_hits / (vllm_queries - tails * 2):.1%}",
                                                      f"{int(vllm_queries) - tails * 2:,}")


def test_after_a_restart_hits_come_from_t2_and_a_killed_daemon_leaves_the_server_answering(serve, short_dir):
    prompts = [prompt(q) for q in QUESTIONS]
    with start_daemon(short_dir) as daemon, KvtierClient(daemon.address) as client:
        storing = serve("storing", daemon.address)
        reference = [storing.complete(p) for p in prompts]
        expected_hit = whole_blocks_before_the_last_token(prompts[0], storing)
        storing.stop()
        assert wait_until(lambda: written_through(client), timeout_s=60), the_pool(client)
        assert daemon.stop() == 0

    daemon = start_daemon(short_dir)
    try:
        server = serve("after-restart", daemon.address)
        assert server.complete(prompts[0]) == reference[0]
        assert external_hits(server) == expected_hit
        assert server.metric_sum("vllm:prompt_tokens_cached_by_source_total", source="disk") > 0

        # The daemon dies with requests in flight: each is answered, with vLLM alone's text.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(server.complete, p + " Please answer briefly.", 16) for p in prompts]
            daemon.kill()
            answers = [future.result(timeout=300) for future in running]
        assert all(answers), answers
        after = [server.complete(p) for p in prompts]
        assert after == reference
    finally:
        daemon.kill()
