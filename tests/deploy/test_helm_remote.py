"""helm/kvtierd's T3 values (remote.*, config.policy.t1_to_t3 / t2_to_t3): the config's [remote]
section only with remote.endpoints, the store's credentials and TLS files mounted from Secrets and
referenced as files (never a value in the ConfigMap or the pod spec), and values.schema.json refusing
bad store values. pytest assertions over `helm template` output, with test_helm_chart's machinery
(its parametrized tests also lint, kubernetes-validate and load ci/remote-values.yaml and
ci/remote-tls-values.yaml).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_helm_chart import (
    CHART,
    FULLNAME,
    RELEASE,
    daemon_container,
    find,
    helm_run,
    install,
    load_rendered,
    mounts,
    notes,
    one,
    pod_spec,
    render,
    render_ci,
    template,
    toml_text,
)

from kvtierd.server.daemon_config import KEY_TYPES
from kvtierd.t3.remote_config import parse_endpoints
from kvtierd.units import parse_bytes

REMOTE_CI = CHART / "ci" / "remote-values.yaml"
REMOTE_TLS_CI = CHART / "ci" / "remote-tls-values.yaml"
SEEDS = "redis-0.redis:6379,redis-1.redis:6379"


@pytest.fixture(scope="session")
def helm() -> str:
    return install("install-helm")


@pytest.fixture(scope="session")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart, as test_helm_chart renders it."""
    copy = tmp_path_factory.mktemp("chart") / "kvtierd"
    shutil.copytree(CHART, copy)
    return copy


def toml(docs: list[dict]) -> dict:
    return tomllib.loads(toml_text(docs))


def volumes(spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in spec["volumes"]}


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def mounted_file(spec: dict, path: str) -> tuple[dict, str]:
    """The Secret volume and the key behind a file path of the daemon container (its mount + an item's path)."""
    container = daemon_container(spec)
    for mount_path, name in mounts(container).items():
        if path.startswith(mount_path + "/"):
            secret = volumes(spec)[name]["secret"]
            relative = path[len(mount_path) + 1:]
            keys = [item["key"] for item in secret.get("items", []) if item["path"] == relative]
            assert len(keys) == 1, f"{path}: no item {relative!r} in volume {name}"
            return secret, keys[0]
    raise AssertionError(f"{path} is under no mount of the daemon container")


# ---- no store, no T3


@pytest.mark.parametrize("args", [
    [],
    ["--set", "remote.mode=cluster", "--set", "remote.codec=fp8", "--set", "config.policy.t2_to_t3=write_through"],
])
def test_no_remote_section_without_endpoints(helm: str, chart: Path, args: list[str]) -> None:
    """Without remote.endpoints the TOML has no [remote] and no T3 edge, and is the TOML of a chart
    without T3 values at all (so an upgrade does not roll the pods); no store volume or env either."""
    docs = render(helm, chart, *args)
    table = toml(docs)
    assert "remote" not in table
    assert not {"t1_to_t3", "t2_to_t3"} & set(table["policy"])
    assert "[remote]" not in toml_text(docs)
    assert toml_text(docs) == toml_text(render(helm, chart))
    spec = pod_spec(docs)
    assert not {"remote-auth", "remote-tls"} & set(volumes(spec))
    assert "KVTIERD_REMOTE_USERNAME" not in env(daemon_container(spec))


@pytest.mark.parametrize("endpoints", [
    ["--set", "remote.endpoints={redis-0.redis:6379,redis-1.redis:6379}"],  # a list
    ["--set", "remote.endpoints=redis-0.redis:6379\\,redis-1.redis:6379"],  # a comma-separated string
    ["--set-string", "remote.endpoints= redis-0.redis:6379 \\, redis-1.redis:6379 "],  # with spaces
])
def test_endpoints_render_as_the_daemons_comma_separated_seeds(helm: str, chart: Path, endpoints: list[str]) -> None:
    table = toml(render(helm, chart, *endpoints))
    assert table["remote"]["endpoints"] == SEEDS
    assert table["policy"]["t1_to_t3"] == "write_through" and table["policy"]["t2_to_t3"] == "off"


