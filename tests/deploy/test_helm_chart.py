"""helm/kvtierd, the Dockerfile and their tools: `helm lint --strict`, `helm template` of every
ci/*-values.yaml validated by kubernetes-validate against Kubernetes 1.30, assertions on the
rendered objects, the rendered kvtierd.toml loaded by kvtierd.server.config_loader, values.schema.json
refusing bad values, and hadolint on the Dockerfile.

helm (v3.18) and hadolint come from scripts/install-helm and scripts/install-hadolint into .tools/;
a failed install fails the tests (it is not a skip). helm-unittest cannot be installed, so these
are pytest assertions over `helm template` output (shared/TOOLING.md).

The chart is rendered from a copy in a temporary directory. files/grafana-dashboard.json and
files/prometheus-rules.yaml belong to the monitoring work: when one is missing from the checkout,
the copy (never the checkout) gets a minimal placeholder so the templates that ship it can be tested.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvtierd.errors import InvalidArgument
from kvtierd.server.config_loader import load_config
from kvtierd.server.daemon_config import KEY_TYPES, DaemonConfig
from kvtierd.units import parse_bytes

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvtierd"
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
CI_IDS = [path.name for path in CI_FILES]  # "gpu-values.yaml", not "gpu": conftest skips the keyword gpu
RELEASE = "r"
FULLNAME = "r-kvtierd"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # kubernetes-validate only warns on these
T3_POLICY_KEYS = {"policy.t1_to_t3", "policy.t2_to_t3"}  # checked against the daemon by test_helm_remote.py
PLACEHOLDERS = {  # for the copy only, where the monitoring files are not in the checkout yet
    "files/grafana-dashboard.json": json.dumps({"title": "kvtierd (placeholder)", "uid": "kvtierd", "panels": []}),
    "files/prometheus-rules.yaml": "groups:\n  - name: kvtierd.placeholder\n    rules:\n"
                                   "      - alert: KvtierdDown\n        expr: up{job=\"kvtierd\"} == 0\n",
}


def install(script: str) -> str:
    proc = subprocess.run([str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"scripts/{script} failed:\n{proc.stdout}\n{proc.stderr}"
    path = proc.stdout.strip().splitlines()[-1]
    assert Path(path).is_file(), f"scripts/{script} printed {path!r}, not a file"
    return path


@pytest.fixture(scope="session")
def helm() -> str:
    return install("install-helm")


@pytest.fixture(scope="session")
def hadolint() -> str:
    return install("install-hadolint")


@pytest.fixture(scope="session")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("chart") / "kvtierd"
    shutil.copytree(CHART, copy)
    for name, text in PLACEHOLDERS.items():
        if not (copy / name).exists():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_text(text)
    return copy


def helm_run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def template(helm: str, chart: Path, *args: str) -> str:
    proc = helm_run(helm, "template", RELEASE, str(chart), "--namespace", "kv", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def objects(manifest: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


_renders: dict[tuple[str, ...], list[dict]] = {}


def render(helm: str, chart: Path, *args: str) -> list[dict]:
    key = (str(chart), *args)
    if key not in _renders:
        _renders[key] = objects(template(helm, chart, *args))
    return _renders[key]


def render_ci(helm: str, chart: Path, ci: Path) -> list[dict]:
    return render(helm, chart, "-f", str(ci))


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def ci_values(ci: Path) -> dict:
    return yaml.safe_load(ci.read_text()) or {}


def dig(values: dict, dotted: str, default: object = None) -> object:
    node: object = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def pod_spec(docs: list[dict]) -> dict:
    """The pod template of the DaemonSet, else of the sidecar example."""
    workloads = find(docs, "DaemonSet") or find(docs, "Deployment")
    assert len(workloads) == 1, [d["kind"] for d in docs]
    return workloads[0]["spec"]["template"]["spec"]


def daemon_container(spec: dict) -> dict:
    containers = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "kvtierd"]
    assert len(containers) == 1
    return containers[0]


def toml_text(docs: list[dict]) -> str:
    return one(docs, "ConfigMap", FULLNAME)["data"]["kvtierd.toml"]


def load_rendered(docs: list[dict], tmp_path: Path) -> DaemonConfig:
    path = tmp_path / "kvtierd.toml"
    path.write_text(toml_text(docs))
    return load_config(str(path), environ={})  # the daemon's own loader: unknown keys are errors


def mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


# ---- tools


def test_helm_is_3_18(helm: str) -> None:
    proc = helm_run(helm, "version", "--short")
    assert proc.returncode == 0 and proc.stdout.startswith("v3.18"), proc.stdout + proc.stderr


def test_install_helm_is_idempotent(helm: str) -> None:
    assert install("install-helm") == helm


# ---- lint and Kubernetes schemas


def lint_problems(helm: str, chart: Path, *args: str) -> str:
    """`helm lint --strict`'s complaints, "" when clean. Lint reports a template's `fail` as
    "[INFO] Fail: ..." and exits 0, so those count as complaints here too."""
    proc = helm_run(helm, "lint", "--strict", str(chart), *args)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 or "0 chart(s) failed" not in proc.stdout or "Fail:" in output:
        return output
    return ""


def test_lint_strict_chart(helm: str, chart: Path) -> None:
    assert lint_problems(helm, chart) == ""


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_lint_strict_ci_values(helm: str, chart: Path, ci: Path) -> None:
    assert lint_problems(helm, chart, "-f", str(ci)) == ""


def test_lint_catches_a_broken_render(helm: str, chart: Path) -> None:
    assert "tcp.enabled needs tls.enabled" in lint_problems(helm, chart, "--set", "tcp.enabled=true")
    assert "schema" in lint_problems(helm, chart, "--set", "config.pool.t0_bytes=-1")


def kubernetes_validate(manifest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION,
                           "-"], input=manifest, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_rendered_objects_validate_against_kubernetes(helm: str, chart: Path, ci: Path) -> None:
    manifest = template(helm, chart, "-f", str(ci))
    proc = kubernetes_validate(manifest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    for doc in objects(manifest):
        if doc["kind"] not in CRD_KINDS:
            name = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
            assert f"passed for resource {name}" in output, f"{name} not validated:\n{output}"


def test_kubernetes_validate_refuses_an_unknown_field(helm: str, chart: Path) -> None:
    docs = render(helm, chart)
    broken = json.loads(json.dumps(one(docs, "DaemonSet")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 8081}
    proc = kubernetes_validate(yaml.safe_dump(broken))
    assert proc.returncode != 0 and "grpcc" in proc.stdout + proc.stderr


# ---- the daemon's configuration


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_rendered_toml_loads_in_the_daemon(helm: str, chart: Path, ci: Path, tmp_path: Path) -> None:
    docs = render_ci(helm, chart, ci)
    rendered = tomllib.loads(toml_text(docs))
    values = ci_values(ci)
    config = load_rendered(docs, tmp_path)
    spec = pod_spec(docs)
    container = daemon_container(spec)
    paths = mounts(container)

    # The keys the chart owns agree with the pod.
    socket_dir = dig(values, "socket.dir", "/run/kvtierd")
    assert config.server.socket == f"{socket_dir}/kvtierd.sock"
    assert paths[socket_dir] == "socket"
    ssd_type = dig(values, "ssd.type", "hostPath")
    if ssd_type == "none":
        assert config.ssd.directory == ""
        assert "ssd" not in paths.values()
    else:
        assert paths[config.ssd.directory] == "ssd"
    host, _, port = config.server.health_tcp.rpartition(":")
    assert host == "0.0.0.0" and int(port) == dig(values, "probes.healthPort", 8081)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == int(port)
    if dig(values, "metrics.enabled", True):
        assert (config.server.metrics_host, config.server.metrics_port) == ("0.0.0.0", ports["metrics"])
    else:
        assert config.server.metrics_port == -1 and "metrics" not in ports
    if dig(values, "tcp.enabled", False):
        assert config.server.tcp == f"0.0.0.0:{ports['grpc']}"
    else:
        assert config.server.tcp == "" and "grpc" not in ports
    assert config.pool.device == ("cuda" if dig(values, "gpu.enabled") else "cpu")
    for key in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
        path = getattr(config.server, key)
        if path:
            assert any(path.startswith(mount + "/") for mount in paths), f"server.{key} {path} is not mounted"
    for key in ("password_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = rendered.get("remote", {}).get(key)
        if path:
            assert any(path.startswith(mount + "/") for mount in paths), f"remote.{key} {path} is not mounted"
    # Whatever the values say about the daemon's own keys gets through.
    for section, table in (values.get("config") or {}).items():
        if section == "quotas":
            for tenant, quota in table.items():
                for key, value in quota.items():
                    assert getattr(config.quotas[tenant], key) == parse_bytes(value)
        elif isinstance(table, dict):
            for key, value in table.items():
                got = getattr(getattr(config, section), key)
                assert got == (parse_bytes(value) if key.endswith("_bytes") else value), f"{section}.{key}"
        else:
            assert getattr(config, section) == table


def test_rendered_config_starts_a_daemon_whose_probes_pass(helm: str, chart: Path, tmp_path: Path) -> None:
    """`kvtierd serve --config` on the chart's TOML (the pod's paths and ports moved into tmp_path by
    flags, which override the file): the health listener answers SERVING for both services the probes
    ask for, and SIGTERM exits 0 within the pod's grace period."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtierd.launch.daemon_process import DaemonProcess

    docs = render(helm, chart)
    path = tmp_path / "kvtierd.toml"
    path.write_text(toml_text(docs))
    container = daemon_container(pod_spec(docs))
    # The pod's SSD budget is sized for a node's disk: this machine's may hold less, and a daemon
    # refuses at start an SSD directory without room for its budget.
    args = ["--config", str(path), "--socket", str(tmp_path / "kvtierd.sock"), "--ssd-dir", str(tmp_path / "ssd"),
            "--ssd-bytes", "1GiB", "--metrics-port", "0", "--health-tcp", "127.0.0.1:0"]
    with DaemonProcess(args) as daemon:
        assert daemon.health_address
        with grpc.insecure_channel(daemon.health_address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                request = health_pb2.HealthCheckRequest(service=container[probe]["grpc"]["service"])
                assert check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING, probe
        assert daemon.stop(timeout_s=pod_spec(docs)["terminationGracePeriodSeconds"]) == 0


def test_config_values_reach_the_daemon(helm: str, chart: Path, tmp_path: Path) -> None:
    config = load_rendered(render_ci(helm, chart, CHART / "ci" / "config-values.yaml"), tmp_path)
    assert config.server.lease_s == 12.5 and config.server.grace_s == 45
    assert config.policy.recompute_s_per_token == 0.0005
    assert config.quotas["*"].t0_bytes == 256 << 20 and config.quotas["acme"].t2_bytes == 100 << 30
    assert config.log_level == "debug" and config.host.codec == "fp8" and config.ssd.o_direct is False


def test_whole_numbers_render_as_toml_integers(helm: str, chart: Path) -> None:
    # Helm reads YAML numbers as floats; toToml would print 9464.0, which the daemon refuses for an int key.
    table = tomllib.loads(toml_text(render(helm, chart)))
    assert type(table["server"]["metrics_port"]) is int and table["server"]["metrics_port"] == 9464
    assert type(table["pool"]["max_layouts"]) is int


def test_the_daemon_loader_refuses_an_unknown_key(helm: str, chart: Path, tmp_path: Path) -> None:
    # What the test above relies on: a key kvtierd does not know fails the load.
    path = tmp_path / "kvtierd.toml"
    path.write_text(toml_text(render(helm, chart)).replace("[pool]\n", "[pool]\nt0_byte = 1\n"))
    with pytest.raises(InvalidArgument, match="unknown config key 'pool.t0_byte'"):
        load_config(str(path), environ={})


def test_config_change_rolls_the_pods(helm: str, chart: Path) -> None:
    def checksum(*args: str) -> str:
        return one(render(helm, chart, *args), "DaemonSet")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"]
    assert checksum() != checksum("--set", "config.host.capacity_bytes=8GiB")


# ---- the DaemonSet


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_pods_run_non_root_with_a_read_only_root(helm: str, chart: Path, ci: Path) -> None:
    spec = pod_spec(render_ci(helm, chart, ci))
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    for container in spec.get("initContainers", []) + spec["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security.get("privileged", False) is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        if container["name"] == "volume-permissions":  # root, to chown the hostPath directories, and only that
            assert security["capabilities"]["add"] == ["CHOWN"]
        else:
            assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
            assert "add" not in security["capabilities"]
    # Everything the daemon writes is a volume: the socket dir, the SSD dir, /tmp.
    config_paths = mounts(daemon_container(spec))
    assert config_paths["/tmp"] == "tmp"
    assert {v["name"]: v for v in spec["volumes"]}["tmp"]["emptyDir"] is not None


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_probes_are_grpc_on_the_health_port(helm: str, chart: Path, ci: Path) -> None:
    docs = render_ci(helm, chart, ci)
    container = daemon_container(pod_spec(docs))
    health_port = int(tomllib.loads(toml_text(docs))["server"]["health_tcp"].rpartition(":")[2])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert container[probe]["grpc"]["port"] == health_port
    assert container["livenessProbe"]["grpc"]["service"] == ""
    assert container["readinessProbe"]["grpc"]["service"] == "kvtierd.v1.KvTier"


def test_probes_follow_the_health_port(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "probes.healthPort=9091")
    container = daemon_container(pod_spec(docs))
    assert container["readinessProbe"]["grpc"]["port"] == 9091
    assert tomllib.loads(toml_text(docs))["server"]["health_tcp"] == "0.0.0.0:9091"


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_termination_grace_exceeds_the_daemon_grace(helm: str, chart: Path, ci: Path) -> None:
    docs = render_ci(helm, chart, ci)
    grace_s = tomllib.loads(toml_text(docs))["server"]["grace_s"]
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > grace_s


def test_a_short_termination_grace_is_refused(helm: str, chart: Path) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), "--set", "terminationGracePeriodSeconds=10")
    assert proc.returncode != 0 and "must exceed config.server.grace_s" in proc.stderr


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_host_ipc_and_the_nodes_shm_only_when_enabled(helm: str, chart: Path, ci: Path) -> None:
    values = ci_values(ci)
    spec = pod_spec(render_ci(helm, chart, ci))
    assert spec.get("hostIPC", False) is bool(values.get("hostIPC", False))
    volumes = {v["name"]: v for v in spec["volumes"]}
    if dig(values, "shm.hostPath", False):
        assert volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    else:
        assert "hostPath" not in volumes.get("shm", {})
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"  # the runtime's 64 MiB /dev/shm is too small


