"""Configuration of `kvtierd serve`: defaults < file < environment < flags, and every bad input named."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from kvtierd.endpoints import default_socket_path
from kvtierd.errors import InvalidArgument
from kvtierd.node.quotas import Quota
from kvtierd.server.config_flags import add_flags, overrides_from_args
from kvtierd.server.config_loader import ENV_KEYS, load_config
from kvtierd.server.config_summary import config_lines
from kvtierd.t2.ssd_config import default_ssd_dir
from kvtierd.units import GiB, MiB


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return str(path)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtierd serve")
    add_flags(parser)
    return parser


def test_defaults_load_with_an_empty_environ():
    """No file, no variables: a laptop configuration that validates."""
    config = load_config(environ={})
    assert config.server.socket == f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock"
    assert (config.server.tcp, config.server.metrics_port, config.server.lease_s) == ("", 9464, 30.0)
    assert config.server.max_message_bytes == 16 * MiB
    assert (config.pool.device, config.pool.t0_bytes, config.pool.hash_algo) == ("auto", 256 * MiB, "sha256")
    assert config.host.capacity_bytes == GiB and config.ssd.capacity_bytes == 4 * GiB
    assert config.ssd.directory == os.path.join(os.path.expanduser("~"), ".cache", "kvtierd")
    assert (config.policy.t0_to_t1, config.policy.t1_to_t2) == ("on_evict", "write_through")
    assert config.quotas == {} and config.log_level == "info"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pool.t0_bytes = 1  # type: ignore[misc]


def test_file_then_environment_then_overrides_win_for_the_same_key(tmp_path):
    """Each later source replaces the earlier value of a key; the others keep theirs."""
    path = write_toml(tmp_path, '[pool]\nt0_bytes = "64MiB"\nmax_layouts = 2\n[server]\nlease_s = 5\n')
    env = {"KVTIERD_POOL_T0_BYTES": "128MiB", "KVTIERD_SERVER_LEASE_S": "7.5"}
    assert load_config(path, environ={}).pool.t0_bytes == 64 * MiB
    from_env = load_config(path, environ=env)
    assert (from_env.pool.t0_bytes, from_env.server.lease_s, from_env.pool.max_layouts) == (128 * MiB, 7.5, 2)
    final = load_config(path, environ=env, overrides={"pool.t0_bytes": "512MiB", "server.lease_s": None})
    assert (final.pool.t0_bytes, final.server.lease_s, final.pool.max_layouts) == (512 * MiB, 7.5, 2)


def test_kvtierd_config_names_the_file_when_no_path_is_given(tmp_path):
    path = write_toml(tmp_path, 'log_level = "debug"\n[ssd]\ndirectory = ""\n')
    config = load_config(environ={"KVTIERD_CONFIG": path})
    assert config.log_level == "debug" and config.ssd.directory == ""


def test_config_sizes_and_kvtierctl_plan_budgets_read_the_same_words_alike(tmp_path):
    """One parser (kvtierd/units.py): "40GB" is 40·10⁹ bytes in the daemon's config too, "40GiB" 40·2³⁰."""
    path = write_toml(tmp_path, '[host]\ncapacity_bytes = "40GB"\n[ssd]\ncapacity_bytes = "40GiB"\n')
    config = load_config(environ={"KVTIERD_CONFIG": path})
    assert config.host.capacity_bytes == 40 * 10**9 and config.ssd.capacity_bytes == 40 << 30


def test_a_bad_size_names_the_key_and_the_variable():
    with pytest.raises(InvalidArgument, match=r"host\.capacity_bytes \(from KVTIERD_HOST_CAPACITY_BYTES\).*'lots'"):
        load_config(environ={"KVTIERD_HOST_CAPACITY_BYTES": "lots"})


@pytest.mark.parametrize("toml, name", [
    ('[server]\nsockett = "/x"\n', "server.sockett"),
    ('[sever]\nsocket = "/x"\n', "sever.socket"),
    ('loglevel = "debug"\n', "loglevel"),
    ('[quotas.a]\nt3_bytes = 1\n', "quotas.a.t3_bytes"),
])
def test_unknown_key_in_the_file_is_rejected_by_name(tmp_path, toml, name):
    with pytest.raises(InvalidArgument, match=f"unknown config key '{name}'"):
        load_config(write_toml(tmp_path, toml), environ={})


