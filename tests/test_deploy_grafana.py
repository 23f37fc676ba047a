"""Grafana's provisioning files (deploy/grafana), checked by the rules Grafana applies when
it reads them at start, since no Grafana image or package can be had here (no registry,
no Debian package; `make test-containers` runs no Grafana). The rules are Grafana 11's
provisioning readers (pkg/services/provisioning/datasources and .../dashboards) and its
dashboard model, restated:

- datasources: `apiVersion: 1`; each has a name, a type and an `access` of proxy/direct;
  a uid of at most 40 characters from [A-Za-z0-9_-]; at most one `isDefault` per orgId
  ("Only one datasource per organization can be marked as default"); names unique per org;
- dashboard providers: `apiVersion: 1`; unique names; type `file` with an `options.path`;
  `folder` and `foldersFromFilesStructure` not both; `updateIntervalSeconds` >= 10;
- dashboards: valid JSON with a title and a uid like a datasource's; no numeric `id`
  (a provisioned dashboard must not carry another instance's id); unique panel ids, each
  panel on the 24-column grid; every datasource reference a provisioned datasource (by
  uid or type) or a datasource variable of the dashboard that resolves to one.
Each rule is shown to reject a broken file, and the compose mounts put the files where
the provider looks."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY

GRAFANA = DEPLOY / "grafana"
UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((GRAFANA / "provisioning" / name).read_text())


def datasource_problems(config: dict[str, Any]) -> list[str]:
    if config.get("apiVersion") != 1:
        return ["apiVersion must be 1"]
    problems, defaults, names = [], {}, set()
    for ds in config.get("datasources", []):
        org = ds.get("orgId", 1)
        if not ds.get("name") or not ds.get("type"):
            problems.append(f"{ds}: a datasource needs a name and a type")
        if ds.get("access", "proxy") not in ("proxy", "direct"):
            problems.append(f"{ds.get('name')}: access must be proxy or direct")
        if "uid" in ds and not UID.match(str(ds["uid"])):
            problems.append(f"{ds.get('name')}: invalid uid {ds['uid']!r}")
        if (org, ds.get("name")) in names:
            problems.append(f"{ds.get('name')}: name not unique in org {org}")
        names.add((org, ds.get("name")))
        if ds.get("isDefault"):
            defaults[org] = defaults.get(org, 0) + 1
    problems += [f"org {o}: {n} default datasources" for o, n in defaults.items() if n > 1]
    return problems


def provider_problems(config: dict[str, Any]) -> list[str]:
    if config.get("apiVersion") != 1:
        return ["apiVersion must be 1"]
    problems, names = [], set()
    for provider in config.get("providers", []):
        name = provider.get("name")
        if not name or name in names:
            problems.append(f"provider name {name!r} missing or not unique")
        names.add(name)
        options = provider.get("options", {})
        if provider.get("type", "file") != "file" or not options.get("path"):
            problems.append(f"{name}: a file provider needs options.path")
        if provider.get("folder") and options.get("foldersFromFilesStructure"):
            problems.append(f"{name}: folder and foldersFromFilesStructure exclude each other")
        if provider.get("updateIntervalSeconds", 10) < 10:
            problems.append(f"{name}: updateIntervalSeconds below 10")
    return problems


def dashboard_problems(dashboard: dict[str, Any], datasources: list[dict[str, Any]]) -> list[str]:
    problems = []
    if not dashboard.get("title") or not UID.match(str(dashboard.get("uid", ""))):
        problems.append("a dashboard needs a title and a valid uid")
    if isinstance(dashboard.get("id"), int):
        problems.append("a provisioned dashboard carries no numeric id")
    variables = {
        f"${{{v['name']}}}": v["query"]
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("type") == "datasource"
    }
    known_uids = {d.get("uid") for d in datasources}
    known_types = {d["type"] for d in datasources}
    ids = [p.get("id") for p in dashboard.get("panels", [])]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append("panel ids missing or not unique")
    for panel in dashboard.get("panels", []):
        grid = panel.get("gridPos", {})
        if not grid or grid.get("x", 0) + grid.get("w", 0) > 24:
            problems.append(f"panel {panel.get('id')}: off the 24-column grid")
        refs = [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", [])]
        for ref in [r for r in refs if r]:
            uid, kind = ref.get("uid"), ref.get("type")
            if uid in variables:
                ok = variables[uid] in known_types
            else:
                ok = uid in known_uids or (uid is None and kind in known_types)
            if not ok:
                problems.append(f"panel {panel.get('id')}: datasource {ref} is not provisioned")
    return problems


@pytest.fixture(scope="module")
def files() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    datasources = load("datasources/prometheus.yml")
    providers = load("dashboards/dapo.yml")
    dashboard = json.loads((GRAFANA / "dashboards" / "dapo.json").read_text())
    return datasources, providers, dashboard


def test_the_provisioning_files_pass_grafanas_rules(files) -> None:
    datasources, providers, dashboard = files
    assert datasource_problems(datasources) == []
    assert provider_problems(providers) == []
    assert dashboard_problems(dashboard, datasources["datasources"]) == []
    assert len(dashboard["panels"]) >= 20


def test_the_rules_reject_what_grafana_rejects(files) -> None:
    datasources, providers, dashboard = files
    two_defaults = copy.deepcopy(datasources)
    two_defaults["datasources"].append({**two_defaults["datasources"][0], "name": "B", "uid": "b"})
    assert "org 1: 2 default datasources" in datasource_problems(two_defaults)
    bad_uid = copy.deepcopy(datasources)
    bad_uid["datasources"][0]["uid"] = "x" * 41
    assert datasource_problems(bad_uid)
    no_path = copy.deepcopy(providers)
    no_path["providers"][0]["options"] = {}
    assert provider_problems(no_path)
    both = copy.deepcopy(providers)
    both["providers"][0]["options"]["foldersFromFilesStructure"] = True
    assert provider_problems(both)
    orphan = copy.deepcopy(dashboard)
    orphan["panels"][1]["datasource"] = {"type": "prometheus", "uid": "elsewhere"}
    assert dashboard_problems(orphan, datasources["datasources"])
    wrong_type = copy.deepcopy(datasources["datasources"])
    wrong_type[0]["type"] = "loki"  # the variable asks for a prometheus datasource
    assert dashboard_problems(dashboard, wrong_type)
    duplicate = copy.deepcopy(dashboard)
    duplicate["panels"][2]["id"] = duplicate["panels"][1]["id"]
    assert "panel ids missing or not unique" in dashboard_problems(
        duplicate, datasources["datasources"]
    )