def test_remote_values_reach_the_remote_section(helm: str, chart: Path) -> None:
    """Every remote.* value becomes its [remote] key, typed as the daemon reads it."""
    table = toml(render_ci(helm, chart, REMOTE_CI))
    values = yaml.safe_load(REMOTE_CI.read_text())
    assert table["remote"] == {
        "endpoints": ",".join(values["remote"]["endpoints"]),
        "mode": "cluster",
        "key_prefix": "kvtierd-prod",
        "codec": "fp8",
        "timeout_s": 0.25,
        "max_write_backlog_bytes": "512MiB",
        "breaker_failures": 5,
        "breaker_open_s": 2.5,
        "ttl_s": 86400,
        "probe_interval_s": 0.5,
        "tls": False,
        "password_file": "/etc/kvtierd/remote-auth/password",
    }
    assert type(table["remote"]["breaker_failures"]) is int and type(table["remote"]["ttl_s"]) is int
    assert table["policy"]["t1_to_t3"] == "on_evict" and table["policy"]["t2_to_t3"] == "write_through"


def test_defaults_of_the_remote_section(helm: str, chart: Path) -> None:
    """Endpoints alone: the spec's defaults, no AUTH (no password_file), no TLS."""
    table = toml(render(helm, chart, "--set", "remote.endpoints=redis:6379"))
    assert table["remote"] == {"endpoints": "redis:6379", "mode": "auto", "key_prefix": "kvtierd", "codec": "raw",
                               "timeout_s": 0.5, "max_write_backlog_bytes": "256MiB", "breaker_failures": 3,
                               "breaker_open_s": 5, "ttl_s": 0, "probe_interval_s": 2, "tls": False}


# ---- credentials


def test_the_password_is_a_mounted_secret_file_never_inlined(helm: str, chart: Path) -> None:
    """remote.password_file names a file of a Secret volume (key remote.passwordKey) mounted read-only;
    the username comes from the same Secret by secretKeyRef; the chart creates no Secret for the store
    and no value of the ConfigMap or of an env var is a credential."""
    docs = render_ci(helm, chart, REMOTE_CI)
    spec = pod_spec(docs)
    table = toml(docs)
    secret, key = mounted_file(spec, table["remote"]["password_file"])
    assert (secret["secretName"], key) == ("kvtierd-redis", "password")
    assert secret["defaultMode"] == 0o440
    container = daemon_container(spec)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "remote-auth")
    assert mount["readOnly"] is True
    username = env(container)["KVTIERD_REMOTE_USERNAME"]
    assert username == {"name": "KVTIERD_REMOTE_USERNAME",
                        "valueFrom": {"secretKeyRef": {"name": "kvtierd-redis", "key": "username"}}}
    assert not find(docs, "Secret")
    assert not {"password", "username"} & set(table["remote"])
    assert not any(e.get("value") for e in container["env"] if e["name"].startswith("KVTIERD_REMOTE_"))


def test_no_username_env_for_the_default_user(helm: str, chart: Path) -> None:
    spec = pod_spec(render_ci(helm, chart, REMOTE_TLS_CI))
    assert "KVTIERD_REMOTE_USERNAME" not in env(daemon_container(spec))
    assert volumes(spec)["remote-auth"]["secret"]["items"] == [{"key": "valkey-password", "path": "password"}]


def test_username_env_goes_before_extra_env(helm: str, chart: Path) -> None:
    """extraEnv still reaches the container, after the username (a later entry wins)."""
    container = daemon_container(pod_spec(render(helm, chart, "-f", str(REMOTE_CI), "--set", "extraEnv[0].name=A",
                                                 "--set", "extraEnv[0].value=b")))
    assert [e["name"] for e in container["env"]] == ["KVTIERD_REMOTE_USERNAME", "A"]


@pytest.mark.parametrize("args", [
    ["--set", "extraEnv[0].name=KVTIERD_REMOTE_PASSWORD", "--set", "extraEnv[0].value=hunter2hunter2"],
    ["--set", "extraArgs={--set,remote.password=hunter2hunter2}"],
    ["--set", "extraArgs={--set=remote.password=hunter2hunter2}"],
])
def test_a_plain_text_password_is_refused(helm: str, chart: Path, args: list[str]) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), "-f", str(REMOTE_CI), *args)
    assert proc.returncode != 0 and "use remote.existingSecret" in proc.stderr, proc.stderr


def test_a_password_from_a_secret_key_ref_in_extra_env_is_allowed(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "remote.endpoints=redis:6379", "--set",
                  "extraEnv[0].name=KVTIERD_REMOTE_PASSWORD", "--set", "extraEnv[0].valueFrom.secretKeyRef.name=s",
                  "--set", "extraEnv[0].valueFrom.secretKeyRef.key=password")
    assert "valueFrom" in env(daemon_container(pod_spec(docs)))["KVTIERD_REMOTE_PASSWORD"]