def test_host_ipc_is_off_by_default(helm: str, chart: Path) -> None:
    assert "hostIPC" not in pod_spec(render(helm, chart))
    assert pod_spec(render(helm, chart, "--set", "hostIPC=true"))["hostIPC"] is True


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_the_sockets_group_and_mode_reach_the_config_and_the_pod(helm: str, chart: Path, ci: Path) -> None:
    """server.socket_group / socket_mode from socket.*; a gid other than the pod's own group is
    among the pod's supplementalGroups (the daemon must be a member to give the sockets to it)."""
    values = ci_values(ci)
    docs = render_ci(helm, chart, ci)
    server = tomllib.loads(toml_text(docs))["server"]
    gid = dig(values, "socket.groupId", 10001)
    assert server["socket_group"] == str(gid) and server["socket_mode"] == dig(values, "socket.mode", "0660")
    groups = pod_spec(docs)["securityContext"].get("supplementalGroups", [])
    assert (gid in groups) is (gid != 10001)


def test_without_a_socket_group_the_socket_is_the_daemons_alone(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "socket.groupId=null", "--set", "socket.mode=0600")
    server = tomllib.loads(toml_text(docs))["server"]
    assert "socket_group" not in server and server["socket_mode"] == "0600"
    assert "supplementalGroups" not in pod_spec(docs)["securityContext"]


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_gpu_limits_only_with_gpu_values(helm: str, chart: Path, ci: Path) -> None:
    docs = render_ci(helm, chart, ci)
    gpu = bool(dig(ci_values(ci), "gpu.enabled", False))
    spec = pod_spec(docs)
    limits = [c.get("resources", {}).get("limits", {}) for c in spec.get("initContainers", []) + spec["containers"]]
    assert any("nvidia.com/gpu" in lim for lim in limits) is gpu
    if gpu:
        assert daemon_container(spec)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert daemon_container(spec)["resources"]["limits"]["memory"] == "8Gi"  # merged, not replaced
    assert (tomllib.loads(toml_text(docs))["pool"]["device"] == "cuda") is gpu


