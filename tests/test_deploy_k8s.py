"""Kubernetes manifests (deploy/k8s): rendered like kustomize, validated against the
Kubernetes API schemas of K8S_VERSION (kubernetes-validate, strict: unknown fields fail),
and checked for what the pipeline needs: probes, GPUs, DNS names for the registry,
selectors that match, references that resolve, the run config that loads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_deploy_tools import DEPLOY, K8S_VERSION, by_key, kustomize

from services.tools.config import load_config

K8S = DEPLOY / "k8s"
TARGETS = {
    "base": K8S / "base",
    "single-node": K8S / "overlays" / "single-node",
    "multi-node": K8S / "overlays" / "multi-node",
}
DAPO_ROLES = {"controller": 8004, "buffer": 8005, "reward": 8001, "rollout": 8002, "learner": 8003}
GPU_ROLES = {"learner", "rollout"}
WEIGHT_SOCKET_PORT = 50054  # learner.weight_socket_port: NetworkPolicies name the port
SECRET = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
# The oldest and newest APIs kubernetes-validate knows, and the one the docs name.
K8S_VERSIONS = ("1.25.0", K8S_VERSION, "1.37.0")


@pytest.fixture(scope="module", params=list(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(TARGETS[request.param])


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component label → the Deployment/StatefulSet/Job running it."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            out[obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]] = obj
    return out


def pod_labels(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for w in workloads(objects).values()]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def probe_target(probe: dict[str, Any]) -> str:
    """'8003/readyz' for an HTTP probe or an exec probe that fetches that URL."""
    if "httpGet" in probe:
        assert probe["httpGet"]["port"] == "http"
        return f"{{http}}{probe['httpGet']['path']}"
    command = " ".join(probe["exec"]["command"])
    port, path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", command).groups()  # type: ignore[union-attr]
    assert '[ "$NODE_RANK" != 0 ] ||' in command  # only node 0 serves HTTP
    return f"{port}{path}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_for_the_named_kubernetes_version(rendered, version: str) -> None:
    name, objects = rendered
    assert len(objects) >= 20
    for obj in [*objects, SECRET]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
            raise AssertionError(f"{where}: {exc}") from None


def test_validator_rejects_a_broken_manifest() -> None:
    objects = by_key(kustomize(TARGETS["base"]))
    bad = objects[("StatefulSet", "rollout")]
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_renderer_matches_kubectl_kustomize(rendered) -> None:
    name, objects = rendered
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the Python renderer alone was checked")
    out = subprocess.run([kubectl, "kustomize", str(TARGETS[name])], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    theirs = by_key([d for d in yaml.safe_load_all(out) if d])
    assert theirs == by_key(objects)


def test_each_role_runs_with_probes_resources_and_scrape_annotations(rendered) -> None:
    name, objects = rendered
    found = workloads(objects)
    assert set(DAPO_ROLES) | {"redis"} <= set(found), name
    for role, http_port in DAPO_ROLES.items():
        template = found[role]["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(http_port)
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        (container,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == http_port
        assert f"{http_port}" in container["args"]  # the service really listens there
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            target = probe_target(container[probe]).replace("{http}", str(ports["http"]))
            assert target == f"{http_port}{path}", (role, probe)
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests)
        assert ("nvidia.com/gpu" in requests) == (role in GPU_ROLES), role
        env = {e["name"]: e for e in container["env"]}
        assert env[f"DAPO_{role.upper()}__SERVER__HOST"]["value"] == "0.0.0.0"
        url = env["DAPO_SHARED__REDIS_URL"]["value"]
        assert url.startswith("redis://:$(REDIS_PASSWORD)@redis:6379")
        # $(VAR) expands only for variables defined earlier in the list.
        assert list(env).index("REDIS_PASSWORD") < list(env).index("DAPO_SHARED__REDIS_URL")


def test_registered_services_have_resolvable_hostnames(rendered) -> None:
    """reward, rollout and learner announce socket.gethostname() in the Redis registry;
    with a headless Service and setHostnameAsFQDN that name resolves cluster-wide."""
    _, objects = rendered
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for role in ("reward", "rollout", "learner"):
        workload = workloads(objects)[role]
        spec = workload["spec"]["template"]["spec"]
        assert spec["setHostnameAsFQDN"] is True
        headless = workload["spec"].get("serviceName") or spec["subdomain"]
        assert headless == role and services[headless]["spec"]["clusterIP"] == "None"


def test_learner_is_an_indexed_job_with_one_pod_per_node(rendered) -> None:
    name, objects = rendered
    job = by_key(objects)[("Job", "learner")]
    spec = job["spec"]
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == int(env["NNODES"]), name
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == env["GPUS_PER_NODE"]
    assert "--master-addr=learner-0.learner" in container["args"]
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    assert by_key(objects)[("Service", "learner")]["spec"]["publishNotReadyAddresses"] is True


def test_overlays_size_the_gpus() -> None:
    single = by_key(kustomize(TARGETS["single-node"]))
    multi = by_key(kustomize(TARGETS["multi-node"]))
    assert single[("StatefulSet", "rollout")]["spec"]["replicas"] == 4
    assert multi[("StatefulSet", "rollout")]["spec"]["replicas"] == 24
    job = multi[("Job", "learner")]["spec"]["template"]["spec"]
    assert job["nodeSelector"] == {"dapo.io/pool": "learner"}
    rollout = multi[("StatefulSet", "rollout")]["spec"]["template"]["spec"]
    assert rollout["nodeSelector"] == {"dapo.io/pool": "rollout"}
    assert rollout["topologySpreadConstraints"][0]["maxSkew"] == 1


def test_placeholder_secret_is_never_applied(rendered) -> None:
    """`kubectl apply -k` must not overwrite the cluster's real Secret with placeholders."""
    _, objects = rendered
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert SECRET["metadata"] == {**SECRET["metadata"], "name": "dapo-secrets", "namespace": "dapo"}


