"""The monitoring assets of the chart (helm/kvtierd/files): the Prometheus rules pass promtool's
check and their unit tests (tests/deploy/monitoring/), each alert's unit tests tell a firing series from
a silent one, and every metric the rules and the Grafana dashboard name is one a live daemon
exports (or a recording rule of the rules file), with labels it carries. The live daemon runs with
T3 on a local redis-server (tests/t3/redis_cluster.py), so the kvtierd_t3_* series are there too."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import subprocess
import urllib.request

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KvtierClient
from kvtierd.errors import KvtierError
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.layout import Layout
from kvtierd.v1 import kvtier_pb2
from tests.t3.redis_cluster import running_single

REPO = pathlib.Path(__file__).resolve().parents[2]
RULES = REPO / "helm" / "kvtierd" / "files" / "prometheus-rules.yaml"
DASHBOARD = REPO / "helm" / "kvtierd" / "files" / "grafana-dashboard.json"
RULE_TESTS = REPO / "tests" / "deploy" / "monitoring" / "prometheus-rules.test.yaml"

LAYOUT = Layout("monitoring-model", 2, 2, 16, 4)  # 1 KiB blocks
# Labels Prometheus adds to every scraped series (the target's), and the histogram bucket label.
TARGET_LABELS = {"job", "instance"}
# Label values checked against what a scrape reports (a typo such as tier="T0" matches nothing).
ENUM_LABELS = {"tier", "direction", "edge"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms",
                    "__from", "__to", "__name", "__dashboard", "__org", "__user"}

NAME = re.compile(r"\bkvtierd[_:][A-Za-z0-9_:]*")
SELECTOR = re.compile(r"\b(kvtierd[_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
MATCHER = re.compile(r"""([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')""")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# The T3 series the daemon exports (metrics/metrics_collector.py): the only kvtierd_t3_ names
# the rules and dashboard may use.
T3_METRICS = {"kvtierd_t3_hit_blocks_total", "kvtierd_t3_miss_blocks_total", "kvtierd_t3_read_bytes_total",
              "kvtierd_t3_written_bytes_total", "kvtierd_t3_dropped_writes_total", "kvtierd_t3_corrupt_blocks_total",
              "kvtierd_t3_errors_total", "kvtierd_t3_breaker_open", "kvtierd_t3_open_nodes",
              "kvtierd_t3_write_backlog_bytes"}
T3_ALERTS = {"KvtierdT3BreakerOpen", "KvtierdT3Errors", "KvtierdT3CorruptBlocks", "KvtierdT3WritesDropped"}


# ------------------------------------------------------------------------------------- helpers

def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def alerts() -> list[dict]:
    return [rule for rule in load_rules() if "alert" in rule]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed panels included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every panel target's expr and every query variable's query."""
    exprs = [t["expr"] for p in query_panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def rule_texts() -> list[str]:
    """Every rule's expr and annotation (annotations query series too)."""
    texts = []
    for rule in load_rules():
        texts.append(rule["expr"])
        texts.extend(rule.get("annotations", {}).values())
    return texts


def promtool_run(promtool: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=timeout)


def unquote(value: str) -> str:
    return value[1:-1]


# ------------------------------------------------------------------------------------- rules

def test_promtool_check_rules_accepts_every_rule(promtool):
    """promtool parses every expr and template and finds as many rules as the file holds."""
    done = promtool_run(promtool, "check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in done.stdout, done.stdout


def test_promtool_unit_tests_pass(promtool):
    """tests/deploy/monitoring/prometheus-rules.test.yaml: each alert fires on its synthetic series, with
    these labels and annotations, and stays silent on healthy ones."""
    done = promtool_run(promtool, "test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_for_severity_summary_and_runbook():
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), names
    assert {"KvtierdPrefixHitRateDropped", "KvtierdPoolTooSmall", "KvtierdT0FreeBlocksFalling",
            "KvtierdReclaimedRefsRising", "KvtierdSsdCorruptedBlocks", "KvtierdSsdIoErrors",
            "KvtierdEvictionStorm", "KvtierdT0PoolNearlyFull"} | T3_ALERTS <= set(names)
    for rule in alerts():
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert "$labels.instance" in annotations["summary"], rule["alert"]  # which daemon
        if not rule["expr"].strip().endswith("== 0"):  # a state, not a level: no value to show
            assert "$value" in annotations["summary"], rule["alert"]  # how bad
        assert "Runbook:" in annotations["description"], rule["alert"]


def rule_test_cases() -> dict[str, dict[str, list[str]]]:
    """alert → {"fires": [group names], "silent": [group names]} from the unit test file."""
    cases: dict[str, dict[str, list[str]]] = {}
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            kind = "fires" if case.get("exp_alerts") else "silent"
            cases.setdefault(case["alertname"], {"fires": [], "silent": []})[kind].append(group["name"])
    return cases


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    """Silent cases in a group of their own: healthy (or nearly alerting) series, not only an
    evaluation before `for:` has passed."""
    cases = rule_test_cases()
    for rule in alerts():
        found = cases.get(rule["alert"], {"fires": [], "silent": []})
        assert found["fires"], f"{rule['alert']}: no unit test where it fires"
        silent_groups = set(found["silent"]) - set(found["fires"])
        assert silent_groups, f"{rule['alert']}: no group of healthy series where it stays silent"
    assert set(cases) <= {rule["alert"] for rule in alerts()}, "unit tests of alerts that do not exist"


def mutated_run(promtool: str, tmp_path: pathlib.Path, mutate, keep_group) -> dict[str, set[str]]:
    """Rewrite every alert's expr with `mutate(expr)`, run the unit-test groups `keep_group`
    selects against it; returns alert → names of the groups whose cases for it failed."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["expr"] = mutate(rule["expr"])
    rules_path = tmp_path / "mutated-rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(rules_path)]
    tests["tests"] = [group for group in tests["tests"] if keep_group(group)]
    tests_path = tmp_path / "mutated-tests.yaml"
    tests_path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool_run(promtool, "test", "rules", str(tests_path))
    assert done.returncode != 0, "the unit tests pass against mutated alerts"
    failed: dict[str, set[str]] = {}
    for group_name, alert in re.findall(r"name: (.*),\n\s*alertname: (\w+),", done.stdout + done.stderr):
        failed.setdefault(alert, set()).add(group_name)
    return failed


def fires_somewhere(group: dict) -> bool:
    return any(case.get("exp_alerts") for case in group.get("alert_rule_test", []))


def test_firing_unit_tests_fail_when_an_alert_never_fires(promtool, tmp_path):
    """Every alert replaced by one that never fires: each alert's firing case catches it."""
    failed = mutated_run(promtool, tmp_path, lambda expr: "vector(1) < 0", fires_somewhere)
    for rule in alerts():
        assert failed.get(rule["alert"]), f"{rule['alert']}: its unit tests pass with an alert that never fires"


def test_silent_unit_tests_fail_when_an_alert_fires_on_any_series(promtool, tmp_path):
    """Every alert replaced by its first series with no condition (fires wherever that series
    exists): each alert's silent group catches it, so the silent series are well formed."""
    failed = mutated_run(promtool, tmp_path, lambda expr: NAME.search(expr).group(0),
                         lambda group: not fires_somewhere(group))
    for rule in alerts():
        assert failed.get(rule["alert"]), f"{rule['alert']}: its silent cases pass with an alert that always fires"


# ------------------------------------------------------------------------------------- dashboard

def test_dashboard_loads_with_unique_panel_ids_and_prometheus_targets():
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), sorted(ids)
    panels = query_panels(dashboard)
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr", "").strip() for t in targets), panel["title"]
        assert all(t.get("datasource", panel["datasource"]) == panel["datasource"] for t in targets), panel["title"]
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_dashboard_variables_are_defined_and_the_datasource_is_prometheus():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"instance", "layout"} <= set(variables)
    used = set()
    for expr in dashboard_exprs(dashboard):
        used |= set(VARIABLE.findall(expr))
    assert {"instance", "layout"} <= used
    undefined = used - set(variables) - GRAFANA_BUILTINS
    assert not undefined, f"exprs use undefined variables: {sorted(undefined)}"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}", variable["name"]


