"""Local Redis Cluster (or one plain redis-server) on 127.0.0.1, from .tools/bin (scripts/install-redis-server).

The library behind scripts/redis-cluster, tests/t3/redis_cluster.py and benchmarks/bench_redis_clients.py:
`start_cluster` starts N masters with `--cluster-enabled yes --save "" --appendonly no
--cluster-require-full-coverage no --maxmemory M --maxmemory-policy allkeys-lru`, forms the cluster
with `redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes` and waits (polling, bounded)
until every node says cluster_state:ok with all 16384 slots assigned and every node reports the same
slot map; `start_single` starts one non-cluster redis-server with the same memory and persistence
flags. Ports are given, or picked free (port P and its cluster bus P + 10000 both bindable; a node that
loses its picked port to a race is restarted on another). Options: a password (`requirepass`), or an
ACL user with a password (the default user is then off, so a connection that does not authenticate
gets NOAUTH), and TLS (`tls_dir`: a CA and a server certificate for 127.0.0.1 made with openssl;
the cluster bus runs TLS too; clients may present a certificate, none is required).

Stdlib plus redis-py (imported where a client is needed). A `LocalRedis` records its processes in
DIR/cluster.json, so that `scripts/redis-cluster stop --dir DIR` can stop servers another process started.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = ROOT / ".tools" / "bin"
INSTALL_SCRIPT = ROOT / "scripts" / "install-redis-server"
HOST = "127.0.0.1"
NUM_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a cluster node's bus listens on its port + 10000
STATE_FILE = "cluster.json"
DEFAULT_MAXMEMORY = "256mb"
DEFAULT_NODE_TIMEOUT_MS = 3000  # cluster-node-timeout: how soon the others mark a killed node FAIL
START_ATTEMPTS = 4  # a picked port taken before redis-server binds it: pick another, this many times


class RedisClusterError(RuntimeError):
    """A server that did not start, a cluster that did not form, an install that failed."""


def install() -> tuple[Path, Path]:
    """scripts/install-redis-server (idempotent); (redis-server, redis-cli), or RedisClusterError saying why."""
    try:
        done = subprocess.run([str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RedisClusterError(f"{INSTALL_SCRIPT} did not run: {e}") from e
    if done.returncode != 0:
        raise RedisClusterError(f"{INSTALL_SCRIPT} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return TOOLS_BIN / "redis-server", TOOLS_BIN / "redis-cli"


def binaries() -> tuple[Path, Path]:
    """.tools/bin's redis-server and redis-cli as installed, or RedisClusterError naming the install script."""
    server, cli = TOOLS_BIN / "redis-server", TOOLS_BIN / "redis-cli"
    for path in (server, cli):
        if not os.access(path, os.X_OK):
            raise RedisClusterError(f"{path} is missing: run {INSTALL_SCRIPT}")
    return server, cli


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = True, avoid: Iterable[int] = ()) -> int:
    """A port the kernel hands out for port 0 whose cluster bus port (+10000) is free too."""
    avoid = set(avoid)
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port = probe.getsockname()[1]
        if port in avoid or (cluster and (port + BUS_PORT_OFFSET > 65535 or port + BUS_PORT_OFFSET in avoid)):
            continue
        if not cluster or _bindable(port + BUS_PORT_OFFSET):
            return port
    raise RedisClusterError("found no free port pair (P, P + 10000) on 127.0.0.1")