def test_unknown_key_error_suggests_the_close_one(tmp_path):
    with pytest.raises(InvalidArgument, match=r"did you mean server\.socket"):
        load_config(write_toml(tmp_path, '[server]\nsockett = "/x"\n'), environ={})


def test_unknown_kvtierd_variable_is_rejected_by_name_and_others_are_ignored():
    with pytest.raises(InvalidArgument, match="KVTIERD_POOL_T0_BYTE.*did you mean KVTIERD_POOL_T0_BYTES"):
        load_config(environ={"KVTIERD_POOL_T0_BYTE": "1G"})
    config = load_config(environ={"KVTIERD_BENCH_DIR": "/var/tmp", "HOME_POOL_T0_BYTE": "x",
                                  "KVTIERD_LOG_LEVEL": "warning"})
    assert config.log_level == "warning"


def test_missing_file_and_toml_syntax_errors_are_invalid_arguments(tmp_path):
    with pytest.raises(InvalidArgument, match=r"config file .*nope\.toml not found"):
        load_config(str(tmp_path / "nope.toml"), environ={})
    with pytest.raises(InvalidArgument, match="line 2"):
        load_config(write_toml(tmp_path, '[server]\nsocket = \n'), environ={})


@pytest.mark.parametrize("text, value", [("1", True), ("yes", True), ("TRUE", True), ("0", False), ("no", False),
                                         ("false", False)])
def test_environment_booleans(text, value):
    assert load_config(environ={"KVTIERD_SSD_O_DIRECT": text}).ssd.o_direct is value


@pytest.mark.parametrize("name, text, fragment", [
    ("KVTIERD_SSD_O_DIRECT", "maybe", "true or false"),
    ("KVTIERD_SERVER_METRICS_PORT", "80.5", "an integer"),
    ("KVTIERD_SERVER_GRACE_S", "soon", "a number"),
])
def test_environment_values_of_the_wrong_type_are_rejected(name, text, fragment):
    with pytest.raises(InvalidArgument, match=f"{fragment}, got '{text}'"):
        load_config(environ={name: text})


def test_toml_values_of_the_wrong_type_are_rejected(tmp_path):
    with pytest.raises(InvalidArgument, match="server.socket .* must be a string, got 5"):
        load_config(write_toml(tmp_path, "[server]\nsocket = 5\n"), environ={})
    with pytest.raises(InvalidArgument, match="must be an integer, got True"):
        load_config(write_toml(tmp_path, "[pool]\nmax_layouts = true\n"), environ={})


