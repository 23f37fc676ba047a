"""Elastic rollout servers and node drains on Kubernetes, over every overlay that
`kubectl kustomize` renders: what an autoscaler reads exists in the code (a `/metrics`
name the services export, a Redis stream the controller writes, both found in the source,
not in a list here), the autoscaler owns the replica count alone, its max is reachable,
and every PodDisruptionBudget lets a node drain through."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from deploy_tools import ROOT, by_key
from test_deploy_k8s import (
    SECRET,
    TARGETS,
    container_of,
    pod_templates,
    render,
    run_config_of,
    selects,
    workloads,
)
from test_deploy_monitoring import metrics_in_registry, metrics_in_source

from services.common.keys import RunKeys

AUTOSCALED = [name for name in TARGETS if name.endswith(("-keda", "-hpa", "-rdma", "-production"))]


@pytest.fixture(scope="module", params=list(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], Any]]:
    return request.param, by_key(render(request.param))


@pytest.fixture(scope="module")
def exported_metrics() -> set[str]:
    """Every sample name the services export (from their source; dynamic names imported)."""
    out, dynamic = metrics_in_source()
    return set(out) | set(metrics_in_registry(dynamic))


def streams_written() -> set[str]:
    """RunKeys properties the code XADDs to (`….xadd(keys.NAME, …)` anywhere)."""
    found = set()
    for package in ("services", "rollout", "reward", "learner"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr == "xadd" and node.args:
                    key = node.args[0]
                    if isinstance(key, ast.Attribute):
                        found.add(key.attr)
    return found


def autoscalers(objects: dict[tuple[str, str], Any]) -> list[dict[str, Any]]:
    return [o for (k, _), o in objects.items() if k in ("ScaledObject", "HorizontalPodAutoscaler")]


def replica_range(objects: dict[tuple[str, str], Any], workload: dict[str, Any]) -> tuple[int, int]:
    """(min, max) replicas of a workload: its autoscaler's range, else its pinned count."""
    name = workload["metadata"]["name"]
    for scaler in autoscalers(objects):
        spec = scaler["spec"]
        if spec["scaleTargetRef"]["name"] == name:
            if scaler["kind"] == "ScaledObject":
                return spec.get("minReplicaCount", 0), spec["maxReplicaCount"]
            return spec.get("minReplicas", 1), spec["maxReplicas"]
    count = workload["spec"].get("replicas", 1)
    return count, count


def test_overlays_with_an_autoscaler_exist() -> None:
    assert {"single-node-keda", "multi-node-keda", "multi-node-hpa"} <= set(AUTOSCALED)


def test_every_autoscaler_reads_what_the_code_writes(
    rendered, exported_metrics: set[str], tmp_path: Path
) -> None:
    name, objects = rendered
    config = run_config_of(list(objects.values()), tmp_path)
    for scaler in autoscalers(objects):
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) in objects, (name, target)
        if scaler["kind"] == "HorizontalPodAutoscaler":
            for metric in scaler["spec"]["metrics"]:
                assert metric["external"]["metric"]["name"] in exported_metrics, (name, metric)
            continue
        for trigger in scaler["spec"]["triggers"]:
            assert trigger["type"] == "redis-streams" and "consumerGroup" not in trigger["metadata"]
            stream = trigger["metadata"]["stream"]
            keys = RunKeys(config.shared.run_name)
            written = {getattr(keys, prop) for prop in streams_written()}
            assert stream in written, f"{name}: {stream} is no stream the code writes {written}"
            host, port = trigger["metadata"]["address"].rsplit(":", 1)
            # No cluster domain: the KEDA pod's search path completes it, whatever it is.
            assert host == "redis.dapo.svc" and ("Service", "redis") in objects
            assert int(port) == 6379
            auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
            for ref in auth["spec"]["secretTargetRef"]:
                if ref["name"] == SECRET["metadata"]["name"]:
                    assert ref["key"] in SECRET["stringData"]
            tls = objects[("ConfigMap", "dapo-redis")]["data"]["tls"] == "true"
            assert (trigger["metadata"].get("enableTLS") == "true") == tls, name


def test_the_scaler_finds_the_code_written_stream_and_not_others() -> None:
    assert "generating" in streams_written()  # the controller's backlog stream
    assert "version" not in streams_written()  # a plain key, not a stream


def test_the_autoscaler_alone_owns_the_replica_count(rendered) -> None:
    """A pinned `replicas` would reset what KEDA/the HPA chose on every `kubectl apply`."""
    name, objects = rendered
    for scaler in autoscalers(objects):
        target = objects[
            (scaler["spec"]["scaleTargetRef"]["kind"], scaler["spec"]["scaleTargetRef"]["name"])
        ]
        assert "replicas" not in target["spec"], f"{name}: {target['metadata']['name']} pinned"


