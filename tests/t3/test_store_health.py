"""The shared store's health as an operator reads it from a real daemon: `kvtierctl health`, the
gRPC Health service kvtierd.v1.SharedStore and the metrics tell the same truth, from the first
second (the daemon probes the store before ready) and with no traffic (it probes every
remote.probe_interval_s)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.launch.daemon_process import DaemonProcess, wait_until
from tests.t3.redis_cluster import kill_node
from tests.t3.test_two_nodes import TOKENS, node_args

pytestmark = pytest.mark.timeout(180)


def started(tmp_path, seeds: str, *extra: str) -> DaemonProcess:
    (tmp_path / "tokens").write_text(TOKENS)
    (tmp_path / "node").mkdir()
    return DaemonProcess(node_args(tmp_path / "node", seeds, "--set", "remote.probe_interval_s=0.2", *extra))


def health(daemon: DaemonProcess) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "kvtierd.cli.kvtierctl", "--address", daemon.address,
                           "--token", "a-token", "health"], capture_output=True, text=True, timeout=60)


def store_health(daemon: DaemonProcess) -> str:
    """The gRPC Health status of the service name kvtierd.v1.SharedStore."""
    with grpc.insecure_channel(daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvtierd.v1.SharedStore"), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def store_gauges(daemon: DaemonProcess) -> dict[str, float]:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("kvtierd_t3_up", "kvtierd_t3_open_nodes", "kvtierd_t3_nodes",
                          "kvtierd_t3_credentials_refused")}


def test_a_healthy_store_is_serving_from_the_first_second_and_every_dead_master_is_counted(tmp_path, redis_cluster):
    """Right after ready, with no request made: healthy, SERVING, up. All three masters killed with
    no traffic: within a few probes, 3 of 3 unreachable everywhere."""
    with started(tmp_path, redis_cluster.seeds) as daemon:
        first = health(daemon)
        assert first.returncode == 0 and "the shared store (T3) answers" in first.stdout, first.stdout
        assert store_health(daemon) == "SERVING"
        assert store_gauges(daemon) == {"kvtierd_t3_up": 1, "kvtierd_t3_open_nodes": 0, "kvtierd_t3_nodes": 3,
                                        "kvtierd_t3_credentials_refused": 0}
        for port in redis_cluster.ports:
            kill_node(redis_cluster, port)
        assert wait_until(lambda: store_gauges(daemon)["kvtierd_t3_open_nodes"] == 3, timeout_s=30)
        down = health(daemon)
        assert down.returncode == 1 and "PROBLEM: shared store (T3): 3 of 3 nodes unreachable" in down.stdout, \
            down.stdout
        assert wait_until(lambda: store_health(daemon) == "NOT_SERVING", timeout_s=10)
        assert store_gauges(daemon)["kvtierd_t3_up"] == 0


def test_a_refused_password_is_named_as_such_not_as_an_outage(tmp_path, make_redis_cluster):
    cluster = make_redis_cluster(username="kvtier", password="t3-secret")
    (tmp_path / "password").write_text("not-the-secret\n")
    with started(tmp_path, cluster.seeds, "--set", "remote.username=kvtier",
                 "--set", f"remote.password_file={tmp_path / 'password'}") as daemon:
        refused = health(daemon)
        assert refused.returncode == 1, refused.stdout
        assert "PROBLEM: shared store (T3): " in refused.stdout and ": credentials refused (" in refused.stdout
        assert "check remote.username and remote.password_file" in refused.stdout
        assert "unreachable" not in refused.stdout and "not-the-secret" not in refused.stdout
        assert store_gauges(daemon)["kvtierd_t3_credentials_refused"] == 1
        assert store_health(daemon) == "NOT_SERVING"