@pytest.mark.parametrize("overrides, fragment", [
    ({"server.tls_cert": "c.pem"}, "tls_cert and server.tls_key go together"),
    ({"server.tls_key": "k.pem"}, "tls_cert and server.tls_key go together"),
    ({"server.tcp": "127.0.0.1:0"}, "insecure_tcp"),
    ({"server.tcp": "localhost", "server.insecure_tcp": True}, "HOST:PORT"),
    ({"server.tcp": "127.0.0.1:70000", "server.insecure_tcp": True}, "HOST:PORT"),
    ({"server.tls_client_ca": "ca.pem"}, "tls_client_ca requires TLS"),
    ({"server.tls_client_ca": "ca.pem", "server.tcp": "h:1", "server.insecure_tcp": True}, "tls_client_ca requires"),
    ({"server.lease_s": 0}, "lease_s must be > 0"),
    ({"server.grace_s": -0.5}, "grace_s must be >= 0"),
    ({"pool.t0_bytes": 0}, "pool.t0_bytes must be > 0"),
    ({"pool.max_layouts": 0}, "max_layouts"),
    ({"pool.device": "gpu"}, "pool.device"),
    ({"pool.hash_algo": "md5"}, "pool.hash_algo must be one of sha256, xxh3_128"),
    ({"pool.cuda_share": "nccl"}, "pool.cuda_share must be one of fd, ipc"),
    ({"host.codec": "zstd"}, "host.codec must be one of raw, fp8"),
    ({"ssd.codec": "int4"}, "ssd.codec must be one of raw, fp8"),
    ({"ssd.durability": "fsync"}, "ssd.durability must be one of fdatasync, none"),
    ({"policy.t0_to_t1": "sometimes"}, "policy.t0_to_t1 must be one of write_through, on_evict, off"),
    ({"policy.t1_to_t2": "always"}, "policy.t1_to_t2 must be one of"),
    ({"policy.recompute_s_per_token": -1}, "recompute_s_per_token"),
    ({"server.metrics_port": 65536}, "metrics_port"),
    ({"server.metrics_port": -2}, "metrics_port"),
    ({"server.socket": ""}, "nothing to listen on"),
    ({"log_level": "loud"}, "log_level must be one of"),
])
def test_each_validation_rule_rejects_with_a_clear_message(overrides, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        load_config(environ={}, overrides=overrides)


@pytest.mark.parametrize("overrides", [
    {"server.tcp": "127.0.0.1:0", "server.insecure_tcp": "yes"},
    {"server.tcp": "[::1]:7000", "server.tls_cert": "c.pem", "server.tls_key": "k.pem", "server.tls_client_ca": "ca"},
    {"server.socket": "", "server.tcp": "0.0.0.0:443", "server.tls_cert": "c.pem", "server.tls_key": "k.pem"},
    {"server.grace_s": 0, "server.metrics_port": -1, "pool.device": "cuda:1", "policy.t0_to_t1": "off"},
    {"server.metrics_port": 0, "ssd.durability": "none", "host.codec": "fp8", "pool.hash_algo": "xxh3_128"},
])
def test_valid_edges_are_accepted(overrides):
    config = load_config(environ={}, overrides=overrides)
    assert config.server.tcp == overrides.get("server.tcp", "")


def test_quotas_tables_are_parsed_per_tenant_and_merged_with_overrides(tmp_path):
    path = write_toml(tmp_path, '[quotas."tenant-a"]\nt0_bytes = "1GiB"\nt2_bytes = 1048576\n'
                                '[quotas.b]\nt1_bytes = "2GB"\n')
    config = load_config(path, environ={}, overrides={"quotas.tenant-a.t1_bytes": "3MiB"})
    assert config.quotas == {"tenant-a": Quota(t0_bytes=GiB, t1_bytes=3 * MiB, t2_bytes=1 << 20),
                             "b": Quota(t1_bytes=2 * 10**9)}


def test_default_socket_path_follows_xdg_runtime_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "kvtierd.sock")
    assert load_config(environ={"XDG_RUNTIME_DIR": str(tmp_path)}).server.socket == str(tmp_path / "kvtierd.sock")
    fallback = f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert default_socket_path() == fallback
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == fallback


def test_default_ssd_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_ssd_dir() == str(tmp_path / "kvtierd")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_ssd_dir() == str(tmp_path / "home" / ".cache" / "kvtierd")


def test_flags_round_trip_into_the_config():
    args = serve_parser().parse_args([
        "--config", "/etc/kvtierd.toml", "--socket", "/run/k.sock", "--tcp", "127.0.0.1:0", "--insecure-tcp",
        "--tokens-file", "/etc/tokens", "--metrics-host", "0.0.0.0", "--metrics-port", "0", "--lease-s", "2.5",
        "--device", "cpu", "--t0-bytes", "64MiB", "--host-bytes", "2G", "--ssd-dir", "", "--ssd-bytes", "1G",
        "--log-level", "debug", "--set", "policy.t1_to_t2=off", "--set", "quotas.t.t0_bytes=1k",
    ])
    assert args.config == "/etc/kvtierd.toml"
    overrides = overrides_from_args(args)
    assert overrides["server.insecure_tcp"] is True and overrides["pool.t0_bytes"] == "64MiB"
    config = load_config(environ={}, overrides=overrides)
    server = config.server
    assert (server.socket, server.tcp, server.insecure_tcp, server.tokens_file) == \
        ("/run/k.sock", "127.0.0.1:0", True, "/etc/tokens")
    assert (server.metrics_host, server.metrics_port, server.lease_s) == ("0.0.0.0", 0, 2.5)
    assert (config.pool.device, config.pool.t0_bytes, config.host.capacity_bytes) == ("cpu", 64 * MiB, 2 * 10**9)
    assert (config.ssd.directory, config.ssd.capacity_bytes, config.log_level) == ("", 10**9, "debug")
    assert config.policy.t1_to_t2 == "off" and config.quotas == {"t": Quota(t0_bytes=1000)}