# ------------------------------------------------------------------------------------------------ TLS


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    """A CA certificate and a certificate + key it signed for 127.0.0.1 / localhost (server and client)."""

    ca_cert: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> TlsFiles:
        """Generates them with openssl into `directory` (kept if already there)."""
        directory.mkdir(parents=True, exist_ok=True)
        files = cls(directory / "ca.crt", directory / "redis.crt", directory / "redis.key")
        if all(path.exists() for path in (files.ca_cert, files.cert, files.key)):
            return files
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        (directory / "redis.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
            "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
        steps = [
            ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=kvtierd test CA"],
            ["req", "-new", *ec, "-keyout", "redis.key", "-out", "redis.csr", "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "redis.crt", "-days", "3650", "-extfile", "redis.ext"],
        ]
        for step in steps:
            try:
                done = subprocess.run(["openssl", *step], cwd=directory, capture_output=True, text=True, timeout=60)
            except OSError as e:
                raise RedisClusterError(f"TLS needs openssl: {e}") from e
            if done.returncode != 0:
                raise RedisClusterError(f"openssl {' '.join(step)} failed:\n{done.stderr}")
        files.key.chmod(0o600)
        return files


# ------------------------------------------------------------------------------------------------ servers


@dataclasses.dataclass(slots=True)
class Node:
    port: int
    pid: int
    log: Path
    process: subprocess.Popen | None = None  # None when read back from DIR/cluster.json

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return _is_our_redis(self.pid, self.port)


def _is_our_redis(pid: int, port: int) -> bool:
    """Whether `pid` is still a redis-server on `port` (its title is 'redis-server 127.0.0.1:PORT ...')."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return "redis-server" in title and f":{port}" in title and state != "Z"


_PR_SET_PDEATHSIG = 1
_prctl = None  # libc's prctl, looked up before the fork: the child only calls it


def _die_with_parent() -> None:
    """In the child: SIGKILL when the thread that started it ends (prctl PR_SET_PDEATHSIG)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass
class LocalRedis:
    """Servers this process (or the one that wrote DIR/cluster.json) started: a cluster or one plain redis."""

    directory: Path
    nodes: dict[int, Node]
    cluster: bool
    username: str | None = None
    password: str | None = None
    tls: TlsFiles | None = None
    maxmemory: str = DEFAULT_MAXMEMORY
    slot_ranges: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (first, last, port)

    # ------------------------------------------------------------------------------------------ addresses

    @property
    def host(self) -> str:
        return HOST

    @property
    def ports(self) -> list[int]:
        return sorted(self.nodes)

    @property
    def endpoints(self) -> list[str]:
        """'127.0.0.1:PORT' for every node: the seeds of a cluster client."""
        return [f"{HOST}:{port}" for port in self.ports]

    @property
    def seeds(self) -> str:
        return ",".join(self.endpoints)

    def connection_kwargs(self) -> dict:
        """redis-py's keyword arguments for this deployment's credentials and TLS."""
        kwargs: dict = {}
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca_cert))
        return kwargs

    def node_client(self, port: int, **kwargs):
        """A plain redis.Redis on one node (it serves only the slots that node owns)."""
        import redis

        return redis.Redis(host=HOST, port=port, **{**self.connection_kwargs(), **kwargs})

    def cluster_client(self, **kwargs):
        """A redis.RedisCluster seeded with every node."""
        import redis
        from redis.cluster import ClusterNode

        if not self.cluster:
            raise RedisClusterError("a single redis-server is not a cluster: use node_client")
        return redis.RedisCluster(startup_nodes=[ClusterNode(HOST, port) for port in self.ports],
                                  **{**self.connection_kwargs(), **kwargs})

    # ------------------------------------------------------------------------------------------ slots

    def slot_owner(self, slot: int) -> int:
        """The port of the master that owned `slot` when the cluster formed."""
        for first, last, port in self.slot_ranges:
            if first <= slot <= last:
                return port
        raise KeyError(f"slot {slot} is not assigned")

    def key_owner(self, key: bytes | str) -> int:
        """The port of the master that owns `key`'s slot (CRC16 of the key or its {hash tag}, mod 16384)."""
        return self.slot_owner(key_slot(key))

    def slots_of(self, port: int) -> list[tuple[int, int]]:
        """The (first, last) slot ranges `port` owned when the cluster formed."""
        return [(first, last) for first, last, owner in self.slot_ranges if owner == port]

    def read_slot_ranges(self, port: int) -> list[tuple[int, int, int]]:
        """CLUSTER SLOTS as one node sees it now: sorted (first, last, master port)."""
        with contextlib.closing(self.node_client(port, socket_timeout=5)) as client:
            return sorted((int(first), int(last), int(master[1])) for first, last, master, *_ in
                          client.execute_command("CLUSTER SLOTS"))

    # ------------------------------------------------------------------------------------------ processes

    def kill_node(self, port: int) -> None:
        """SIGKILL one node and reap it (its slots then fail; the others go on serving theirs)."""
        node = self.nodes[port]
        if node.alive():
            os.kill(node.pid, signal.SIGKILL)
        if node.process is not None:
            node.process.wait(30)
        else:
            _wait_gone(node)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every node that is still running (SIGKILL after `timeout_s`); always reaps them."""
        for node in self.nodes.values():
            if node.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes.values():
            if node.process is not None:
                try:
                    node.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(30)
            elif not _wait_gone(node, deadline) and node.alive():
                os.kill(node.pid, signal.SIGKILL)
                _wait_gone(node)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / STATE_FILE).unlink()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ state file

    def save_state(self) -> None:
        state = {"cluster": self.cluster, "username": self.username, "password": self.password,
                 "maxmemory": self.maxmemory, "slot_ranges": self.slot_ranges,
                 "tls": None if self.tls is None else {f.name: str(getattr(self.tls, f.name))
                                                        for f in dataclasses.fields(TlsFiles)},
                 "nodes": [{"port": n.port, "pid": n.pid, "log": str(n.log)} for n in self.nodes.values()]}
        path = self.directory / STATE_FILE
        path.with_suffix(".tmp").write_text(json.dumps(state, indent=1))
        path.with_suffix(".tmp").replace(path)

    @classmethod
    def load_state(cls, directory: Path) -> LocalRedis:
        state = json.loads((directory / STATE_FILE).read_text())
        tls = None if state["tls"] is None else TlsFiles(**{k: Path(v) for k, v in state["tls"].items()})
        return cls(directory=directory, cluster=state["cluster"], username=state["username"],
                   password=state["password"], tls=tls, maxmemory=state["maxmemory"],
                   slot_ranges=[tuple(r) for r in state["slot_ranges"]],
                   nodes={n["port"]: Node(n["port"], n["pid"], Path(n["log"])) for n in state["nodes"]})


def _wait_gone(node: Node, deadline: float | None = None) -> bool:
    deadline = time.monotonic() + 30 if deadline is None else deadline
    while node.alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def key_slot(key: bytes | str) -> int:
    """The cluster slot of `key` (redis-py's key_slot: CRC16-XMODEM of the key or its {hash tag}, mod 16384)."""
    from redis.crc import key_slot as redis_key_slot

    return redis_key_slot(key.encode() if isinstance(key, str) else key)


# ------------------------------------------------------------------------------------------------ starting


def _server_args(server: Path, port: int, directory: Path, *, cluster: bool, maxmemory: str,
                 username: str | None, password: str | None, tls: TlsFiles | None, node_timeout_ms: int,
                 extra: Sequence[str]) -> list[str]:
    args = [str(server), "--bind", HOST, "--dir", str(directory), "--daemonize", "no",
            "--save", "", "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
            "--loglevel", "notice"]
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                 "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca_cert),
                 "--tls-auth-clients", "optional"]
        if cluster:
            args += ["--tls-cluster", "yes"]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-require-full-coverage", "no", "--cluster-node-timeout", str(node_timeout_ms)]
    if username is not None:
        if password is None:
            raise RedisClusterError("an ACL user needs a password")
        # The default user off: a connection that does not AUTH as `username` is refused (NOAUTH).
        args += ["--user", "default", "off", "--user", username, "on", f">{password}", "~*", "&*", "+@all"]
    elif password is not None:
        args += ["--requirepass", password]
    return args + list(extra)