def test_dashboard_has_the_rows_and_the_pool_too_small_panel():
    dashboard = load_dashboard()
    rows = [p["title"].lower() for p in all_panels(dashboard) if p["type"] == "row"]
    for wanted in ("overview", "capacity", "movement", "eviction", "rpc", "t2", "t3"):
        assert any(wanted in title for title in rows), (wanted, rows)
    # "reuse gap p90 > idle-before-evict p50" visible on one panel
    assert any(any("0.9" in e and "kvtierd_block_reuse_gap_seconds_bucket" in e for e in exprs) and
               any("0.5" in e and "kvtierd_block_idle_before_evict_seconds_bucket" in e for e in exprs)
               for exprs in ([t["expr"] for t in p["targets"]] for p in query_panels(dashboard)))


def test_t3_names_are_the_specs_and_the_dashboard_shows_each():
    """The rules and the dashboard name no T3 series outside the spec; every one of them is on a panel."""
    dashboard_names = {name for expr in dashboard_exprs(load_dashboard()) for name in NAME.findall(expr)}
    rule_names = {name for text in rule_texts() for name in NAME.findall(text)}
    used = {name for name in dashboard_names | rule_names if name.startswith("kvtierd_t3_")}
    assert used <= T3_METRICS, sorted(used - T3_METRICS)
    assert T3_METRICS <= dashboard_names, sorted(T3_METRICS - dashboard_names)
    assert any('tier="t3"' in expr for expr in dashboard_exprs(load_dashboard()))  # T3's share of prompt tokens