def test_flags_not_given_override_nothing():
    args = serve_parser().parse_args([])
    assert args.config is None and overrides_from_args(args) == {}


def test_tls_flags_and_a_bad_set():
    args = serve_parser().parse_args(["--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"])
    assert overrides_from_args(args) == {"server.tls_cert": "c", "server.tls_key": "k", "server.tls_client_ca": "ca"}
    with pytest.raises(InvalidArgument, match="SECTION.KEY=VALUE"):
        overrides_from_args(serve_parser().parse_args(["--set", "pool.device"]))
    with pytest.raises(InvalidArgument, match="unknown config key 'pool.devices' in the command line"):
        load_config(environ={}, overrides=overrides_from_args(serve_parser().parse_args(["--set", "pool.devices=x"])))


def test_every_flag_help_names_its_environment_variable():
    help_text = " ".join(serve_parser().format_help().split())
    for name in ("KVTIERD_CONFIG", "KVTIERD_SERVER_SOCKET", "KVTIERD_SERVER_TCP", "KVTIERD_SERVER_TLS_CERT",
                 "KVTIERD_SERVER_TLS_KEY", "KVTIERD_SERVER_TLS_CLIENT_CA", "KVTIERD_SERVER_INSECURE_TCP",
                 "KVTIERD_SERVER_TOKENS_FILE", "KVTIERD_SERVER_METRICS_PORT", "KVTIERD_SERVER_METRICS_HOST",
                 "KVTIERD_SERVER_LEASE_S", "KVTIERD_POOL_DEVICE", "KVTIERD_POOL_T0_BYTES",
                 "KVTIERD_HOST_CAPACITY_BYTES", "KVTIERD_SSD_DIRECTORY", "KVTIERD_SSD_CAPACITY_BYTES",
                 "KVTIERD_LOG_LEVEL"):
        assert f"[env {name}]" in help_text
        assert name == "KVTIERD_CONFIG" or name in ENV_KEYS


def test_config_lines_show_addresses_sizes_and_auth_but_never_a_token(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("tenant-a s3cr3t-token\n")
    config = load_config(environ={}, overrides={
        "server.tcp": "127.0.0.1:0", "server.insecure_tcp": True, "server.tokens_file": str(tokens),
        "server.metrics_port": -1, "ssd.directory": "", "quotas.a.t0_bytes": 1, "quotas.b.t1_bytes": 1})
    text = "\n".join(config_lines(config))
    assert "s3cr3t" not in text
    assert f"bearer tokens from {tokens}" in text and "listen: tcp 127.0.0.1:0 (INSECURE: no TLS)" in text
    assert "T0 pool: 256.0 MiB per layout" in text and "T1 host: 1.0 GiB" in text
    assert "T2 ssd: off" in text and "metrics: off" in text and "quotas: 2 tenants" in text
    default_text = "\n".join(config_lines(load_config(environ={})))
    assert f"unix peer (socket owner uid {os.getuid()})" in default_text
    assert "T2 ssd: 4.0 GiB for the node in" in default_text
    assert "T2 at rest: in the clear ([encryption] off)" in default_text
    assert "T1 host: 1.0 GiB for the node, shared by the layouts as demand goes" in default_text


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557", "tcp://[::]:5557",
                                      "tcp://node-7.example:5557"])