def _ping(port: int, *, username: str | None, password: str | None, tls: TlsFiles | None) -> bool:
    import redis

    kwargs = {"username": username, "password": password}
    if tls is not None:
        kwargs.update(ssl=True, ssl_ca_certs=str(tls.ca_cert))
    try:
        with contextlib.closing(redis.Redis(host=HOST, port=port, socket_timeout=2, socket_connect_timeout=2,
                                            **kwargs)) as client:
            return bool(client.ping())
    except redis.exceptions.ConnectionError:  # refused while it starts; TimeoutError is a ConnectionError
        return False


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start_nodes(directory: Path, ports: Sequence[int] | None, count: int, *, cluster: bool, maxmemory: str,
                 username: str | None, password: str | None, tls: TlsFiles | None, node_timeout_ms: int,
                 die_with_parent: bool, timeout_s: float, extra: Sequence[str]) -> dict[int, Node]:
    """Starts the servers and waits until each answers PING; on failure stops those it started."""
    global _prctl
    server, _ = binaries()
    if die_with_parent and _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    picked = ports is None
    wanted = list(ports) if ports is not None else []
    while len(wanted) < count:
        wanted.append(free_port(cluster=cluster, avoid=wanted + [p + BUS_PORT_OFFSET for p in wanted]))
    nodes: dict[int, Node] = {}  # answered PING
    pending: dict[int, Node] = {}  # started, not yet answering

    def launch(port: int) -> Node:
        if cluster:  # no persistence: a node config from an earlier run would only make `create` refuse
            with contextlib.suppress(FileNotFoundError):
                (directory / f"nodes-{port}.conf").unlink()
        log = directory / f"redis-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                _server_args(server, port, directory, cluster=cluster, maxmemory=maxmemory, username=username,
                             password=password, tls=tls, node_timeout_ms=node_timeout_ms, extra=extra),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None)
        return Node(port, process.pid, log, process)

    try:
        for port in wanted:
            pending[port] = launch(port)
        attempts = 1
        deadline = time.monotonic() + timeout_s
        while pending:
            for port, node in list(pending.items()):
                if _ping(port, username=username, password=password, tls=tls):
                    nodes[port] = pending.pop(port)
                elif node.process.poll() is not None:
                    pending.pop(port)
                    reason = _log_tail(node.log)
                    if picked and "Address already in use" in reason and attempts < START_ATTEMPTS:
                        attempts += 1
                        taken = list(nodes) + list(pending)
                        new_port = free_port(cluster=cluster, avoid=taken + [p + BUS_PORT_OFFSET for p in taken])
                        pending[new_port] = launch(new_port)
                    else:
                        raise RedisClusterError(f"redis-server on port {port} exited "
                                                f"({node.process.returncode}):\n{reason}")
            if pending and time.monotonic() > deadline:
                raise RedisClusterError(f"redis-server did not answer PING within {timeout_s:g} s on ports "
                                        f"{sorted(pending)}:\n" + "\n".join(_log_tail(n.log) for n in pending.values()))
            if pending:
                time.sleep(0.02)
    except BaseException:
        LocalRedis(directory, {**nodes, **pending}, cluster).stop(2)
        raise
    return nodes


