"""Elastic rollout servers and node drains on Kubernetes (deploy/k8s/autoscaling).

kubernetes-validate has no schemas for custom resources, so KEDA's ScaledObject and
TriggerAuthentication are checked against the minimal schema below (the fields we use,
their types, nothing unknown); everything else in the autoscaling overlays is validated
strictly for the oldest and newest Kubernetes APIs the validator knows. Then what makes
the objects work: the stream is the one the controller writes, the target and the secret
exist, the max is reachable, drains have time to finish, PDBs let a node drain.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_deploy_k8s import K8S, K8S_VERSIONS, SECRET, selects
from test_deploy_tools import ROOT, by_key, kustomize

from services.common.keys import RunKeys
from services.tools.config import load_config

OVERLAYS = {"single-node-keda": (1, 4), "multi-node-keda": (8, 24), "multi-node-hpa": (8, 24)}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
_str = {"type": "string", "minLength": 1}
_int = {"type": "integer", "minimum": 0}
_meta = {"type": "object", "required": ["name"], "properties": {"name": _str}}
SCALED_OBJECT = {  # keda.sh/v1alpha1, the fields these manifests use
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"apiVersion": {"const": "keda.sh/v1alpha1"}, "metadata": _meta, "spec": {
        "type": "object", "additionalProperties": False,
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"apiVersion": _str, "kind": _str, "name": _str}},
            "minReplicaCount": _int, "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": _int, "cooldownPeriod": _int, "advanced": {"type": "object"},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                "properties": {"type": _str, "authenticationRef": _meta, "metadata": {
                    "type": "object", "additionalProperties": {"type": "string"}}}}},
        }}},
}  # fmt: skip
TRIGGER_AUTH = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"apiVersion": {"const": "keda.sh/v1alpha1"}, "metadata": _meta, "spec": {
        "type": "object", "additionalProperties": False, "properties": {"secretTargetRef": {
            "type": "array", "items": {
                "type": "object", "required": ["parameter", "name", "key"],
                "additionalProperties": False,
                "properties": {"parameter": _str, "name": _str, "key": _str}}}}}},
}  # fmt: skip
SCHEMAS = {"ScaledObject": SCALED_OBJECT, "TriggerAuthentication": TRIGGER_AUTH}


@pytest.fixture(scope="module", params=list(OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], Any]]:
    return request.param, by_key(kustomize(K8S / "overlays" / request.param))


def run_config(objects: dict[tuple[str, str], Any], tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text(objects[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"])
    return load_config(path)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(rendered, version: str) -> None:
    name, objects = rendered
    for obj in objects.values():
        if obj["kind"] in KEDA_KINDS:
            jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        else:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = f"{name} {obj['kind']}/{obj['metadata']['name']}"
                raise AssertionError(f"{where}: {exc}") from None


def test_the_keda_schema_rejects_what_keda_would() -> None:
    good = by_key(kustomize(K8S / "overlays" / "single-node-keda"))[("ScaledObject", "rollout")]
    broken = [
        {**good, "spec": {**good["spec"], "maxReplicas": 4}},  # the HPA's spelling
        {**good, "spec": {**good["spec"], "triggers": []}},
        {**good, "spec": {**good["spec"], "triggers": [{"type": "redis-streams", "metadata":
                                                        {"streamLength": 8}}]}},  # not a string
    ]  # fmt: skip
    for obj in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(obj, SCALED_OBJECT)


def test_the_scaler_reads_the_stream_the_controller_writes(rendered, tmp_path: Path) -> None:
    name, objects = rendered
    lo, hi = OVERLAYS[name]
    config = run_config(objects, tmp_path)
    rollout = objects[("StatefulSet", "rollout")]
    if name.endswith("-hpa"):
        hpa = objects[("HorizontalPodAutoscaler", "rollout")]["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (lo, hi)
        assert hpa["scaleTargetRef"]["name"] == "rollout"
        metric = hpa["metrics"][0]["external"]["metric"]["name"]
        assert metric in (ROOT / "services" / "controller" / "server.py").read_text()
        return
    scaled = objects[("ScaledObject", "rollout")]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                        "name": rollout["metadata"]["name"]}  # fmt: skip
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (lo, hi)
    assert lo <= rollout["spec"]["replicas"] <= hi  # the overlay's start is in range
    trigger = scaled["triggers"][0]
    assert trigger["type"] == "redis-streams" and "consumerGroup" not in trigger["metadata"]
    assert trigger["metadata"]["stream"] == RunKeys(config.shared.run_name).generating
    host, port = trigger["metadata"]["address"].rsplit(":", 1)
    assert host == "redis.dapo.svc.cluster.local" and ("Service", "redis") in objects
    assert int(port) == 6379
    per_server = int(trigger["metadata"]["streamLength"])
    assert hi * per_server <= config.controller.max_groups_in_flight  # the max is reachable
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    ref = auth["spec"]["secretTargetRef"][0]
    assert ref["name"] == SECRET["metadata"]["name"] and ref["key"] in SECRET["stringData"]
    keda_in = objects[("NetworkPolicy", "ingress-redis-from-keda")]["spec"]
    redis_pod = objects[("StatefulSet", "redis")]["spec"]["template"]["metadata"]["labels"]
    assert selects(keda_in["podSelector"], redis_pod)


def test_a_node_drain_is_allowed_and_waited_for(rendered, tmp_path: Path) -> None:
    _, objects = rendered
    config = run_config(objects, tmp_path)
    pdb = {n: o["spec"] for (k, n), o in objects.items() if k == "PodDisruptionBudget"}
    assert pdb["rollout"]["maxUnavailable"] == pdb["redis"]["maxUnavailable"] == 1
    assert pdb["learner"] == {**pdb["learner"], "minAvailable": 0}  # a Job cannot scale
    rollout = objects[("StatefulSet", "rollout")]["spec"]["template"]["spec"]
    assert rollout["terminationGracePeriodSeconds"] > config.rollout.drain_timeout_s + 10
    job = objects[("Job", "learner")]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    rule = job["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "Ignore"
    assert rule["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    redis = objects[("StatefulSet", "redis")]["spec"]
    args = " ".join(redis["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in args and redis["volumeClaimTemplates"]


def test_renderer_matches_kubectl_kustomize(rendered) -> None:
    name, objects = rendered
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the Python renderer alone was checked")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / name)],
                         capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    assert by_key([d for d in yaml.safe_load_all(out) if d]) == objects