# ---- TLS


def test_tls_files_are_mounted_from_their_secret(helm: str, chart: Path) -> None:
    docs = render_ci(helm, chart, REMOTE_TLS_CI)
    remote = toml(docs)["remote"]
    assert remote["tls"] is True and remote["endpoints"] == "valkey-primary.valkey.svc:6380"
    spec = pod_spec(docs)
    for file_key, secret_key in (("tls_ca_file", "ca.crt"), ("tls_cert_file", "tls.crt"),
                                 ("tls_key_file", "tls.key")):
        secret, key = mounted_file(spec, remote[file_key])
        assert (secret["secretName"], key) == ("kvtierd-valkey-tls", secret_key), file_key
        assert secret["defaultMode"] == 0o440
    assert mounts(daemon_container(spec))["/etc/kvtierd/remote-tls"] == "remote-tls"


def test_tls_without_a_secret_uses_the_system_cas(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "remote.endpoints=store.example:6379", "--set", "remote.tls.enabled=true")
    remote = toml(docs)["remote"]
    assert remote["tls"] is True and not {"tls_ca_file", "tls_cert_file", "tls_key_file"} & set(remote)
    assert "remote-tls" not in volumes(pod_spec(docs))


def test_tls_with_a_ca_only(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "remote.endpoints=store.example:6379", "--set", "remote.tls.enabled=true",
                  "--set", "remote.tls.existingSecret=store-ca", "--set", "remote.tls.caKey=root.pem",
                  "--set", "remote.tls.certKey=", "--set", "remote.tls.keyKey=")
    remote = toml(docs)["remote"]
    assert not {"tls_cert_file", "tls_key_file"} & set(remote)
    assert mounted_file(pod_spec(docs), remote["tls_ca_file"]) == (
        {"secretName": "store-ca", "defaultMode": 0o440, "items": [{"key": "root.pem", "path": "ca.crt"}]}, "root.pem")


def test_the_sidecar_example_gets_the_store_files_too(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "-f", str(CHART / "ci" / "sidecar-values.yaml"), "-f", str(REMOTE_TLS_CI))
    assert one(docs, "Deployment")
    remote = toml(docs)["remote"]
    spec = pod_spec(docs)
    for key in ("password_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        mounted_file(spec, remote[key])


def test_notes_name_the_store_only_with_endpoints(helm: str, chart: Path, tmp_path: Path) -> None:
    text = notes(helm, chart, tmp_path, "-f", str(REMOTE_CI))
    assert "T3 (shared tier): the store at redis-cluster-0" in text and "Secret kvtierd-redis" in text
    assert "allkeys-lru" in text and "cluster-require-full-coverage no" in text
    assert "T3" not in notes(helm, chart, tmp_path)


# ---- refusals


@pytest.mark.parametrize("args, message", [
    (["--set", "remote.existingSecret=kvtierd-redis"], "set remote.endpoints too"),
    (["--set", "remote.tls.enabled=true"], "set remote.endpoints too"),
    (["--set", "remote.endpoints=a:1", "--set", "remote.tls.existingSecret=t"], "goes with remote.tls.enabled=true"),
    (["--set", "remote.endpoints=a:1", "--set", "remote.tls.enabled=true", "--set", "remote.tls.existingSecret=t",
      "--set", "remote.tls.keyKey="], "go together"),
    (["--set", "remote.endpoints=a:1", "--set", "remote.tls.enabled=true", "--set", "remote.tls.existingSecret=t",
      "--set", "remote.tls.caKey=", "--set", "remote.tls.certKey=", "--set", "remote.tls.keyKey="],
     "the files to mount"),
])
def test_inconsistent_remote_values_are_refused(helm: str, chart: Path, args: list[str], message: str) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, key", [
    (["--set", "remote.endpoints=redis"], "remote.endpoints"),  # no port
    (["--set", "remote.endpoints=redis:70000"], "remote.endpoints"),
    (["--set", "remote.endpoints=6379"], "remote.endpoints"),  # a number, not a list or a string
    (["--set", "remote.endpoints={redis:6379,redis}"], "remote.endpoints"),
    (["--set", "remote.endpoints=redis:6379;other:6379"], "remote.endpoints"),
    (["--set", "remote.endpoints.host=redis"], "remote.endpoints"),
    (["--set", "remote.timeoutS=-1"], "remote.timeoutS"),
    (["--set", "remote.timeoutS=0"], "remote.timeoutS"),
    (["--set", "remote.ttlS=-5"], "remote.ttlS"),
    (["--set", "remote.mode=sharded"], "remote.mode"),
    (["--set", "remote.codec=zstd"], "remote.codec"),
    (["--set", "remote.keyPrefix=a:b"], "remote.keyPrefix"),
    (["--set", "remote.breaker.failures=0"], "remote.breaker.failures"),
    (["--set", "remote.breaker.openS=-1"], "remote.breaker.openS"),
    (["--set-string", "remote.maxWriteBacklogBytes=lots"], "remote.maxWriteBacklogBytes"),
    (["--set", "remote.password=hunter2hunter2"], "password"),  # not a value of the chart
    (["--set", "remote.tls.insecure=true"], "insecure"),
    (["--set", "config.remote.password_file=/tmp/p"], "remote"),  # [remote] is the chart's, from remote.*
    (["--set", "config.remote.endpoints=redis:6379"], "remote"),
    (["--set", "config.policy.t1_to_t3=sometimes"], "config.policy.t1_to_t3"),
    (["--set", "config.policy.t2_to_t3=false"], "config.policy.t2_to_t3"),  # YAML's unquoted off
    (["--set", "config.policy.t2_to_t3=on_evict"], "config.policy.t2_to_t3"),  # write_through or off only
])
def test_schema_refuses_bad_remote_values(helm: str, chart: Path, args: list[str], key: str) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), *args)
    assert proc.returncode != 0
    assert "don't meet the specifications of the schema" in proc.stderr and key in proc.stderr, proc.stderr