def test_dashboard_exprs_parse_as_promql(promtool, tmp_path):
    """Each expr, with the variables substituted, is a valid recording rule for promtool."""
    substitutions = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                     "$instance": ".+", "$layout": ".+"}
    rules = []
    for i, expr in enumerate(dashboard_exprs(load_dashboard())):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:expr_{i}:check", "expr": expr})
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool_run(promtool, "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------- names vs a live daemon

@pytest.fixture(scope="module")
def live_scrape(tmp_path_factory) -> str:
    """A real daemon's /metrics (T0 to T1 write-through, so copies run, and T1 to T3 into a local
    redis-server) after attach, acquire, commit, release, a second acquire that hits T0 (a reuse-gap
    sample), a refused call (an error code) and a session that ends holding a request (reclaimed
    references), once T3 has taken the blocks."""
    directory = tmp_path_factory.mktemp("daemon")
    with contextlib.ExitStack() as stack:
        extra = ["--set", "policy.t0_to_t1=write_through"]
        redis = stack.enter_context(running_single(tmp_path_factory.mktemp("redis")))
        extra += ["--set", f"remote.endpoints={redis.seeds}", "--set", "remote.mode=single"]
        daemon = stack.enter_context(DaemonProcess(small_daemon_args(str(directory), extra=extra)))
        client = stack.enter_context(KvtierClient(daemon.address))
        return exercise(daemon, client)


def scrape_value(daemon: DaemonProcess, name: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return sum(value for sample, _, value in parse_scrape(text) if sample == name)


def exercise(daemon: DaemonProcess, client: KvtierClient) -> str:
    """The calls the live_scrape docstring lists, then the scrape."""
    session = client.attach(LAYOUT)
    tokens = list(range(100, 100 + 8 * LAYOUT.block_size))
    hashes = session.namespace.hash_blocks(tokens)
    first = session.acquire("first", hashes, token_ids=tokens)
    session.commit("first", first.block_ids, hashes, tokens, None)
    session.release("first")
    # a write-through copy holds the blocks until it lands; a hit on a held block is sharing,
    # not reuse: wait for every block to be free again
    assert wait_until(lambda: all(p.num_free_blocks == p.num_blocks for p in client.stats().pools))
    again = session.acquire("again", hashes, token_ids=tokens)
    assert again.num_t0_hit_blocks == len(hashes)
    session.release("again")
    with pytest.raises(KvtierError):
        session.release("never-acquired")
    leaving = client.attach(LAYOUT)
    leaving.acquire("held", [], num_extra_blocks=2)
    leaving.close()
    assert wait_until(lambda: client.stats().num_reclaimed_refs == 2)
    assert wait_until(lambda: scrape_value(daemon, "kvtierd_t3_written_bytes_total") > 0)
    return urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()


def parse_scrape(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


@pytest.fixture(scope="module")
def scraped(live_scrape) -> dict[str, list[dict[str, str]]]:
    """Sample name → its label sets, from the live scrape."""
    samples: dict[str, list[dict[str, str]]] = {}
    values: dict[str, float] = {}
    for name, labels, value in parse_scrape(live_scrape):
        samples.setdefault(name, []).append(labels)
        values[name] = values.get(name, 0.0) + value
    assert values["kvtierd_block_reuse_gap_seconds_count"] == 8  # the histograms have series
    assert values["kvtierd_rpc_duration_seconds_count"] >= 5
    assert values["kvtierd_reclaimed_refs_total"] == 2
    return samples


def check_names(texts: list[str], scraped: dict[str, list[dict[str, str]]], where: str) -> None:
    recorded = recorded_names()
    rpc_methods = set(kvtier_pb2.DESCRIPTOR.services_by_name["KvTier"].methods_by_name)
    status_codes = {code.name for code in grpc.StatusCode}
    all_labels = TARGET_LABELS | {"le"} | {name for sets in scraped.values() for labels in sets for name in labels}
    names = set()
    for text in texts:
        names |= set(NAME.findall(text))
        for name, matchers in SELECTOR.findall(text):
            if name in recorded:
                continue
            label_sets = scraped.get(name, [])
            for label, op, quoted in MATCHER.findall(matchers):
                value = unquote(quoted)
                assert label in TARGET_LABELS or any(label in labels for labels in label_sets), \
                    f"{where}: {name} has no label {label!r}"
                if "$" in value or "%" in value:
                    continue  # a Grafana variable, a template argument
                if label in ENUM_LABELS and op in ("=", "!="):
                    assert any(labels.get(label) == value for labels in label_sets), \
                        f"{where}: {name} never has {label}={value!r}"
                if label == "code":
                    assert set(value.split("|")) <= status_codes, f"{where}: {label}{op}{quoted}"
                if label == "method":
                    assert set(value.split("|")) <= rpc_methods, f"{where}: {label}{op}{quoted}"
        for grouping in GROUPING.findall(text):
            for label in filter(None, (part.strip() for part in grouping.split(","))):
                assert label in all_labels, f"{where}: groups by {label!r}, a label no series has"
    missing = sorted(name for name in names if name not in scraped and name not in recorded)
    assert not missing, f"{where} uses metrics the daemon does not export: {missing}"


@pytest.mark.cluster  # live_scrape runs the daemon with T3 on a redis-server
def test_every_name_in_the_rules_is_exported_or_recorded(scraped):
    check_names(rule_texts(), scraped, "prometheus-rules.yaml")
    # a classic histogram is queried through its suffixes: the bare name is no series
    assert "kvtierd_block_reuse_gap_seconds" not in scraped


@pytest.mark.cluster  # live_scrape runs the daemon with T3 on a redis-server
def test_every_name_in_the_dashboard_is_exported_or_recorded(scraped):
    check_names(dashboard_exprs(load_dashboard()), scraped, "grafana-dashboard.json")


@pytest.mark.cluster  # live_scrape runs the daemon with T3 on a redis-server
def test_the_name_check_rejects_an_unknown_metric_label_or_tier(scraped):
    """The check above is not vacuous: a misspelt name, label or tier value is refused."""
    for wrong in ('rate(kvtierd_evictions{tier="t0"}[5m])',  # counters are queried as _total
                  'kvtierd_tier_used_bytes{layout="m"}',
                  'kvtierd_tier_used_bytes{tier="T0"}',
                  'sum by (layout) (kvtierd_t0_blocks)',
                  'rate(kvtierd_rpc_total{method="Aquire"}[5m])',
                  'rate(kvtierd_t3_hits_total[5m])',  # the spec's name is kvtierd_t3_hit_blocks_total
                  'kvtierd_t3_breaker_open{model="m"}',  # the store's series have no model label
                  'rate(kvtierd_prefix_hit_blocks_total{tier="T3"}[5m])'):
        with pytest.raises(AssertionError):
            check_names([wrong], scraped, "wrong")


@pytest.mark.cluster  # live_scrape runs the daemon with T3 on a redis-server
def test_every_dashboard_query_and_recording_rule_returns_data_on_the_daemons_series(promtool, live_scrape,
                                                                                      tmp_path):
    """The live scrape replayed as 30 minutes of series (counters growing at the scraped value a
    minute): every panel query, variable query and recording rule returns at least one sample, so
    no join (group_left, ignoring, on) or filter silently matches nothing."""
    counter = re.compile(r"_(total|count|sum|bucket)$")
    input_series = []
    for name, labels, value in parse_scrape(live_scrape):
        labels = dict(labels, job="kvtierd", instance="node-a:9464")
        selector = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        input_series.append({"series": selector, "values": f"0+{value}x30" if counter.search(name) else f"{value}x30"})
    substitutions = {"$__rate_interval": "5m", "$instance": ".+", "$layout": ".+"}
    queries = []
    for expr in dashboard_exprs(load_dashboard()):
        if match := re.fullmatch(r"label_values\((.*),\s*\w+\)", expr):
            expr = match.group(1)
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        queries.append(expr)
    queries += [rule["expr"] for rule in load_rules() if "record" in rule]
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
             "tests": [{"name": "live series", "interval": "1m", "input_series": input_series,
                        "promql_expr_test": [{"expr": f"absent({q})", "eval_time": "30m", "exp_samples": []}
                                             for q in queries]}]}
    path = tmp_path / "live.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool_run(promtool, "test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