def test_the_max_is_reachable(rendered, tmp_path: Path) -> None:
    """replicas = ceil(length / per-server target): max × target must not exceed the
    most groups the controller keeps in flight, or the max is never reached."""
    name, objects = rendered
    config = run_config_of(list(objects.values()), tmp_path)
    for scaler in autoscalers(objects):
        spec = scaler["spec"]
        if scaler["kind"] == "ScaledObject":
            high, per_server = (
                spec["maxReplicaCount"],
                spec["triggers"][0]["metadata"]["streamLength"],
            )
        else:
            high, per_server = (
                spec["maxReplicas"],
                spec["metrics"][0]["external"]["target"]["averageValue"],
            )
        assert high * int(per_server) <= config.controller.max_groups_in_flight, name


def rollout_servers_per_node(objects: dict[tuple[str, str], Any]) -> int:
    """How many rollout pods one node holds: its GPUs (the overlay's dapo.io/gpus-per-node)
    over the GPUs one server requests."""
    rollout = objects[("StatefulSet", "rollout")]
    node_gpus = int(rollout["metadata"].get("annotations", {}).get("dapo.io/gpus-per-node", 8))
    per_pod = int(
        container_of(list(objects.values()), "rollout")["resources"]["requests"]["nvidia.com/gpu"]
    )
    return node_gpus // per_pod


def pdb_problems(objects: dict[tuple[str, str], Any]) -> list[str]:
    """Budgets that would block a drain: with every pod healthy a budget must allow a
    disruption, and for rollout servers as many as one node holds (a drain evicts them
    all while their replacements stay Pending, the GPUs being full)."""
    problems = []
    found = workloads(list(objects.values()))
    for (kind, name), pdb in objects.items():
        if kind != "PodDisruptionBudget":
            continue
        spec = pdb["spec"]
        covered = [
            w
            for w in found.values()
            if any(selects(spec["selector"], t["metadata"]["labels"]) for t in pod_templates(w))
        ]
        if not covered:
            problems.append(f"{name}: selects no pod")
            continue
        low, high = replica_range(objects, covered[0])
        if "maxUnavailable" in spec:
            allowed = int(spec["maxUnavailable"])
        else:
            allowed = low - int(spec["minAvailable"])
        if allowed < 1:
            problems.append(f"{name}: allows no disruption")
        if name == "rollout" and allowed < min(high, rollout_servers_per_node(objects)):
            problems.append(f"{name}: {allowed} down at once, a node holds more")
    return problems


def test_every_pdb_lets_a_node_drain(rendered) -> None:
    name, objects = rendered
    assert pdb_problems(objects) == [], name
    assert ("PodDisruptionBudget", "learner") not in objects  # the gang restarts instead


def test_the_pdb_check_catches_a_budget_that_blocks_a_drain() -> None:
    objects = by_key(render("multi-node"))
    assert rollout_servers_per_node(objects) == 2
    objects[("PodDisruptionBudget", "rollout")]["spec"]["maxUnavailable"] = 1
    assert pdb_problems(objects) == ["rollout: 1 down at once, a node holds more"]
    objects[("PodDisruptionBudget", "redis")]["spec"] = {
        "minAvailable": 1,
        "selector": objects[("PodDisruptionBudget", "redis")]["spec"]["selector"],
    }
    assert "redis: allows no disruption" in pdb_problems(objects)


def test_a_rollout_drain_finishes_within_the_grace_period(rendered, tmp_path: Path) -> None:
    name, objects = rendered
    config = run_config_of(list(objects.values()), tmp_path)
    rollout = objects[("StatefulSet", "rollout")]["spec"]["template"]["spec"]
    assert rollout["terminationGracePeriodSeconds"] > config.rollout.drain_timeout_s + 10
    redis = objects[("StatefulSet", "redis")]["spec"]
    script = " ".join(redis["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in script and redis["volumeClaimTemplates"]


def test_keda_reaches_redis_through_the_network_policy(rendered) -> None:
    name, objects = rendered
    if ("ScaledObject", "rollout") not in objects:
        return
    keda_in = objects[("NetworkPolicy", "ingress-redis-from-keda")]["spec"]
    redis_pod = objects[("StatefulSet", "redis")]["spec"]["template"]["metadata"]["labels"]
    assert selects(keda_in["podSelector"], redis_pod)