def test_schema_accepts_ipv6_and_whole_number_remote_values(helm: str, chart: Path) -> None:
    table = toml(render(helm, chart, "--set", "remote.endpoints={[fd00::1]:6379,10.0.0.2:6380}",
                        "--set", "remote.timeoutS=2", "--set", "remote.maxWriteBacklogBytes=1073741824"))
    assert table["remote"]["endpoints"] == "[fd00::1]:6379,10.0.0.2:6380"
    assert table["remote"]["timeout_s"] == 2 and table["remote"]["max_write_backlog_bytes"] == 1 << 30


def test_no_credential_in_any_rendered_value(helm: str, chart: Path) -> None:
    """The whole manifest of both T3 scenarios: Secrets are referenced by name and key, never read."""
    for ci in (REMOTE_CI, REMOTE_TLS_CI):
        manifest = template(helm, chart, "-f", str(ci))
        assert "stringData" not in manifest and "kind: Secret\n" not in manifest
        config_map = one(render_ci(helm, chart, ci), "ConfigMap", FULLNAME)
        assert set(config_map["data"]) == {"kvtierd.toml"}
        assert "password =" not in config_map["data"]["kvtierd.toml"]


# ---- the daemon reads what the chart renders


@pytest.mark.parametrize("ci", [REMOTE_CI, REMOTE_TLS_CI], ids=lambda path: path.name)
def test_the_daemon_loads_the_remote_section(helm: str, chart: Path, ci: Path, tmp_path: Path) -> None:
    config = load_rendered(render_ci(helm, chart, ci), tmp_path)
    table = toml(render_ci(helm, chart, ci))["remote"]
    for key, value in table.items():
        expected = parse_bytes(value) if key.endswith("_bytes") else parse_endpoints(value) if key == "endpoints" \
            else value
        assert getattr(config.remote, key) == expected, key
    assert config.remote.password_file == "/etc/kvtierd/remote-auth/password"


