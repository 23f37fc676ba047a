"""What a live Prometheus saw of a run: every scrape job up at some point, and every
Grafana panel query of deploy/grafana/dashboards/dapo.json returning data.

Standard library only: scripts/test_containers.sh runs it with the host's python3 against
the compose stack's Prometheus; tests/test_deploy_scrape.py imports it for a `dapo up` run.

    python3 scripts/prometheus_checks.py --url http://127.0.0.1:9090 --since EPOCH
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dapo.json"
# Grafana's template syntaxes: $name, ${name}, ${name:format}, [[name]].
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\[\[([A-Za-z_]\w*)\]\]|\$([A-Za-z_]\w*)")


def api(url: str, path: str, **params: str) -> Any:
    """GET /api/v1/PATH; its `data`, or AssertionError with the body if not a success."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=30) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def scrape_jobs(config_text: str) -> list[str]:
    """The job names of a Prometheus config (a regex: the host may have no PyYAML)."""
    return re.findall(r"^\s*-\s*job_name:\s*[\"']?([\w.-]+)", config_text, re.M)


def scrape_interval_s(config_text: str) -> float:
    """The global scrape_interval in seconds (Prometheus' default 1m if unset)."""
    match = re.search(r"^\s+scrape_interval:\s*(\d+)([smh])\s*$", config_text, re.M)
    if not match:
        return 60.0
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


def rate_interval(scrape_s: float, interval_s: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 × scrape interval)."""
    return f"{round(max(interval_s + scrape_s, 4 * scrape_s))}s"


def dashboard_variables(dashboard: dict[str, Any], builtins: dict[str, str]) -> dict[str, str]:
    """Grafana's built-ins as given, plus each template variable at its current value (a
    datasource variable names the datasource, which no query text needs)."""
    values = dict(builtins)
    for var in dashboard.get("templating", {}).get("list", []):
        current = var.get("current", {}).get("value")
        if var.get("type") == "datasource":
            values[var["name"]] = current or var.get("query", "")
        elif isinstance(current, list):
            values[var["name"]] = "|".join(current)
        elif current is not None:
            values[var["name"]] = str(current)
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """EXPR with every dashboard variable replaced; KeyError names one it does not define."""

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"{expr!r} uses ${name}, which the dashboard does not define")
        return values[name]

    return VARIABLE.sub(value, expr)


def panel_queries(dashboard: dict[str, Any], builtins: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows' panels included."""
    values = dashboard_variables(dashboard, builtins)
    panels = list(dashboard.get("panels", []))
    panels += [p for row in panels for p in row.get("panels", [])]
    return [
        (panel.get("title", "?"), substitute(target["expr"], values))
        for panel in panels
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def dashboard_queries(rate: str, interval: str | None = None) -> list[tuple[str, str]]:
    """The checked-in dashboard's queries with $__rate_interval = RATE and $__interval =
    INTERVAL (default RATE), as Grafana would send them."""
    dashboard = json.loads(DASHBOARD.read_text())
    return panel_queries(dashboard, {"__rate_interval": rate, "__interval": interval or rate})


def query_range(url: str, expr: str, start: float, end: float, step_s: float) -> list[Any]:
    params = dict(query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}s")
    return api(url, "query_range", **params)["result"]


def jobs_never_up(url: str, jobs: list[str], start: float, end: float, step_s: float) -> list[str]:
    """The JOBS without a single successful scrape (up == 1) between START and END."""
    series = query_range(url, "max by (job) (up)", start, end, step_s)
    seen = {s["metric"].get("job") for s in series if any(v == "1" for _, v in s["values"])}
    return [job for job in jobs if job not in seen]


def empty_queries(
    url: str, queries: list[tuple[str, str]], start: float, end: float, step_s: float
) -> list[tuple[str, str]]:
    """The (title, PromQL) that return no series between START and END (a PromQL error
    raises instead)."""
    return [(t, q) for t, q in queries if not query_range(url, q, start, end, step_s)]


# Panels no CPU stack can fill, with why (the container test runs the torch engine).
NOT_ON_CPU = {
    "KV-cache use per rollout server": "vLLM only: the torch engine has no KV-cache pool",
}


def check(url: str, config: str, since: float, step_s: float) -> list[str]:
    """Every problem found over [since, now]: jobs of CONFIG (the text of the Prometheus
    config at URL) never up, panel queries with no data."""
    jobs, end = scrape_jobs(config), time.time()
    rate = rate_interval(scrape_interval_s(config), step_s)
    queries = dashboard_queries(rate, f"{step_s:g}s")
    for title, why in NOT_ON_CPU.items():
        print(f"panel {title!r} not checked: {why}")
    queries = [(t, q) for t, q in queries if t not in NOT_ON_CPU]
    print(f"{len(jobs)} scrape jobs, {len(queries)} panel queries, {end - since:.0f} s window")
    problems = [f"job {job} never up" for job in jobs_never_up(url, jobs, since, end, step_s)]
    empty = empty_queries(url, queries, since, end, step_s)
    return problems + [f"panel {title!r}: no data for {q}" for title, q in empty]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="Prometheus, e.g. http://127.0.0.1:9090")
    parser.add_argument("--config", type=Path, default=PROMETHEUS_CONFIG, help="its config")
    parser.add_argument("--since", type=float, required=True, help="the run's start (epoch s)")
    parser.add_argument("--step", type=float, default=5.0, help="query_range step in seconds")
    args = parser.parse_args(argv)
    problems = check(args.url, args.config.read_text(), args.since, args.step)
    for problem in problems:
        print(f"FAILED: {problem}")
    print("prometheus checks: " + ("FAILED" if problems else "every job up, every panel has data"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
