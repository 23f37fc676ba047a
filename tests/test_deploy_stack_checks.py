"""scripts/prometheus_checks.py without a Prometheus: the scrape jobs and interval it reads
from the checked-in config, Grafana's variable syntaxes, every dashboard query resolved,
and the verdicts on canned query_range answers. The live checks run in
scripts/test_containers.sh (`make test-containers`) and tests/test_deploy_scrape.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY

from scripts import prometheus_checks as pc

CONFIG = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text())


def test_scrape_jobs_match_what_yaml_reads() -> None:
    jobs = [job["job_name"] for job in yaml.safe_load(CONFIG)["scrape_configs"]]
    assert pc.scrape_jobs(CONFIG) == jobs
    roles = ("controller", "buffer", "reward", "learner", "rollout")
    assert {f"dapo-{role}" for role in roles} <= set(jobs)
    quoted = "scrape_configs:\n  - job_name: 'a-b'\n  -  job_name: \"c\"\n"
    assert pc.scrape_jobs(quoted) == ["a-b", "c"]


def test_scrape_interval_is_the_global_one() -> None:
    assert yaml.safe_load(CONFIG)["global"]["scrape_interval"] == "15s"
    assert pc.scrape_interval_s(CONFIG) == 15
    assert pc.scrape_interval_s("global:\n  scrape_interval: 2m\n") == 120
    assert pc.scrape_interval_s("global: {}\n") == 60  # Prometheus' default


def test_rate_interval_is_grafanas() -> None:
    assert pc.rate_interval(15, 5) == "60s"  # 4 × scrape interval
    assert pc.rate_interval(1, 10) == "11s"  # $__interval + scrape interval


@pytest.mark.parametrize(
    "expr", ["rate(x[$w])", "rate(x[${w}])", "rate(x[${w:raw}])", "rate(x[[[w]]])"]
)
def test_every_grafana_variable_syntax_is_substituted(expr: str) -> None:
    assert pc.substitute(expr, {"w": "1m"}) == "rate(x[1m])"


def test_an_undefined_variable_is_an_error_and_regex_groups_are_not_variables() -> None:
    with pytest.raises(KeyError, match=r"\$job"):
        pc.substitute('up{job="$job"}', {})
    replace = 'label_replace(up, "a", "$1", "job", "(.*)")'
    assert pc.substitute(replace, {}) == replace


def test_template_variables_take_their_current_value() -> None:
    dashboard: dict[str, Any] = {
        "templating": {
            "list": [
                {"name": "ds", "type": "datasource", "query": "prometheus", "current": {}},
                {"name": "run", "type": "custom", "current": {"value": "tiny"}},
                {"name": "job", "type": "query", "current": {"value": ["dapo-a", "dapo-b"]}},
            ]
        },
        "panels": [
            {"title": "A", "targets": [{"expr": 'up{run="$run", job=~"$job"}'}]},
            {
                "title": "row",
                "panels": [{"title": "B", "targets": [{"expr": "x[$__rate_interval]"}]}],
            },
            {"title": "text panel"},
        ],
    }
    assert pc.dashboard_variables(dashboard, {})["ds"] == "prometheus"
    assert pc.panel_queries(dashboard, {"__rate_interval": "60s"}) == [
        ("A", 'up{run="tiny", job=~"dapo-a|dapo-b"}'),
        ("B", "x[60s]"),
    ]


def test_every_dashboard_query_is_resolved() -> None:
    queries = pc.dashboard_queries("60s", "5s")
    targets = [t for p in DASHBOARD["panels"] for t in p.get("targets", []) if t.get("expr")]
    assert len(queries) == len(targets) >= 20
    assert not [q for _, q in queries if "$" in q or "[[" in q]
    assert any("[60s]" in q for _, q in queries)


def series(job: str, *values: str) -> dict[str, Any]:
    return {"metric": {"job": job}, "values": [[i, v] for i, v in enumerate(values)]}


def test_a_job_counts_as_up_after_one_successful_scrape(monkeypatch) -> None:
    answer = [series("dapo-learner", "0", "1", "0"), series("dapo-rollout", "0", "0")]
    monkeypatch.setattr(pc, "query_range", lambda *a: answer)
    jobs = ["dapo-learner", "dapo-rollout", "dapo-reward"]
    assert pc.jobs_never_up("http://p", jobs, 0, 10, 5) == ["dapo-rollout", "dapo-reward"]


def test_queries_without_series_are_reported(monkeypatch) -> None:
    answers = {"a": [series("x", "1")], "b": []}
    monkeypatch.setattr(pc, "query_range", lambda url, q, *a: answers[q])
    assert pc.empty_queries("http://p", [("A", "a"), ("B", "b")], 0, 10, 5) == [("B", "b")]