def kubelet_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's env as the kubelet sets it: values, and secretKeyRefs read from `secrets`."""
    found = {}
    for entry in container.get("env", []):
        if "value" in entry:
            found[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            found[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return found


def kubelet_secret_files(spec: dict, secrets: dict[str, dict[str, str]], root: Path) -> None:
    """The daemon container's Secret volumes written under `root` + their mount paths, item by item."""
    by_name = volumes(spec)
    for mount in daemon_container(spec)["volumeMounts"]:
        secret = by_name[mount["name"]].get("secret")
        if secret is None:
            continue
        directory = root / mount["mountPath"].lstrip("/")
        directory.mkdir(parents=True)
        for item in secret["items"]:
            (directory / item["path"]).write_text(secrets[secret["secretName"]][item["key"]])


@pytest.mark.cluster
@pytest.mark.parametrize("ci", [REMOTE_CI, REMOTE_TLS_CI], ids=lambda path: path.name)
def test_the_rendered_remote_section_reaches_a_real_store(helm: str, chart: Path, ci: Path, tmp_path: Path) -> None:
    """`kvtierd serve --config` on the chart's TOML against a local store set up as the scenario says
    (remote-values: a 3-master cluster with an ACL user, the default user off; remote-tls-values: one
    TLS redis-server with a requirepass password): with the pod's env and its Secret volumes as the
    kubelet makes them (files under tmp_path; the seeds, the pod's paths and small tiers set by flags),
    the daemon authenticates, T3 takes the blocks written through, and the password is never logged."""
    from kvtierd.client import KvtierClient
    from kvtierd.launch.daemon_process import DaemonProcess, wait_until
    from kvtierd.layout import Layout
    from tests.t3.redis_cluster import running_cluster, running_single

    docs = render_ci(helm, chart, ci)
    spec = pod_spec(docs)
    password = "chart-test-password-0123"
    with contextlib.ExitStack() as stack:
        if ci == REMOTE_CI:
            store = stack.enter_context(running_cluster(tmp_path / "redis", username="kvtierd", password=password))
            secrets = {"kvtierd-redis": {"username": "kvtierd", "password": password}}
        else:
            store = stack.enter_context(running_single(tmp_path / "redis", password=password,
                                                       tls_dir=tmp_path / "redis-tls"))
            secrets = {"kvtierd-valkey": {"valkey-password": password},
                       "kvtierd-valkey-tls": {"ca.crt": store.tls.ca_cert.read_text(),
                                              "tls.crt": store.tls.cert.read_text(),
                                              "tls.key": store.tls.key.read_text()}}
        kubelet_secret_files(spec, secrets, tmp_path / "pod")
        path = tmp_path / "kvtierd.toml"
        path.write_text(toml_text(docs).replace('"/etc/kvtierd/', f'"{tmp_path}/pod/etc/kvtierd/'))
        args = ["--config", str(path), "--socket", str(tmp_path / "kvtierd.sock"), "--ssd-dir", str(tmp_path / "ssd"),
                "--metrics-port", "0", "--health-tcp", "127.0.0.1:0", "--t0-bytes", "4MiB", "--host-bytes", "8MiB",
                "--ssd-bytes", "16MiB", "--set", f"remote.endpoints={store.seeds}",
                "--set", "policy.t0_to_t1=write_through", "--set", "policy.t1_to_t3=write_through"]
        daemon = stack.enter_context(DaemonProcess(args, env=kubelet_env(daemon_container(spec), secrets)))
        client = stack.enter_context(KvtierClient(daemon.address))
        layout = Layout("chart-model", 2, 2, 16, 4)
        session = client.attach(layout)
        tokens = list(range(7, 7 + 4 * layout.block_size))
        hashes = session.namespace.hash_blocks(tokens)
        acquired = session.acquire("r", hashes, token_ids=tokens)
        session.commit("r", acquired.block_ids, hashes, tokens, None)
        session.release("r")
        assert wait_until(lambda: scrape(daemon).get("kvtierd_t3_written_bytes_total", 0) > 0, timeout_s=30), \
            scrape(daemon)
        metrics = scrape(daemon)
        assert metrics["kvtierd_t3_errors_total"] == 0 and metrics["kvtierd_t3_breaker_open"] == 0
        assert password not in daemon.output()


def scrape(daemon) -> dict[str, float]:
    """Sample name -> the sum of its values, from the daemon's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_every_t3_key_the_chart_renders_is_a_daemon_key(helm: str, chart: Path) -> None:
    rendered = toml(render(helm, chart, "-f", str(REMOTE_CI), "-f", str(REMOTE_TLS_CI)))
    keys = {f"remote.{key}" for key in rendered["remote"]} | {"policy.t1_to_t3", "policy.t2_to_t3"}
    keys.add("remote.username")  # KVTIERD_REMOTE_USERNAME
    assert keys <= set(KEY_TYPES), sorted(keys - set(KEY_TYPES))


def test_schema_describes_the_remote_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["remote"]
    assert schema["additionalProperties"] is False and schema["properties"]["tls"]["additionalProperties"] is False
    values = yaml.safe_load((CHART / "values.yaml").read_text())["remote"]
    assert set(values) == set(schema["properties"]) and values["endpoints"] == []
    assert values["tls"]["enabled"] is False and values["existingSecret"] == ""