def start_single(directory: str | os.PathLike, *, port: int | None = None, maxmemory: str = DEFAULT_MAXMEMORY,
                 username: str | None = None, password: str | None = None, tls_dir: str | os.PathLike | None = None,
                 die_with_parent: bool = False, timeout_s: float = 30.0, extra: Sequence[str] = ()) -> LocalRedis:
    """One plain (non-cluster) redis-server on 127.0.0.1 (`port`, or a free one)."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    tls = None if tls_dir is None else TlsFiles.make(Path(tls_dir))
    nodes = _start_nodes(directory, None if port is None else [port], 1, cluster=False, maxmemory=maxmemory,
                         username=username, password=password, tls=tls, node_timeout_ms=DEFAULT_NODE_TIMEOUT_MS,
                         die_with_parent=die_with_parent, timeout_s=timeout_s, extra=extra)
    deployment = LocalRedis(directory, nodes, cluster=False, username=username, password=password, tls=tls,
                            maxmemory=maxmemory)
    deployment.save_state()
    return deployment


def start_cluster(directory: str | os.PathLike, *, ports: Sequence[int] | None = None, masters: int = 3,
                  maxmemory: str = DEFAULT_MAXMEMORY, username: str | None = None, password: str | None = None,
                  tls_dir: str | os.PathLike | None = None, node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
                  die_with_parent: bool = False, timeout_s: float = 60.0, extra: Sequence[str] = ()) -> LocalRedis:
    """`masters` cluster masters on 127.0.0.1 (`ports`, or free ones), formed and agreed on every slot."""
    if ports is not None:
        masters = len(ports)
    if masters < 3:
        raise RedisClusterError(f"redis-cli --cluster create needs at least 3 masters, not {masters}")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    tls = None if tls_dir is None else TlsFiles.make(Path(tls_dir))
    deadline = time.monotonic() + timeout_s
    nodes = _start_nodes(directory, ports, masters, cluster=True, maxmemory=maxmemory, username=username,
                         password=password, tls=tls, node_timeout_ms=node_timeout_ms,
                         die_with_parent=die_with_parent, timeout_s=timeout_s, extra=extra)
    deployment = LocalRedis(directory, nodes, cluster=True, username=username, password=password, tls=tls,
                            maxmemory=maxmemory)
    try:
        deployment.save_state()
        _create(deployment, deadline)
        deployment.slot_ranges = wait_cluster_ok(deployment, deadline)
        deployment.save_state()
    except BaseException:
        deployment.stop(2)
        raise
    return deployment


def redis_cli_args(deployment: LocalRedis) -> tuple[list[str], dict[str, str]]:
    """redis-cli's flags and environment for this deployment (the password goes in REDISCLI_AUTH)."""
    _, cli = binaries()
    args, env = [str(cli)], dict(os.environ)
    if deployment.username is not None:
        args += ["--user", deployment.username]
    if deployment.password is not None:
        env["REDISCLI_AUTH"] = deployment.password
    if deployment.tls is not None:
        args += ["--tls", "--cacert", str(deployment.tls.ca_cert), "--cert", str(deployment.tls.cert),
                 "--key", str(deployment.tls.key)]
    return args, env


