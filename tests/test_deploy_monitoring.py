"""Prometheus and Grafana files: promtool checks the scrape configs and the alert rules and
runs the rules' unit tests; every metric (and label) the alerts and the dashboard use is
exported by the code; the dashboard has the panels a DAPO user watches."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY, ROOT, require_tool, run_tool
from prometheus_client import REGISTRY

PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dapo.json"
PACKAGES = ("services", "rollout", "reward", "learner")
METRIC_CLASSES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "Info": "info",
    "Enum": "stateset",
}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
# Labels Prometheus itself attaches to every series (scrape target, k8s relabelling).
TARGET_LABELS = {"job", "instance", "pod", "node", "namespace"}
ISSUE_ALERTS = {  # issue 7: the situations the rules must cover
    "learner stalled": "DapoLearnerStalled",
    "informative-group rate collapsed": "DapoInformativeGroupRateCollapsed",
    "rollout server down": "DapoRolloutServerDown",
    "queue backlog growing": "DapoTrainBacklogGrowing",
    "reward timeouts rising": "DapoRewardTimeoutsRising",
    "staleness beyond bound": "DapoStalenessBeyondBound",
    "engine mismatch": "DapoEngineMismatchHigh",
}
ISSUE_PANELS = [  # issue 7: the panels a DAPO user watches
    "Reward and accuracy",
    "Kept vs filtered groups by reason",
    "Response length",
    "Truncation rate",
    "Entropy",
    "Clip fractions",
    "Tokens/s per rollout server",
    "Learner step time",
    "Learner tokens/s",
    "Weight-sync seconds",
    "Staleness of trained batches",
    "Queue depths",
    "Reward latency",
    "Reward timeouts and errors",
    "Engine mismatch (same-version tokens)",
    "Policy lag (versions behind)",
    "Held-out accuracy (eval curve)",  # issue 21: the eval curve
    "KV-cache use per rollout server",  # issue 27: vLLM's KV-cache pool
]


# ---------------------------------------------------------------- what the code exports
def sample_names(family: str, kind: str) -> list[str]:
    base = family.removesuffix("_total") if kind == "counter" else family
    return [base + suffix for suffix in SUFFIXES[kind]]


def _metric_call(node: ast.AST) -> tuple[Any, str, list[str]] | None:
    """(name node, kind, label names) of `Counter("dapo_...", "help", ["label"])`-like calls."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    cls = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if cls not in METRIC_CLASSES or not node.args:
        return None
    labels: Any = node.args[2] if len(node.args) > 2 else None
    labels = next((k.value for k in node.keywords if k.arg == "labelnames"), labels)
    found = [e.value for e in getattr(labels, "elts", []) if isinstance(e, ast.Constant)]
    return node.args[0], METRIC_CLASSES[cls], found


def metrics_in_source() -> tuple[dict[str, set[str]], set[str]]:
    """Sample name → label names for every metric constructed with a literal name, and the
    modules that build names at run time (f-strings), which must be imported to know them."""
    out: dict[str, set[str]] = {}
    dynamic: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                call = _metric_call(node)
                if call is None:
                    continue
                name, kind, labels = call
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
                    dynamic.add(module)
                    continue
                for sample in sample_names(name.value, kind):
                    out.setdefault(sample, set()).update(labels)
    return out, dynamic


