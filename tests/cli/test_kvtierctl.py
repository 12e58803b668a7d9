"""kvtierctl against a real daemon (stats, inspect, evict, flush, drain, health) and offline (plan)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import Unavailable
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.server.e2e_runner import LAYOUT, prompt

TOKENS = {"acme": "a-token", "globex": "g-token", "ops": "o-token"}
KVTIERCTL = [sys.executable, "-P", "-m", "kvtierd.cli.kvtierctl"]  # -P: the working directory cannot shadow the package


def kvtierctl(*args: str, token: str | None = None, address: str | None = None, timeout_s: float = 60):
    head = list(KVTIERCTL)
    if address:
        head += ["--address", address]
    if token:
        head += ["--token", token]
    return subprocess.run([*head, *args], capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ctl")
    tokens_file = directory / "tokens"
    tokens_file.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    args = small_daemon_args(str(directory), extra=["--tokens-file", str(tokens_file),
                                                    "--set", "server.admin_tenants=ops"])
    with DaemonProcess(args) as process:
        yield process


def commit_prompt(address: str, token: str, seed: int, num_tokens: int = 32) -> list[int]:
    with KvtierClient(address, token=token) as client:
        session = client.attach(LAYOUT)
        tokens = prompt(seed, num_tokens)
        hashes = session.namespace.hash_blocks(tokens)
        acquired = session.acquire("r", hashes, 0, tokens)
        session.commit("r", acquired.block_ids, hashes, tokens, None)
        session.release("r")
    return tokens


def assert_one_line(done: subprocess.CompletedProcess, returncode: int, line: str) -> None:
    """The exit status, and stderr exactly `line`: one line, no usage block, no traceback."""
    assert (done.returncode, done.stderr) == (returncode, line + "\n")


# ----------------------------------------------------------------------------- usage errors (exit 2)


PLAN = ("plan", "--bytes-per-token", "819200")


@pytest.mark.parametrize("args, line", [
    ((*PLAN, "--t0", "40GB", "--length", "abc"),
     "kvtierctl: error: argument --length: invalid int value: 'abc' (see `kvtierctl plan --help`)"),
    ((*PLAN, "--length", "34"),
     "kvtierctl: error: the following arguments are required: --t0 (see `kvtierctl plan --help`)"),
    (("--bogus", "health"), "kvtierctl: error: unrecognized arguments: --bogus (see `kvtierctl --help`)"),
    (("health", "--bogus"), "kvtierctl: error: unrecognized arguments: --bogus (see `kvtierctl health --help`)"),
    (("bogus",), "kvtierctl: error: argument command: invalid choice: 'bogus' (choose from 'stats', 'plan', "
                 "'inspect', 'evict', 'flush', 'forget', 'drain', 'health') (see `kvtierctl --help`)"),
    ((), "kvtierctl: error: the following arguments are required: command (see `kvtierctl --help`)"),
    (("--timeout", "0", "health"),
     "kvtierctl: error: argument --timeout: needs a finite number of seconds > 0, got '0' (see `kvtierctl --help`)"),
    (("stats", "--watch", "0"), "kvtierctl: error: argument --watch: needs a finite number of seconds > 0, "
                                "got '0' (see `kvtierctl stats --help`)"),
], ids=["plan-length-abc", "plan-without-t0", "unknown-flag", "unknown-subcommand-flag", "unknown-subcommand",
        "no-subcommand", "timeout-0", "watch-0"])
def test_a_usage_error_is_one_line_and_exit_2(args, line):
    """argparse's multi-line usage block is replaced by one line naming the argument; nothing runs."""
    done = kvtierctl(*args, address="unix:///nonexistent/kvtierd.sock")
    assert_one_line(done, 2, line)
    assert done.stdout == ""


def test_help_still_prints_the_whole_usage():
    """--help is not an error: the full help on stdout, exit 0; the same parser's error is one line."""
    done = kvtierctl("plan", "--help")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("usage: kvtierctl plan") and "--percentiles" in done.stdout
    assert len(done.stdout.splitlines()) > 20
    assert_one_line(kvtierctl("plan"), 2, "kvtierctl: error: the following arguments are required: --t0 "
                                          "(see `kvtierctl plan --help`)")