def _create(deployment: LocalRedis, deadline: float) -> None:
    args, env = redis_cli_args(deployment)
    command = [*args, "--cluster", "create", *deployment.endpoints, "--cluster-replicas", "0", "--cluster-yes"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                              timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        raise RedisClusterError(f"redis-cli --cluster create did not finish in time:\n{e.stdout}") from e
    if done.returncode != 0:
        raise RedisClusterError(f"redis-cli --cluster create failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def _cluster_view(deployment: LocalRedis, port: int) -> tuple[dict[str, str], list[tuple[int, int, int]]]:
    with contextlib.closing(deployment.node_client(port, socket_timeout=5)) as client:
        info = client.execute_command("CLUSTER INFO")
        if isinstance(info, bytes):
            info = info.decode()
        if isinstance(info, str):
            info = dict(line.split(":", 1) for line in info.split() if ":" in line)
        info = {str(k): str(v) for k, v in info.items()}
    return info, deployment.read_slot_ranges(port)


def wait_cluster_ok(deployment: LocalRedis, deadline: float) -> list[tuple[int, int, int]]:
    """Polls every node until each says cluster_state:ok, 16384 slots assigned, every node known, and all
    report the same slot map covering every slot on live masters; returns that map."""
    import redis

    want_nodes = str(len(deployment.nodes))
    last = "no answer yet"
    while True:
        try:
            views = {port: _cluster_view(deployment, port) for port in deployment.ports}
            maps = {tuple(slots) for _, slots in views.values()}
            bad = {port: info.get("cluster_state") for port, (info, _) in views.items()
                   if info.get("cluster_state") != "ok" or info.get("cluster_slots_assigned") != str(NUM_SLOTS)
                   or info.get("cluster_known_nodes") != want_nodes}
            if not bad and len(maps) == 1:
                (slot_map,) = maps
                covered = sum(last_slot - first + 1 for first, last_slot, _ in slot_map)
                if covered == NUM_SLOTS and {port for _, _, port in slot_map} == set(deployment.ports):
                    return list(slot_map)
            last = f"not ok: {bad}; {len(maps)} distinct slot maps"
        except redis.exceptions.RedisError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise RedisClusterError(f"the cluster on {deployment.seeds} did not agree in time ({last})")
        time.sleep(0.05)