def test_kv_events_refuse_a_non_loopback_endpoint_unless_allow_remote(endpoint):
    """Events reveal every tenant's prefixes: a PUB or replay endpoint others can reach needs allow_remote."""
    for key in ("events.zmq_endpoint", "events.replay_endpoint"):
        overrides = {"events.zmq_endpoint": "tcp://127.0.0.1:5557", key: endpoint}
        with pytest.raises(InvalidArgument, match=f"{key} .* is not a loopback address"):
            load_config(environ={}, overrides=overrides)
        assert load_config(environ={}, overrides={**overrides, "events.allow_remote": "true"}).events.allow_remote


@pytest.mark.parametrize("overrides, fragment", [
    ({"events.replay_endpoint": "tcp://127.0.0.1:5558"}, "replay_endpoint needs events.zmq_endpoint"),
    ({"events.zmq_endpoint": "udp://127.0.0.1:5557"}, "must be tcp://HOST:PORT"),
    ({"events.zmq_endpoint": "tcp://127.0.0.1"}, "must be tcp://HOST:PORT"),
    ({"events.zmq_endpoint": "ipc:///tmp/e", "events.buffer_steps": 0}, "buffer_steps must be >= 1"),
    ({"events.zmq_endpoint": "ipc:///tmp/e", "events.max_queued_events": 0}, "max_queued_events must be >= 1"),
    ({"events.format": "json"}, "events.format must be one of map, array"),
    ({"events.salt": "cache_salt"}, "events.salt must be one of tenant, none"),
])
def test_kv_events_validation_rules(overrides, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        load_config(environ={}, overrides=overrides)


def test_kv_events_are_off_by_default_and_loopback_ipc_and_env_spellings_are_accepted():
    assert load_config(environ={}).events.zmq_endpoint == ""
    assert "kv events: off" in config_lines(load_config(environ={}))
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://localhost:0", "tcp://[::1]:5557", "tcp://127.0.0.1:*",
                     "ipc:///run/kvtierd/events"):
        assert load_config(environ={}, overrides={"events.zmq_endpoint": endpoint}).events.zmq_endpoint == endpoint
    config = load_config(environ={"KVTIERD_EVENTS_ZMQ_ENDPOINT": "tcp://127.0.0.1:5557",
                                  "KVTIERD_EVENTS_REPLAY_ENDPOINT": "tcp://127.0.0.1:5558",
                                  "KVTIERD_EVENTS_LOWER_TIERS": "false", "KVTIERD_EVENTS_TOPIC": "kv@node@{model}"})
    line, = [line for line in config_lines(config) if line.startswith("kv events:")]
    assert line == ("kv events: bind tcp://127.0.0.1:5557, replay tcp://127.0.0.1:5558, topic 'kv@node@{model}', "
                    "map format, media GPU, salt tenant")


def test_a_cuda_pool_is_shared_by_fd_unless_the_daemon_has_no_fd_socket():
    """pool.cuda_share = fd by default; a TCP-only daemon (no unix socket, so no fd socket) shares its
    CUDA pools by IPC handle, and start-up says so; an explicit ipc stays ipc."""
    from kvtierd.server.serve import pool_settings

    config = load_config(environ={}, overrides={"pool.device": "cuda"})
    assert config.pool.cuda_share == "fd" and pool_settings(config).pool.cuda_share == "fd"
    assert any("a CUDA pool is shared by POSIX fd over the fd socket" in line for line in config_lines(config))
    tcp_only = load_config(environ={}, overrides={"pool.device": "cuda", "server.socket": "",
                                                  "server.tcp": "127.0.0.1:0", "server.insecure_tcp": "true"})
    assert pool_settings(tcp_only).pool.cuda_share == "ipc"
    assert any("by cudaIpc handle (no unix socket, so no fd socket)" in line for line in config_lines(tcp_only))
    explicit = load_config(environ={}, overrides={"pool.device": "cuda", "pool.cuda_share": "ipc"})
    assert pool_settings(explicit).pool.cuda_share == "ipc"
    on_cpu = load_config(environ={}, overrides={"pool.device": "cpu"})
    assert not any("CUDA pool" in line for line in config_lines(on_cpu))
