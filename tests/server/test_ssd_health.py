"""The node's SSD tier (T2) in health: off by choice is no problem; wanted and off (the default
directory without room), or a layout's T2 that stopped admitting, is a problem in `kvtierctl
health` (exit 1), in Stats and in the gRPC health service kvtierd.v1.SsdTier; a working T2 is
SERVING there from `ready` on."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until, written_through
from kvtierd.server.ssd_state import SSD_HEALTH_NAME
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.t2.test_ssd_reliability import fill

pytestmark = pytest.mark.timeout(180)
SMALL = ["--metrics-port", "-1", "--device", "cpu", "--t0-bytes", "4MiB", "--host-bytes", "8MiB"]


def health(daemon: DaemonProcess) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "kvtierd.cli.kvtierctl", "--address", daemon.address, "health"],
                          capture_output=True, text=True, timeout=60)


def ssd_health(daemon: DaemonProcess) -> str:
    """The gRPC Health status of kvtierd.v1.SsdTier: "SERVING", "NOT_SERVING", or "NOT_FOUND" (not reported)."""
    with grpc.insecure_channel(daemon.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SSD_HEALTH_NAME),
                                                               timeout=10)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def put_chain(client: KvtierClient, seed: int, num_tokens: int) -> int:
    tokens = prompt(seed, num_tokens)
    hashes = client.attach(LAYOUT).namespace.hash_blocks(tokens)
    blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
    return client.put(LAYOUT, blocks).num_blocks


@pytest.mark.parametrize("off", [["--ssd-dir", ""], ["--ssd-bytes", "0"]], ids=["ssd-dir-empty", "ssd-bytes-0"])
def test_t2_off_by_choice_runs_without_t2_creates_nothing_and_is_healthy(tmp_path, off):
    """`--ssd-dir ''` or `--ssd-bytes 0`: ready, no SSD directory made, `T2 off` in a healthy
    health, nothing reported under kvtierd.v1.SsdTier, Stats says T2 is off with no problem."""
    ssd = tmp_path / "ssd"
    with DaemonProcess(["--socket", str(tmp_path / "kvtierd.sock"), "--ssd-dir", str(ssd), *SMALL, *off]) as daemon, \
            KvtierClient(daemon.address) as client:
        assert put_chain(client, 1, 32) == 8
        assert any(line.startswith("T2 ssd: off") for line in daemon.lines)
        done = health(daemon)
        assert done.returncode == 0 and "T2 off" in done.stdout, done.stdout
        assert ssd_health(daemon) == "NOT_FOUND"
        stats = client.stats()
        assert (stats.ssd.enabled, stats.ssd.problem) == (False, "")
        assert not any(t.tier == "t2" and t.capacity_bytes for p in stats.pools for t in p.tiers)
    assert not ssd.exists()


def test_the_default_directory_without_room_runs_without_t2_and_health_says_so(tmp_path):
    """No --ssd-dir, and the default directory's filesystem has no free space (XDG_CACHE_HOME=/proc):
    the daemon runs without T2, says why at start, and health reports it as a problem."""
    args = ["--socket", str(tmp_path / "kvtierd.sock"), *SMALL]
    with DaemonProcess(args, env={"XDG_CACHE_HOME": "/proc"}) as daemon:
        assert any(line.startswith("T2 ssd: OFF: no room for T2 in /proc/kvtierd") for line in daemon.lines), \
            daemon.output()
        done = health(daemon)
        assert done.returncode == 1 and "PROBLEM: T2 (SSD) is off: no room for T2 in /proc/kvtierd" in done.stdout
        assert ssd_health(daemon) == "NOT_SERVING"
        with KvtierClient(daemon.address) as client:
            stats = client.stats()
        assert not stats.ssd.enabled and stats.ssd.directory == "/proc/kvtierd" and "no room" in stats.ssd.problem


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root only): a disk that can fill up under a running daemon."""
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_a_working_t2_is_serving_and_a_layouts_t2_that_stops_admitting_is_not(tmp_path, small_tmpfs):
    """T2 on a small disk: SERVING from ready (no layout attached yet) and after blocks reached it;
    the disk filled by another writer, the next write-through finds no room, that layout's T2 stops
    admitting, and kvtierd.v1.SsdTier turns NOT_SERVING, kvtierctl health exits 1 naming it."""
    args = small_daemon_args(str(tmp_path), ssd_bytes="512KiB", extra=WRITE_THROUGH)
    args[args.index("--ssd-dir") + 1] = str(small_tmpfs / "ssd")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        assert ssd_health(daemon) == "SERVING"
        assert put_chain(client, 2, 32) == 8
        assert wait_until(lambda: written_through(client), timeout_s=30)
        assert ssd_health(daemon) == "SERVING" and health(daemon).returncode == 0
        fill(small_tmpfs)
        for seed in range(3, 40):  # each chain's write-through may find the disk full
            put_chain(client, seed, 32)
            if not client.stats().pools[0].t2_admitting:
                break
        assert wait_until(lambda: ssd_health(daemon) == "NOT_SERVING", timeout_s=10)
        done = health(daemon)
        assert done.returncode == 1 and "T2 is not admitting blocks: disk full" in done.stdout, done.stdout
