"""Every configuration key is documented, and every documented key is a field: the daemon's keys
(the fields of DaemonConfig's sections) against the sample file in docs/configuration.md, the Helm
chart's `config:` values, its values.schema.json and its README tables; the vLLM connector's
kv_connector_extra_config keys (VllmExtraConfig's fields) against docs/vllm.md. A field added
without documentation fails here, and so does a documented key that no field reads."""

from __future__ import annotations

import dataclasses
import json
import re

import yaml

from kvtierd.connectors.vllm.extra_config import VllmExtraConfig
from kvtierd.server.config_loader import ENV_KEYS, load_config
from kvtierd.server.daemon_config import QUOTA_KEYS, SECTIONS
from tests.conftest import REPO

CHART = REPO / "helm" / "kvtierd"
CHART_RENDERS = ("server", "pool", "host", "ssd", "policy", "remote", "encryption")  # [events]: not rendered
CHART_REFUSES = {"remote.password": "a password in a values file; remote.existingSecret mounts remote.password_file"}


def daemon_keys() -> set[str]:
    """Dotted keys of the daemon's file, from the dataclass fields; "quotas.*.KEY" for the tenant tables."""
    keys = {f"{section}.{field.name}" for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)}
    return keys | {"log_level"} | {f"quotas.*.{name}" for name in QUOTA_KEYS}


def sample_file() -> str:
    """The sample file of docs/configuration.md's "Configuration"."""
    text = (REPO / "docs" / "configuration.md").read_text()
    return text.split("\n## Configuration\n", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]


def sample_file_keys() -> set[str]:
    """The keys docs/configuration.md's sample file sets, or shows commented out (`# key = ...`)."""
    keys, section = set(), ""
    for line in sample_file().splitlines():
        if header := re.match(r"\[([^\]]+)\]", line):
            section = re.sub(r"^quotas\..*", "quotas.*", header.group(1))
        elif assignment := re.match(r"#?\s*([a-z_][a-z0-9_]*)\s*=", line):
            keys.add(f"{section}.{assignment.group(1)}" if section else assignment.group(1))
    return keys


def schema_config_keys() -> set[str]:
    """The daemon keys values.schema.json accepts under `config:`."""
    config = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]["properties"]
    keys = set()
    for section, node in config.items():
        if section == "quotas":
            keys |= {f"quotas.*.{name}" for name in node["additionalProperties"]["properties"]}
        elif "properties" in node:
            keys |= {f"{section}.{name}" for name in node["properties"]}
        else:
            keys.add(section)
    return keys


def values_config_keys() -> set[str]:
    """The daemon keys values.yaml sets under `config:`."""
    config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    keys = set()
    for section, value in config.items():
        if section == "quotas":
            keys |= {f"quotas.*.{name}" for quota in value.values() for name in quota}
        elif isinstance(value, dict):
            keys |= {f"{section}.{name}" for name in value}
        else:
            keys.add(section)
    return keys


def readme_table(header: str) -> list[list[str]]:
    """The cells of the helm/kvtierd/README.md table whose header row starts with `header`."""
    lines = (CHART / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def chart_owned_keys() -> set[str]:
    """The keys the chart sets from other values (the README's "comes from" table): "`server.tcp`,
    `insecure_tcp`" names server.tcp and server.insecure_tcp; "`[remote]`, all of it" every remote key."""
    keys = set()
    for cell, _ in readme_table("| TOML key | comes from |"):
        section = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if table := re.fullmatch(r"\[(\w+)\]", name):
                keys |= {key for key in daemon_keys() if key.startswith(table.group(1) + ".")}
                continue
            section, _, key = name.rpartition(".") if "." in name else (section, "", name)
            keys.add(f"{section}.{key}")
    return keys


def chart_remote_keys() -> set[str]:
    """The [remote] keys the README's T3 table maps values to (a KVTIERD_ variable names its key)."""
    keys = set()
    for _, cell, _ in readme_table("| value | `[remote]` key | default |"):
        for name in re.findall(r"`([^`]+)`", cell):
            if name in ENV_KEYS:
                keys.add(ENV_KEYS[name])
            elif word := re.match(r"[a-z_][a-z0-9_]*\b", name):
                keys.add(f"remote.{word.group(0)}")
    return keys


def test_the_sample_file_in_the_docs_shows_every_key_and_no_other():
    """docs/configuration.md's sample sets (or shows commented out) each field of each section, and nothing else."""
    documented, fields = sample_file_keys(), daemon_keys()
    undocumented, unknown = sorted(fields - documented), sorted(documented - fields)
    assert not undocumented, f"fields missing from the sample file in docs/configuration.md: {undocumented}"
    assert not unknown, f"keys in docs/configuration.md's sample that no field reads: {unknown}"


def test_the_sample_file_in_the_docs_loads(tmp_path):
    """The sample is a configuration the daemon accepts as written (files it names are read only at start)."""
    path = tmp_path / "kvtierd.toml"
    path.write_text(sample_file())
    config = load_config(str(path), environ={})
    assert config.remote.enabled and config.quotas["acme"].t2_bytes == 200 << 30


def test_every_key_the_chart_takes_is_a_field():
    """values.schema.json, values.yaml's `config:` and the README's tables name only daemon keys."""
    fields = daemon_keys()
    for source, keys in (("values.schema.json config", schema_config_keys()),
                         ("values.yaml config", values_config_keys()),
                         ("README 'comes from' table", chart_owned_keys()),
                         ("README T3 table", chart_remote_keys())):
        unknown = sorted(keys - fields)
        assert not unknown, f"{source}: keys no field reads: {unknown}"


def test_every_field_of_a_section_the_chart_renders_has_a_value_or_a_reason():
    """Each key of the chart's sections is a `config:` value (in the schema), set by the chart from
    another value (the README says which), or refused by the chart on purpose (CHART_REFUSES)."""
    covered = schema_config_keys() | (chart_owned_keys() - {k for k in daemon_keys() if k.startswith("remote.")})
    covered |= chart_remote_keys() | set(CHART_REFUSES)
    rendered = {key for key in daemon_keys() if key.split(".")[0] in (*CHART_RENDERS, "quotas", "log_level")}
    undocumented = sorted(rendered - covered)
    assert not undocumented, f"fields the Helm chart neither takes nor documents: {undocumented}"
    assert not any(key.startswith("events.") for key in schema_config_keys())  # the chart renders no [events]


def test_the_vllm_docs_name_every_extra_config_key_and_no_other():
    """docs/vllm.md's list of kv_connector_extra_config keys is VllmExtraConfig's fields."""
    text = " ".join((REPO / "docs" / "vllm.md").read_text().split())
    listed = text.split("Optional `kv_connector_extra_config` keys:", 1)[1].split("(see", 1)[0]
    documented, fields = set(re.findall(r"`(\w+)`", listed)), {f.name for f in dataclasses.fields(VllmExtraConfig)}
    assert documented == fields, f"undocumented: {sorted(fields - documented)}, no field: {sorted(documented - fields)}"


def test_the_parsers_see_the_documents():
    """The readers above find what they read (a moved heading would otherwise pass them vacuously)."""
    assert {"server.socket", "remote.endpoints", "quotas.*.t0_bytes", "log_level"} <= sample_file_keys()
    assert {"pool.t0_bytes", "quotas.*.t0_bytes", "log_level"} <= schema_config_keys()
    assert {"server.socket", "server.insecure_tcp", "pool.device", "ssd.directory"} <= chart_owned_keys()
    assert {"remote.endpoints", "remote.username", "remote.tls_key_file"} <= chart_remote_keys()