def test_gpu_without_a_resource_limit(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "gpu.enabled=true", "--set", "gpu.count=0", "--set", "gpu.device=cuda:1")
    assert "nvidia.com/gpu" not in json.dumps(pod_spec(docs))
    assert tomllib.loads(toml_text(docs))["pool"]["device"] == "cuda:1"


def test_socket_directory_is_a_node_directory(helm: str, chart: Path) -> None:
    spec = pod_spec(render(helm, chart))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket"]["hostPath"] == {"path": "/run/kvtierd", "type": "DirectoryOrCreate"}
    assert volumes["ssd"]["hostPath"] == {"path": "/var/lib/kvtierd", "type": "DirectoryOrCreate"}
    init = {c["name"]: c for c in spec["initContainers"]}["volume-permissions"]
    assert {"/run/kvtierd", "/var/lib/kvtierd"} <= set(init["command"])
    assert "10001:10001" in init["command"][2]


def test_local_persistent_volume_for_the_ssd_tier(helm: str, chart: Path) -> None:
    docs = render_ci(helm, chart, CHART / "ci" / "local-pv-values.yaml")
    pv, pvc = one(docs, "PersistentVolume"), one(docs, "PersistentVolumeClaim")
    assert pv["spec"]["local"]["path"] == "/mnt/disks/kvtierd"
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["gpu-node-1"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["claimRef"]["name"] == pvc["metadata"]["name"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["ssd"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert not find(render(helm, chart), "PersistentVolumeClaim")


def test_tls_and_tokens_secrets_are_mounted(helm: str, chart: Path) -> None:
    docs = render_ci(helm, chart, CHART / "ci" / "tls-tokens-values.yaml")
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kvtierd-tls"
    secret = one(docs, "Secret")
    assert volumes["tokens"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["stringData"]["tokens"].split("\n")[:2] == ["acme acme-0123456789abcdef",
                                                             "globex globex-0123456789abcdef"]
    assert mounts(daemon_container(spec))["/etc/kvtierd/tls"] == "tls"
    server = tomllib.loads(toml_text(docs))["server"]
    assert server["tls_client_ca"] == "/etc/kvtierd/tls/ca.crt" and "insecure_tcp" not in server
    assert not find(render(helm, chart), "Secret")


@pytest.mark.parametrize("args, message", [
    (["--set", "tcp.enabled=true"], "tcp.enabled needs tls.enabled"),
    (["--set", "tls.enabled=true", "--set", "tcp.enabled=true"], "tls.enabled needs tls.secretName"),
    (["--set", "tokens.enabled=true"], "tokens.enabled needs tokens.existingSecret"),
    (["--set", "shm.hostPath=true"], "choose one"),
])
def test_inconsistent_values_are_refused(helm: str, chart: Path, args: list[str], message: str) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), *args)
    assert proc.returncode != 0 and message in proc.stderr


# ---- Service, PodDisruptionBudget, monitoring


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_headless_service_and_pdb_select_the_daemons(helm: str, chart: Path) -> None:
    docs = render(helm, chart)
    pod_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert labels_match(service["spec"]["selector"], pod_labels)
    assert {p["name"] for p in service["spec"]["ports"]} == {"metrics", "health"}
    pdb = one(docs, "PodDisruptionBudget")
    assert labels_match(pdb["spec"]["selector"]["matchLabels"], pod_labels) and pdb["spec"]["maxUnavailable"] == 1
    tls_docs = render_ci(helm, chart, CHART / "ci" / "tls-tokens-values.yaml")
    assert "grpc" in {p["name"] for p in one(tls_docs, "Service")["spec"]["ports"]}


@pytest.mark.parametrize("ci", CI_FILES, ids=CI_IDS)
def test_monitoring_objects_only_when_enabled(helm: str, chart: Path, ci: Path) -> None:
    docs = render_ci(helm, chart, ci)
    values = ci_values(ci)
    assert len(find(docs, "ServiceMonitor")) == int(bool(dig(values, "serviceMonitor.enabled")))
    assert len(find(docs, "PrometheusRule")) == int(bool(dig(values, "prometheusRule.enabled")))
    assert len(find(docs, "ConfigMap", f"{FULLNAME}-dashboard")) == int(bool(dig(values, "dashboards.enabled")))


def test_monitoring_objects(helm: str, chart: Path) -> None:
    docs = render_ci(helm, chart, CHART / "ci" / "monitoring-values.yaml")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = one(docs, "Service")
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load((chart / "files" / "prometheus-rules.yaml").read_text())
    dashboard = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvtierd.json"]) == json.loads(
        (chart / "files" / "grafana-dashboard.json").read_text())


# ---- the sidecar example


def test_sidecar_example_shares_socket_shm_and_config(helm: str, chart: Path, tmp_path: Path) -> None:
    docs = render_ci(helm, chart, CHART / "ci" / "sidecar-values.yaml")
    assert not find(docs, "DaemonSet") and not find(docs, "Service") and not find(docs, "PodDisruptionBudget")
    assert not find(render(helm, chart), "Deployment")
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    sidecar = daemon_container(spec)
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert "startupProbe" in sidecar  # the runner starts once the daemon serves
    runner = {c["name"]: c for c in spec["containers"]}["runner"]
    config = load_rendered(docs, tmp_path)
    env = {e["name"]: e["value"] for e in runner["env"]}
    assert env["KVTIERD_ADDRESS"] == f"unix://{config.server.socket}"
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = config.server.socket.rpartition("/")[0]
    assert mounts(runner)[socket_dir] == mounts(sidecar)[socket_dir] == "socket"
    assert volumes["socket"] == {"name": "socket", "emptyDir": {}}
    assert mounts(runner)["/dev/shm"] == mounts(sidecar)["/dev/shm"] == "shm"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["config"]["configMap"]["name"] == one(docs, "ConfigMap", FULLNAME)["metadata"]["name"]
    assert "hostPath" not in json.dumps(spec) and "hostIPC" not in spec  # no host privilege
    uid = spec["securityContext"]["runAsUser"]
    assert runner["securityContext"]["runAsUser"] == sidecar["securityContext"]["runAsUser"] == uid  # socket 0600


# ---- values.schema.json and values.yaml


@pytest.mark.parametrize("args, key", [
    (["--set", "config.pool.t0_bytes=-1"], "config.pool.t0_bytes"),
    (["--set-string", "config.host.capacity_bytes=-4GiB"], "config.host.capacity_bytes"),
    (["--set-string", "config.ssd.capacity_bytes=lots"], "config.ssd.capacity_bytes"),
    (["--set", "config.pool.t0_bites=1GiB"], "t0_bites"),
    (["--set", "config.server.socket=/tmp/x.sock"], "socket"),  # owned by the chart (socket.dir)
    (["--set", "config.policy.t0_to_t1=sometimes"], "config.policy.t0_to_t1"),
    (["--set", "securityContext.readOnlyRootFilesystem=false"], "securityContext.readOnlyRootFilesystem"),
    (["--set", "securityContext.runAsNonRoot=false"], "securityContext.runAsNonRoot"),
    (["--set", "probes.healthPort=70000"], "probes.healthPort"),
    (["--set", "ssd.type=nfs"], "ssd.type"),
    (["--set", "hostIPC=yes please"], "hostIPC"),
    (["--set", "gpu.count=-1"], "gpu.count"),
    (["--set", "replicas=3"], "replicas"),
])
def test_schema_refuses_bad_values(helm: str, chart: Path, args: list[str], key: str) -> None:
    proc = helm_run(helm, "template", RELEASE, str(chart), *args)
    assert proc.returncode != 0
    assert "don't meet the specifications of the schema" in proc.stderr and key in proc.stderr, proc.stderr


def test_schema_accepts_good_values(helm: str, chart: Path) -> None:
    docs = render(helm, chart, "--set", "config.pool.t0_bytes=2GiB", "--set", "config.pool.max_layouts=1",
                  "--set", "config.quotas.acme.t0_bytes=1073741824")
    table = tomllib.loads(toml_text(docs))
    assert table["pool"]["t0_bytes"] == "2GiB" and table["quotas"]["acme"]["t0_bytes"] == 1 << 30


def schema_nodes(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    for name, child in node.get("properties", {}).items():
        yield f"{path}{name}", child
        yield from schema_nodes(child, f"{path}{name}.")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        yield f"{path}*", extra
        yield from schema_nodes(extra, f"{path}*.")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[].")


SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def test_every_schema_property_has_a_description() -> None:
    missing = [path for path, node in schema_nodes(SCHEMA) if not node.get("description")]
    assert not missing, missing


def test_schema_knows_every_daemon_key_it_accepts() -> None:
    # config.* in the schema lists only keys kvtierd.server.daemon_config knows (a renamed key fails here).
    from kvtierd.server.daemon_config import QUOTA_KEYS
    config = SCHEMA["properties"]["config"]
    for section, node in config["properties"].items():
        if section == "quotas":
            assert set(node["additionalProperties"]["properties"]) == set(QUOTA_KEYS)
        elif section == "log_level":
            assert "log_level" in KEY_TYPES
        else:
            for key in node["properties"]:
                assert f"{section}.{key}" in KEY_TYPES, f"{section}.{key}"


def values_keys(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, dotted key, indent) of each mapping key in values.yaml outside lists."""
    stack: list[tuple[int, str]] = []
    in_list_indent: int | None = None
    for number, line in enumerate(path.read_text().splitlines()):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if in_list_indent is not None and indent > in_list_indent:
            continue
        in_list_indent = None
        if stripped.startswith("- "):
            in_list_indent = indent
            continue
        match = re.match(r'([\w."*-]+):', stripped)
        if not match:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([name for _, name in stack] + [match.group(1)])
        stack.append((indent, match.group(1)))
        yield number, dotted, indent


def schema_node(dotted: str) -> dict | None:
    node: dict | None = SCHEMA
    for part in dotted.split("."):
        if node is None:
            return None
        properties = node.get("properties", {})
        node = properties.get(part) if part in properties else (
            node["additionalProperties"] if isinstance(node.get("additionalProperties"), dict) else None)
    return node


def test_every_values_key_is_commented_and_in_the_schema() -> None:
    path = CHART / "values.yaml"
    lines = path.read_text().splitlines()
    uncommented, unknown = [], []
    for number, dotted, _ in values_keys(path):
        parts = dotted.split(".")
        ancestors = [schema_node(".".join(parts[:i])) for i in range(1, len(parts))]
        if any(node is not None and "properties" not in node and not isinstance(node.get("additionalProperties"), dict)
               for node in ancestors):
            continue  # inside a free-form Kubernetes object (resources, updateStrategy...): described by its ancestor
        if schema_node(dotted) is None:
            unknown.append(dotted)
        previous = next((line.strip() for line in reversed(lines[:number]) if line.strip()), "")
        if not previous.startswith("#"):
            uncommented.append(dotted)
    assert not unknown, f"values.yaml keys missing from values.schema.json: {unknown}"
    assert not uncommented, f"values.yaml keys without a comment: {uncommented}"


def test_values_yaml_validates_and_defaults_are_safe() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["hostIPC"] is False and values["shm"]["hostPath"] is False and values["gpu"]["enabled"] is False
    assert values["serviceMonitor"]["enabled"] is False and values["prometheusRule"]["enabled"] is False
    assert values["dashboards"]["enabled"] is False and values["sidecarExample"]["enabled"] is False
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart_meta["apiVersion"] == "v2" and chart_meta["appVersion"] == pyproject["project"]["version"]


# ---- NOTES.txt


def notes(helm: str, chart: Path, tmp_path: Path, *args: str) -> str:
    """NOTES.txt rendered (helm template skips it): a copy of the chart renders it into a ConfigMap."""
    copy = tmp_path / "kvtierd"
    if not copy.exists():
        shutil.copytree(chart, copy)
        shutil.copy(copy / "templates" / "NOTES.txt", copy / "notes.txt")
        (copy / "templates" / "notes-test.yaml").write_text(
            'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n'
            'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    out = template(helm, copy, "--show-only", "templates/notes-test.yaml", *args)
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_tell_how_to_reach_the_daemon(helm: str, chart: Path, tmp_path: Path) -> None:
    text = notes(helm, chart, tmp_path)
    assert "unix:///run/kvtierd/kvtierd.sock" in text and "uid 10001" in text
    assert "grpc.health.v1.Health/Check" in text and "127.0.0.1:8081" in text
    assert "127.0.0.1:9464/metrics" in text
    assert "supplementalGroups [10001]" in text and "no hostIPC and no shared /dev/shm are needed" in text
    shared = notes(helm, chart, tmp_path, "-f", str(CHART / "ci" / "host-ipc-values.yaml"))
    assert "hostIPC is on" in shared and "Older runners" in shared


# ---- the Dockerfile


def test_dockerfile_lints_clean(hadolint: str) -> None:
    proc = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_finds_faults(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN pip install kvtierd\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "DL3007" in proc.stdout and "DL3013" in proc.stdout


def test_dockerfile_builds_the_daemon_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in instructions
    torch = text.index('"torch==${TORCH_VERSION}"')
    assert "ARG TORCH_VERSION=2.13.0" in instructions and torch < text.index('pip install --no-cache-dir "/src')
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert user[-1].split(":")[0] == str(yaml.safe_load((CHART / "values.yaml").read_text())
                                         ["securityContext"]["runAsUser"])
    assert 'ENTRYPOINT ["kvtierd", "serve"]' in instructions
    assert set(re.search(r"^EXPOSE (.+)$", text, re.MULTILINE).group(1).split()) == {"7070", "8081", "9464"}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"  # everything out, then an allowlist
    assert "!.tools" not in ignore and "!tests/" not in ignore
    for kept in ("pyproject.toml", "setup.py", "README.md", "proto/", "kvtierd/", "kernels/", "connectors/"):
        assert f"!{kept}" in ignore