def test_a_model_config_that_is_not_an_object_is_a_bad_argument(tmp_path):
    """A config.json holding a list is exit 2 with one line, not an AttributeError traceback."""
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    done = kvtierctl("plan", "--model-config", str(config), "--t0", "1GB", "--length", "3")
    assert_one_line(done, 2, f"kvtierctl: error: {config} is not a JSON object (a transformers config.json)")


# ----------------------------------------------------------------------------- a daemon that never answers (exit 3)


@pytest.fixture(params=["tcp", "unix"])
def silent_server(request, tmp_path):
    """(address, accepted): a socket server that accepts connections and never writes a byte."""
    if request.param == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % listener.getsockname()[1]
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "silent.sock"))
        listener.listen()
        address = f"unix://{tmp_path}/silent.sock"
    accepted, connections = threading.Event(), []

    def accept_forever() -> None:
        while True:
            try:
                connections.append(listener.accept()[0])
            except OSError:  # the listener was shut down
                return
            accepted.set()

    thread = threading.Thread(target=accept_forever, daemon=True)
    thread.start()
    try:
        yield address, accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        thread.join(timeout=10)
        listener.close()
        for connection in connections:
            connection.close()


@pytest.mark.parametrize("command", [("health",), ("stats",), ("evict", "--all")], ids=["health", "stats", "evict"])
def test_a_daemon_that_accepts_and_never_answers_is_unreachable(silent_server, command):
    """Exit 3 within --timeout, one line naming the address (evict too, whose own deadline is 120 s)."""
    address, accepted = silent_server
    done = kvtierctl("--timeout", "1", *command, address=address, timeout_s=30)
    assert accepted.is_set()  # it connected: the daemon is there and silent, not absent
    assert_one_line(done, 3, f"kvtierctl: kvtierd at {address} did not answer within 1 s: is the daemon running, "
                             "and serving at this address?")
    assert done.stdout == ""


# ----------------------------------------------------------------------------- plan (offline)


def test_plan_reproduces_the_worked_example_of_the_seed():
    """34-token requests, 819,200 B/token, 40 GB at 0.9: block 16 → 48 slots, ≈915; block 8 → 40, ≈1,098."""
    done = kvtierctl("plan", "--bytes-per-token", "819200", "--t0", "40GB", "--utilization", "0.9", "--length", "34",
                     "--block-sizes", "16,8", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["block_size"]: row for row in json.loads(done.stdout)["block_sizes"]}
    assert (rows[16]["slots_per_request"], int(rows[16]["max_concurrency"])) == (48, 915)
    assert (rows[8]["slots_per_request"], int(rows[8]["max_concurrency"])) == (40, 1098)
    assert rows[16]["fragmentation"]["num_allocated_slots"] == 48
    table = kvtierctl("plan", "--bytes-per-token", "819200", "--t0", "40GB", "--utilization", "0.9", "--length", "34")
    assert "41.2%" in table.stdout and "29.2%" in table.stdout  # both denominators, block 16