def metrics_in_registry(modules: set[str]) -> dict[str, set[str]]:
    """Sample name → label names of the default registry after importing `modules`."""
    for module in sorted(modules):
        importlib.import_module(module)
    out: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        for sample in sample_names(family.name, family.type):
            out.setdefault(sample, set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    out, dynamic = metrics_in_source()
    for name, labels in metrics_in_registry(dynamic).items():
        out.setdefault(name, set()).update(labels)
    return out


# ---------------------------------------------------------------- what the files reference
def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def referenced_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every alert rule and every dashboard query."""
    found = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    for panel in dashboard_panels():
        found += [(f"panel {panel['title']!r}", t["expr"]) for t in panel["targets"]]
    return found


SELECTOR = re.compile(r"\b(dapo_[a-z0-9_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def check_expression(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """Problems: unknown metric names, label matchers or groupings no metric carries."""
    problems, labels = [], set(TARGET_LABELS)
    for name, matchers in SELECTOR.findall(expr):
        if name not in exported:
            problems.append(f"{name} is not exported")
            continue
        labels |= exported[name] | ({"le"} if name.endswith("_bucket") else set())
        for label in MATCHER.findall(matchers):
            if label not in exported[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label!r}")
    for group in GROUPING.findall(expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if label not in labels:
                problems.append(f"no metric here carries the label {label!r}")
    return problems


def test_scanner_finds_the_metrics_and_their_labels(exported) -> None:
    assert exported["dapo_buffer_groups_total"] >= {"reason"}
    assert exported["dapo_reward_request_seconds_bucket"] >= {"transport"}
    assert "dapo_learner_entropy" in exported  # built from an f-string: found by import
    assert check_expression("rate(dapo_nope_total[5m])", exported) == [
        "dapo_nope_total is not exported"
    ]
    assert check_expression('dapo_buffer_groups_total{verdict="kept"}', exported) == [
        "dapo_buffer_groups_total has no label 'verdict'"
    ]
    assert check_expression("sum by (color) (dapo_buffer_groups_total)", exported) == [
        "no metric here carries the label 'color'"
    ]


def test_every_referenced_metric_is_exported(exported) -> None:
    expressions = referenced_expressions()
    assert len(expressions) > 30
    problems = [f"{where}: {p}" for where, e in expressions for p in check_expression(e, exported)]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- promtool
def test_compose_scrape_config_passes_promtool() -> None:
    promtool = require_tool("promtool", "prometheus")
    done = run_tool(promtool, "check", "config", str(PROM / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_kubernetes_scrape_config_passes_promtool(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery, so the check runs with the
    discovery block swapped for a static one; the relabelling is checked as written."""
    promtool = require_tool("promtool", "prometheus")
    config = yaml.safe_load((PROM / "kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    sd = job.pop("kubernetes_sd_configs")
    assert sd == [{"role": "pod", "namespaces": {"names": ["dapo"]}}]
    job["static_configs"] = [{"targets": ["10.0.0.1:8002"]}]
    config["rule_files"] = [str(PROM / "alerts.yml")]
    path = tmp_path / "kubernetes.yml"
    path.write_text(yaml.safe_dump(config))
    done = run_tool(promtool, "check", "config", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    to_job = next(r for r in job["relabel_configs"] if r.get("target_label") == "job")
    assert to_job["replacement"] == "dapo-$1"  # jobs named as in prometheus.yml


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = require_tool("promtool", "prometheus")
    done = run_tool(promtool, "check", "rules", str(PROM / "alerts.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_tool(promtool, "test", "rules", "alerts_test.yml", cwd=PROM)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_unit_tests_notice_a_wrong_expectation(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    text = (PROM / "alerts_test.yml").read_text().replace("25% of inf", "20% of inf")
    (tmp_path / "alerts.yml").write_text((PROM / "alerts.yml").read_text())
    (tmp_path / "alerts_test.yml").write_text(text)
    done = run_tool(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert done.returncode != 0 and "DapoStalenessBeyondBound" in done.stdout + done.stderr


def test_the_issue_alerts_exist_and_each_is_tested_firing() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    assert set(ISSUE_ALERTS.values()) <= names
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert fired >= names - {"DapoServiceDown", "DapoScoredBacklogGrowing"}
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]


# ---------------------------------------------------------------- Grafana
def test_dashboard_has_the_issue_panels() -> None:
    panels = {p["title"]: p for p in dashboard_panels()}
    missing = [t for t in ISSUE_PANELS if t not in panels]
    assert not missing, missing
    assert panels["Staleness of trained batches"]["type"] == "histogram"
    reasons = panels["Kept vs filtered groups by reason"]["targets"][0]["expr"]
    assert "by (reason)" in reasons
    per_server = panels["Tokens/s per rollout server"]["targets"][0]["expr"]
    assert "by (instance)" in per_server
    curve = [t["expr"] for t in panels["Held-out accuracy (eval curve)"]["targets"]]
    assert curve[:2] == ["dapo_controller_eval_accuracy", "dapo_controller_eval_pass_at_n"]


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (variable,) = dashboard["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
