"""The chart's encryption values: [encryption] rendered only when enabled, the master key mounted from
its Secret through an init container that copies it mode 0400 (a Secret volume's files are
group-readable under fsGroup, which the daemon refuses), the combinations the daemon would
refuse refused at render time, and encryption beside a T3 rendered."""

from __future__ import annotations

import tomllib

import pytest
from test_helm_chart import CHART, daemon_container, helm_run, install, pod_spec, render, render_ci, toml_text

ENCRYPTION_CI = CHART / "ci" / "encryption-values.yaml"
KEY_PATH = "/etc/kvtierd/master-key/master.key"


@pytest.fixture(scope="module")
def helm_binary() -> str:
    return install("install-helm")


def test_no_encryption_section_or_key_volume_by_default(helm_binary: str) -> None:
    docs = render(helm_binary, CHART)
    spec = pod_spec(docs)
    assert "[encryption]" not in toml_text(docs)
    assert not {"master-key", "master-key-secret"} & {v["name"] for v in spec["volumes"]}
    assert "master-key" not in [c["name"] for c in spec.get("initContainers", [])]


def test_the_master_key_reaches_the_daemon_as_a_0400_copy_of_its_secret(helm_binary: str) -> None:
    """The TOML names the copy; the init container installs it mode 0400 from the Secret volume into a
    memory emptyDir, which the daemon mounts read-only; the Secret itself is not mounted in the daemon."""
    docs = render_ci(helm_binary, CHART, ENCRYPTION_CI)
    assert tomllib.loads(toml_text(docs))["encryption"] == {"enabled": True, "master_key_file": KEY_PATH}
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["master-key-secret"]["secret"] == {"secretName": "kvtierd-master-key", "defaultMode": 0o400,
                                                       "items": [{"key": "master.key", "path": "master.key"}]}
    assert volumes["master-key"]["emptyDir"]["medium"] == "Memory"
    init = next(c for c in spec["initContainers"] if c["name"] == "master-key")
    assert init["command"] == ["install", "-m", "0400", "/etc/kvtierd/master-key-secret/master.key", KEY_PATH]
    assert init["securityContext"]["runAsUser"] == daemon_container(spec)["securityContext"]["runAsUser"]
    daemon_mounts = {m["name"]: m for m in daemon_container(spec)["volumeMounts"]}
    assert daemon_mounts["master-key"]["readOnly"] is True
    assert "master-key-secret" not in daemon_mounts


def test_encryption_with_a_t3_renders_both_sections(helm_binary: str) -> None:
    """[encryption] beside [remote]: the daemon seals T3 too, so the chart no longer refuses the pair."""
    proc = helm_run(helm_binary, "template", "r", str(CHART), "-f", str(ENCRYPTION_CI),
                    "--set", "remote.endpoints={redis:6379}")
    assert proc.returncode == 0, proc.stderr
    assert "[encryption]" in proc.stdout and 'endpoints = "redis:6379"' in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--set", "encryption.enabled=true"], "encryption.enabled needs encryption.existingSecret"),
    (["-f", str(ENCRYPTION_CI), "--set", "ssd.type=none"], "needs T2"),
    (["-f", str(ENCRYPTION_CI), "--set", "sidecarExample.enabled=true"], "sidecar example"),
])
def test_what_the_daemon_would_refuse_is_refused_at_render(helm_binary: str, args: list[str], message: str) -> None:
    proc = helm_run(helm_binary, "template", "r", str(CHART), *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