def test_plan_from_a_config_json_and_a_histogram_warns_about_long_contexts(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "hidden_size": 4096}))
    histogram = tmp_path / "lengths.txt"
    histogram.write_text("# length count\n500 90\n60000 10\n")
    done = kvtierctl("plan", "--model-config", str(config), "--t0", "20GB", "--t1", "4GiB", "--histogram",
                     str(histogram), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # Llama-3-8B fp16: 128 KiB
    assert result["mean_request"] == (500 * 90 + 60000 * 10) / 100
    warnings = " ".join(result["warnings"])
    assert "crowd short ones out" in warnings and "thrash T1" in warnings and "long-context pool" in warnings


def test_plan_refuses_bad_input_with_exit_2():
    done = kvtierctl("plan", "--bytes-per-token", "819200", "--t0", "forty", "--length", "34")
    assert done.returncode == 2 and "not a byte size" in done.stderr
    done = kvtierctl("plan", "--bytes-per-token", "819200", "--t0", "40GB")
    assert done.returncode == 2 and "request lengths" in done.stderr


# ----------------------------------------------------------------------------- against the daemon


def test_stats_table_json_and_tenant_usage(daemon):
    commit_prompt(daemon.address, TOKENS["acme"], seed=1)
    done = kvtierctl("stats", address=daemon.address, token=TOKENS["acme"])
    assert done.returncode == 0, done.stderr
    assert f"pool {LAYOUT.model_id}" in done.stdout and "hit rate" in done.stdout and "T2 I/O errors" in done.stdout
    stats = json.loads(kvtierctl("stats", "--json", address=daemon.address, token=TOKENS["acme"]).stdout)
    pool, = stats["pools"]
    assert int(pool["num_query_blocks"]) >= 8
    own = json.loads(kvtierctl("stats", "--tenant", "", "--json", address=daemon.address, token=TOKENS["acme"]).stdout)
    assert [row["tenant"] for row in own] == ["acme"] and int(own[0]["num_t0_cached_blocks"]) >= 8
    refused = kvtierctl("stats", "--tenant", "*", address=daemon.address, token=TOKENS["acme"])
    assert refused.returncode == 4 and "admin" in refused.stderr
    every = json.loads(kvtierctl("stats", "--tenant", "*", "--json", address=daemon.address,
                                 token=TOKENS["ops"]).stdout)
    assert "acme" in {row["tenant"] for row in every}


def test_watch_redraws_with_rates_until_interrupted(daemon):
    commit_prompt(daemon.address, TOKENS["acme"], seed=4)  # a pool to report
    process = subprocess.Popen([*KVTIERCTL, "--address", daemon.address, "--token", TOKENS["acme"], "stats",
                                "--watch", "0.3"], stdout=subprocess.PIPE, text=True)
    try:
        frames: list[list[str]] = []
        for line in process.stdout:
            if line.startswith("kvtierd "):
                frames.append([])
            frames[-1].append(line)
            if len(frames) == 4:
                break
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=10)
    assert process.returncode == 0
    first, second = "".join(frames[0]), "".join(frames[1])
    assert "evictions/s" not in first and "evictions/s" in second  # rates need a previous frame
    assert "B/s" in second


def test_inspect_shows_which_tier_holds_a_prefix_and_evict_moves_it_down(daemon):
    tokens = commit_prompt(daemon.address, TOKENS["globex"], seed=2)
    text = " ".join(map(str, tokens))
    found = json.loads(kvtierctl("inspect", "--model-id", LAYOUT.model_id, "--tokens", text, "--json",
                                 address=daemon.address, token=TOKENS["globex"]).stdout)
    assert (found["num_blocks"], found["t0"]) == (8, 8)
    other = json.loads(kvtierctl("inspect", "--model-id", LAYOUT.model_id, "--tokens", text, "--json",
                                 address=daemon.address, token=TOKENS["acme"]).stdout)
    assert other["num_hit_blocks"] == 0  # another tenant sees nothing
    evicted = json.loads(kvtierctl("evict", "--tier", "t0", "--json", address=daemon.address,
                                   token=TOKENS["globex"]).stdout)
    assert int(evicted.get("num_t0_blocks", 0)) >= 8
    after = json.loads(kvtierctl("inspect", "--model-id", LAYOUT.model_id, "--tokens", text, "--json",
                                 address=daemon.address, token=TOKENS["globex"]).stdout)
    assert after["t0"] == 0 and after["t1"] + after["t2"] == 8  # on_evict copied them down
    flushed = kvtierctl("flush", address=daemon.address, token=TOKENS["globex"])
    assert flushed.returncode == 0, flushed.stderr
    gone = json.loads(kvtierctl("inspect", "--model-id", LAYOUT.model_id, "--tokens", text, "--json",
                                address=daemon.address, token=TOKENS["globex"]).stdout)
    assert gone["num_hit_blocks"] == 0