def test_selectors_match_pods(rendered) -> None:
    _, objects = rendered
    labels = pod_labels(objects)

    def matched(selector: dict[str, Any]) -> bool:
        return any(selects(selector, pod) for pod in labels)

    for obj in objects:
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind == "Service":
            assert matched({"matchLabels": spec["selector"]}), obj["metadata"]
        elif kind == "PodDisruptionBudget":
            assert matched(spec["selector"]), obj["metadata"]
        elif kind == "NetworkPolicy":
            assert spec["podSelector"] == {} or matched(spec["podSelector"]), obj["metadata"]
            peers = [p for rule in spec.get("ingress", []) for p in rule["from"]]
            local = [p["podSelector"] for p in peers if "namespaceSelector" not in p]
            assert all(matched(selector) for selector in local), obj["metadata"]


def test_volumes_config_and_secrets_resolve(rendered) -> None:
    _, objects = rendered
    names = {kind: {o["metadata"]["name"]: o for o in [*objects, SECRET] if o["kind"] == kind}
             for kind in ("Secret", "ConfigMap", "PersistentVolumeClaim")}  # fmt: skip
    for workload in workloads(objects).values():
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volumes |= {
            t["metadata"]["name"]: t for t in workload["spec"].get("volumeClaimTemplates", [])
        }
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in names["ConfigMap"]
            if "persistentVolumeClaim" in volume:
                assert (
                    volume["persistentVolumeClaim"]["claimName"] in names["PersistentVolumeClaim"]
                )
        for container in pod["containers"]:
            refs = [e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
            for ref in refs:
                assert ref["key"] in names["Secret"][ref["name"]]["stringData"], ref
            assert {m["name"] for m in container.get("volumeMounts", [])} <= set(volumes)


def test_network_policies_allow_exactly_the_pipeline_flows() -> None:
    objects = kustomize(TARGETS["base"])
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = next(p for p in policies if p["spec"]["podSelector"] == {})
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"} and "ingress" not in deny
    pods = {p["app.kubernetes.io/component"]: p for p in pod_labels(objects)}

    def allowed(src: str, dst: str, port: int) -> bool:
        for policy in policies:
            if not selects(policy["spec"]["podSelector"], pods[dst]):
                continue
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                peers = [p["podSelector"] for p in rule["from"] if "namespaceSelector" not in p]
                if (not ports or port in ports) and any(selects(s, pods[src]) for s in peers):
                    return True
        return False

    assert allowed("controller", "reward", 50051)
    assert allowed("controller", "rollout", 50052)
    assert allowed("rollout", "learner", 50053)
    assert allowed("rollout", "learner", WEIGHT_SOCKET_PORT)
    assert allowed("controller", "learner", WEIGHT_SOCKET_PORT)  # dapo eval fetches weights
    assert allowed("learner", "learner", 29500)
    assert all(allowed(role, "redis", 6379) for role in DAPO_ROLES)
    assert not allowed("buffer", "rollout", 50052)
    assert not allowed("rollout", "reward", 50051)
    assert not allowed("reward", "learner", 29500)
    assert not allowed("buffer", "learner", WEIGHT_SOCKET_PORT)


def test_the_run_config_in_the_configmap_loads(rendered, tmp_path: Path) -> None:
    _, objects = rendered
    path = tmp_path / "run.yaml"
    path.write_text(by_key(objects)[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"])
    for role in DAPO_ROLES:  # with the environment each pod adds
        env = {"DAPO_SHARED__REDIS_URL": "redis://:pw@redis:6379/0",
               f"DAPO_{role.upper()}__SERVER__HOST": "0.0.0.0"}  # fmt: skip
        config = load_config(path, env=env)
        assert config.rollout.engine.kind == "vllm"
        assert config.model_path == "/models/policy"
        assert getattr(config, role).server.host == "0.0.0.0"


def test_the_learner_weight_socket_listens_on_the_port_that_is_exposed(
    rendered, tmp_path: Path
) -> None:
    """Port 0 (any free port) would be dropped by the NetworkPolicies: the learner pod's
    config must name the fixed port its container, Service and policies expose."""
    _, objects = rendered
    path = tmp_path / "run.yaml"
    path.write_text(by_key(objects)[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"])
    container = by_key(objects)[("Job", "learner")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"].replace("$(REDIS_PASSWORD)", "pw")
           for e in container["env"] if e["name"].startswith("DAPO_")}  # fmt: skip
    learner = load_config(path, env=env).learner
    assert learner.weight_transport == "socket"
    assert learner.weight_socket_port == WEIGHT_SOCKET_PORT
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["weights"] == WEIGHT_SOCKET_PORT
    service = by_key(objects)[("Service", "learner")]["spec"]["ports"]
    assert {p["name"]: p["port"] for p in service}["weights"] == WEIGHT_SOCKET_PORT