def test_evicting_every_tenant_or_draining_needs_an_admin(daemon):
    commit_prompt(daemon.address, TOKENS["acme"], seed=3)
    for args in (("evict", "--all"), ("flush", "--tenant", "acme"), ("drain",)):
        done = kvtierctl(*args, address=daemon.address, token=TOKENS["globex"])
        assert done.returncode == 4 and "admin" in done.stderr, args
    acme = json.loads(kvtierctl("stats", "--tenant", "", "--json", address=daemon.address, token=TOKENS["acme"]).stdout)
    assert int(acme[0]["num_t0_cached_blocks"]) >= 8  # nothing changed
    done = kvtierctl("flush", "--all", address=daemon.address, token=TOKENS["ops"])
    assert done.returncode == 0 and "dropped" in done.stdout


def grpc_health(address: str, service: str) -> str:
    """The daemon's gRPC Health status of `service`, as a probe sees it: "SERVING", "NOT_SERVING"."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_drain_refuses_new_sessions_and_resume_admits_them(daemon):
    done = kvtierctl("drain", "--wait", "5", address=daemon.address, token=TOKENS["ops"])
    assert done.returncode == 0 and "draining" in done.stdout and "safe to stop" in done.stdout
    try:
        with KvtierClient(daemon.address, token=TOKENS["acme"], max_attempts=1) as client:
            with pytest.raises(Unavailable, match="draining"):
                client.attach(LAYOUT)
        health = kvtierctl("health", address=daemon.address, token=TOKENS["acme"])
        assert health.returncode == 1 and "PROBLEM: draining" in health.stdout, health.stdout
        assert grpc_health(daemon.address, "kvtierd.v1.KvTier") == "NOT_SERVING"  # readiness: the same truth
        assert grpc_health(daemon.address, "") == "SERVING"  # liveness: alive, not to be restarted
    finally:
        resumed = kvtierctl("drain", "--resume", address=daemon.address, token=TOKENS["ops"])
    assert resumed.returncode == 0 and "admitting" in resumed.stdout
    health = kvtierctl("health", address=daemon.address, token=TOKENS["acme"])
    assert health.returncode == 0 and "healthy" in health.stdout, health.stdout
    assert grpc_health(daemon.address, "kvtierd.v1.KvTier") == grpc_health(daemon.address, "") == "SERVING"
    with KvtierClient(daemon.address, token=TOKENS["acme"]) as client:
        client.attach(LAYOUT).close()


def test_interrupting_drain_wait_exits_130_not_0(daemon):
    """Ctrl-C while sessions are still attached is not "safe to stop the daemon": 130, one line."""
    with KvtierClient(daemon.address, token=TOKENS["acme"]) as client:
        client.attach(LAYOUT)  # attached until the client closes: drain --wait keeps waiting
        process = subprocess.Popen([*KVTIERCTL, "--address", daemon.address, "--token", TOKENS["ops"], "drain",
                                    "--wait", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert process.stdout.readline().startswith("draining: new sessions are refused; ")
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
            resumed = kvtierctl("drain", "--resume", address=daemon.address, token=TOKENS["ops"])
    assert (process.returncode, stderr, stdout) == (130, "kvtierctl: interrupted\n", "")
    assert resumed.returncode == 0, resumed.stderr


def test_health_is_clean_and_an_unreachable_daemon_exits_3(daemon, tmp_path):
    done = kvtierctl("health", address=daemon.address, token=TOKENS["acme"])
    assert done.returncode == 0 and done.stdout.startswith("healthy"), done.stdout + done.stderr
    down = kvtierctl("health", address=f"unix://{tmp_path}/none.sock")
    assert down.returncode == 3 and "not running" in down.stderr and "Traceback" not in down.stderr
    bad = kvtierctl("stats", address=daemon.address, token="wrong")
    assert bad.returncode == 4 and "refused" in bad.stderr
