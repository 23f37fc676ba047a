"""Kubernetes manifests (deploy/k8s), as `kubectl kustomize` renders every overlay:
validated against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields
fail; custom resources against the minimal schemas in test_deploy_crds.py), then checked
for how they behave in a cluster: every object in the namespace, every container probed,
sized and non-root, no secret in argv or the environment, no service-account token, the
learner a gang, GPUs that match the run config, the run config that the example says.

No API server can run here (docs/deploy.md, "How the files are checked"): behaviour is
read from the rendered objects, and where a manifest carries a command (Redis' start
script, the wait-for-model init container) that command is run for real."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_tools import CLUSTER_SCOPED, DEPLOY, K8S_VERSION, ROOT, by_key, kustomize
from test_deploy_crds import validate_crd

from services.tools.config import load_config

K8S = DEPLOY / "k8s"
NAMESPACE = "dapo"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
TARGETS = {"base": K8S / "base", **{name: K8S / "overlays" / name for name in OVERLAYS}}
DAPO_ROLES = {"controller": 8004, "buffer": 8005, "reward": 8001, "rollout": 8002, "learner": 8003}
GPU_ROLES = {"learner", "rollout"}
WEIGHT_SOCKET_PORT = 50054  # learner.publication.socket_port: NetworkPolicies name the port
SECRET = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
SECRET_MOUNT = "/var/run/secrets/dapo"
# The oldest and newest APIs kubernetes-validate knows, and the one the docs name.
K8S_VERSIONS = ("1.25.0", K8S_VERSION, "1.37.0")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "JobSet")


def render(name: str) -> list[dict[str, Any]]:
    return kustomize(TARGETS[name])


@pytest.fixture(scope="module", params=list(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


# ---------------------------------------------------------------- reading the objects
def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a workload (a JobSet's: one per replicated Job)."""
    if obj["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in obj["spec"]["replicatedJobs"]]
    if obj["kind"] in WORKLOAD_KINDS:
        return [obj["spec"]["template"]]
    return []


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component label → the workload running it."""
    out = {}
    for obj in objects:
        for template in pod_templates(obj):
            out[template["metadata"]["labels"]["app.kubernetes.io/component"]] = obj
    return out


def template_of(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return pod_templates(workloads(objects)[role])[0]


def container_of(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (container,) = template_of(objects, role)["spec"]["containers"]
    return container


def every_container(objects: list[dict[str, Any]]):
    """(workload name, pod spec, container, is_init) over every pod of every workload."""
    for obj in objects:
        for template in pod_templates(obj):
            spec = template["spec"]
            for container in spec["containers"]:
                yield obj["metadata"]["name"], spec, container, False
            for container in spec.get("initContainers", []):
                yield obj["metadata"]["name"], spec, container, True


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def pod_labels(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [t["metadata"]["labels"] for o in objects for t in pod_templates(o)]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def run_config_of(objects: list[dict[str, Any]], tmp_path: Path, env: dict[str, str] | None = None):
    """The run config the pods read (ConfigMap dapo-run-config), with `env` applied."""
    path = tmp_path / "run.yaml"
    path.write_text(by_key(objects)[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"])
    return load_config(path, env=env or {})


def dapo_env(objects: list[dict[str, Any]], role: str) -> dict[str, str]:
    """The DAPO_* variables of a role's container, ConfigMap references resolved."""
    configmaps = {
        o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"
    }
    out = {}
    for name, entry in env_of(container_of(objects, role)).items():
        if not name.startswith("DAPO_"):
            continue
        if "value" in entry:
            out[name] = entry["value"]
            continue
        ref = entry["valueFrom"]["configMapKeyRef"]
        value = configmaps[ref["name"]].get(ref["key"])
        assert value is not None or ref.get("optional"), (role, name)
        if value is not None:
            out[name] = value
    return out


def probe_target(probe: dict[str, Any]) -> str:
    """'8003/readyz' for an HTTP probe or an exec probe that fetches that URL."""
    if "httpGet" in probe:
        assert probe["httpGet"]["port"] == "http"
        return f"{{http}}{probe['httpGet']['path']}"
    command = " ".join(probe["exec"]["command"])
    port, path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", command).groups()  # type: ignore[union-attr]
    assert '[ "$NODE_RANK" != 0 ] ||' in command  # only node 0 serves HTTP
    return f"{port}{path}"


def probe_budget_s(probe: dict[str, Any]) -> int:
    """How long a probe may fail before the kubelet acts on it."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get(
        "failureThreshold", 3
    )


# ---------------------------------------------------------------- valid objects
# Every target against the API the docs name; the oldest and newest for the two that hold
# every kind of object (validation is slow: seconds per target and version).
VALIDATIONS = [(name, K8S_VERSION) for name in TARGETS] + [
    (name, version)
    for name in ("base", "multi-node-rdma")
    for version in K8S_VERSIONS
    if version != K8S_VERSION
]


@pytest.mark.parametrize(("name", "version"), VALIDATIONS)
def test_every_object_is_valid_for_the_named_kubernetes_version(name: str, version: str) -> None:
    objects = render(name)
    assert len(objects) >= 20
    for obj in [*objects, SECRET, *yaml.safe_load_all((K8S / "fill-volume.yaml").read_text())]:
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            if not validate_crd(obj, version):
                kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc}") from None


def test_validator_rejects_a_broken_manifest() -> None:
    objects = by_key(render("base"))
    bad = objects[("StatefulSet", "rollout")]
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_namespaced_object_is_in_the_namespace(rendered) -> None:
    """kustomize sets the namespace only on a kustomization's own resources: a component
    or a resource directory without `namespace:` lands in `default`."""
    name, objects = rendered
    stray = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in objects
        if o["kind"] not in CLUSTER_SCOPED and o["metadata"].get("namespace") != NAMESPACE
    ]
    assert not stray, f"{name}: outside namespace {NAMESPACE}: {stray}"


# ---------------------------------------------------------------- every container
def test_every_container_is_probed_sized_and_non_root(rendered) -> None:
    name, objects = rendered
    for workload, spec, container, init in every_container(objects):
        where = f"{name}: {workload}/{container['name']}"
        if not init:
            assert {"readinessProbe", "livenessProbe"} <= set(container), where
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), where
        assert "memory" in resources["limits"], where
        for key, count in resources["requests"].items():
            if "/" in key:  # extended resources (GPUs, RDMA): requests must equal limits
                assert resources["limits"][key] == count, (where, key)
        pod, own = spec["securityContext"], container["securityContext"]
        assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
        assert own.get("runAsUser", pod.get("runAsUser", 1)) != 0, where
        assert own["allowPrivilegeEscalation"] is False, where
        assert own["capabilities"]["drop"] == ["ALL"], where
        assert "add" not in own["capabilities"], where  # IPC_LOCK: nothing for uid 10001
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where


def test_no_pod_mounts_a_service_account_token(rendered) -> None:
    name, objects = rendered
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects:
        for template in pod_templates(obj):
            spec = template["spec"]
            assert spec["automountServiceAccountToken"] is False, (name, obj["metadata"]["name"])
            account = accounts[spec["serviceAccountName"]]
            assert account["automountServiceAccountToken"] is False


def test_no_secret_in_args_or_the_environment(rendered) -> None:
    """Secrets reach pods as files only: no secretKeyRef/envFrom, no password in a URL,
    argv or env value (they show in `ps`, /proc/*/environ and `kubectl describe`)."""
    name, objects = rendered
    placeholders = [v for v in SECRET["stringData"].values() if v]
    for workload, _spec, container, _ in every_container(objects):
        where = f"{name}: {workload}/{container['name']}"
        assert "envFrom" not in container, where
        for entry in container.get("env", []):
            assert "secretKeyRef" not in entry.get("valueFrom", {}), (where, entry["name"])
        words = [*container.get("command", []), *container.get("args", [])]
        words += [e.get("value", "") for e in container.get("env", [])]
        for word in words:
            assert not re.search(r"://[^/@\s]*:[^/@\s]*@", word), (where, word)  # user:pw@
            assert not re.search(r"--(requirepass|pass|password)\b|\$\(\w*PASSWORD\)", word), (
                where,
                word,
            )
            assert not [p for p in placeholders if p in word], where
    configmaps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert not [c for c in configmaps if "://:" in str(c.get("data"))], name


def test_secrets_are_mounted_files_the_services_read(rendered, tmp_path: Path) -> None:
    """Every dapo pod reads the Redis password from the Secret's file, and that file is
    there: the projected volume maps the Secret's key onto the configured path."""
    name, objects = rendered
    for role in DAPO_ROLES:
        env = dapo_env(objects, role)
        path = env["DAPO_SECURITY__REDIS__PASSWORD_FILE"]
        config = run_config_of(objects, tmp_path, env)
        assert config.security.redis.password_file == path
        assert config.security.redis.password is None and "@" not in config.shared.redis_url
        spec = template_of(objects, role)["spec"]
        (container,) = spec["containers"]
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        items = {
            i["path"]: (s["secret"]["name"], i["key"])
            for s in volume["projected"]["sources"]
            for i in s["secret"]["items"]
        }
        relative = path.removeprefix(mount["mountPath"] + "/")
        assert items[relative] == ("dapo-secrets", "redis-password"), (name, role)
        assert volume["projected"]["defaultMode"] & 0o007 == 0, "not world-readable"
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


# ---------------------------------------------------------------- the dapo roles
def test_each_role_runs_with_probes_resources_and_scrape_annotations(rendered) -> None:
    name, objects = rendered
    found = workloads(objects)
    assert set(DAPO_ROLES) | {"redis"} <= set(found), name
    for role, http_port in DAPO_ROLES.items():
        template = template_of(objects, role)
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(http_port)
        container = container_of(objects, role)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == http_port
        assert f"{http_port}" in container["args"]  # the service really listens there
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            target = probe_target(container[probe]).replace("{http}", str(ports["http"]))
            assert target == f"{http_port}{path}", (role, probe)
        requests = container["resources"]["requests"]
        assert ("nvidia.com/gpu" in requests) == (role in GPU_ROLES), role
        env = dapo_env(objects, role)
        assert env[f"DAPO_{role.upper()}__SERVER__HOST"] == "0.0.0.0"
        assert env["DAPO_SHARED__REDIS_URL"].startswith(
            ("redis://redis:6379", "rediss://redis:6379")
        )


def test_finished_services_idle_instead_of_crash_looping(rendered, tmp_path: Path) -> None:
    """A Deployment or StatefulSet restarts a pod that exits, even with 0: those roles run
    with shared.when_done=idle (they stay up, ready and idle: tests/test_when_done_idle.py);
    the learner, which ends the run, is a JobSet whose pods complete."""
    name, objects = rendered
    for role in DAPO_ROLES:
        kind = workloads(objects)[role]["kind"]
        config = run_config_of(objects, tmp_path, dapo_env(objects, role))
        if kind in ("Deployment", "StatefulSet"):
            assert config.shared.when_done == "idle", (name, role)
        else:
            assert kind == "JobSet" and config.shared.when_done == "exit", (name, role)


def test_registered_services_have_resolvable_hostnames(rendered) -> None:
    """reward, rollout and learner announce socket.gethostname() in the Redis registry;
    with a headless Service and setHostnameAsFQDN that name resolves cluster-wide."""
    _, objects = rendered
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for role in ("reward", "rollout"):
        workload = workloads(objects)[role]
        assert workload["spec"]["template"]["spec"]["setHostnameAsFQDN"] is True
        headless = workload["spec"]["serviceName"]
        assert headless == role and services[headless]["spec"]["clusterIP"] == "None"
    learner = workloads(objects)["learner"]
    network = learner["spec"]["network"]  # JobSet makes the headless Service itself
    assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True
    assert network["subdomain"] not in services, "JobSet creates that Service"
    assert template_of(objects, "learner")["spec"]["setHostnameAsFQDN"] is True


# ---------------------------------------------------------------- the learner gang
def learner_parts(objects: list[dict[str, Any]]) -> tuple[dict, dict, dict, dict[str, Any]]:
    jobset = by_key(objects)[("JobSet", "learner")]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    return jobset, replicated, job, env


def test_learner_group_restarts_as_a_whole_and_resumes(rendered, tmp_path: Path) -> None:
    """Gang semantics: one failed pod fails its Job at once (backoffLimit 0, no pod
    replaced alone), a failed Job makes the JobSet recreate every Job of the group
    (restartStrategy Recreate) up to maxRestarts, and a drain's eviction (DisruptionTarget)
    fails the Job with reason PodFailurePolicy, which restarts the group without counting.
    Every rank then resumes from the checkpoint directory on the shared volume."""
    name, objects = rendered
    jobset, replicated, job, env = learner_parts(objects)
    policy = jobset["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "Recreate" and policy["maxRestarts"] >= 1
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    (restart,) = policy["rules"]
    assert restart["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert restart["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert jobset["spec"]["successPolicy"] == {
        "operator": "All",
        "targetReplicatedJobs": [replicated["name"]],
    }
    # One Job of NNODES pods; torchrun's rendezvous at pod 0 of Job 0.
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"] == int(env["NNODES"]), name
    container = job["template"]["spec"]["containers"][0]
    subdomain = jobset["spec"]["network"]["subdomain"]
    master = f"{jobset['metadata']['name']}-{replicated['name']}-0-0.{subdomain}"
    assert f"--master-addr={master}" in container["args"]
    assert "--node-rank=$(NODE_RANK)" in container["args"]
    # Restarts belong to the JobSet (all nodes); torchrun restarting one node's ranks
    # would wait at the rendezvous for the others.
    assert "--max-restarts=0" in container["args"]
    assert "--shutdown-timeout=$(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)" in container["args"]
    anti = job["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    config = run_config_of(objects, tmp_path)
    checkpoints = config.learner.checkpoint.dir
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts["/checkpoints"]
    assert checkpoints and checkpoints.startswith("/checkpoints")
    assert not mount.get("readOnly") and mount["subPath"] == "checkpoints"
    volume = next(v for v in job["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == "dapo-shared"  # every node sees it


def test_learner_shutdown_fits_the_grace_period(tmp_path: Path) -> None:
    """SIGTERM → torchrun → ranks checkpoint; torchrun SIGKILLs them after its shutdown
    timeout, the kubelet SIGKILLs the pod after its grace period: the order must be
    checkpoint < TORCH_ELASTIC_SHUTDOWN_TIMEOUT < terminationGracePeriodSeconds, and the
    variable must be the one the pinned torch's torchrun reads."""
    from torch.distributed.launcher.api import LaunchConfig

    for name in TARGETS:
        _, _, job, env = learner_parts(render(name))
        timeout = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        grace = job["template"]["spec"]["terminationGracePeriodSeconds"]
        assert 300 <= timeout and timeout + 30 <= grace, (name, timeout, grace)
    with pytest.MonkeyPatch.context() as patch:  # it makes a log dir in tempfile's dir
        patch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(timeout))
        patch.setattr(tempfile, "tempdir", str(tmp_path))
        launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert launch.shutdown_timeout == timeout


def test_startup_probes_cover_a_32b_load(rendered) -> None:
    """Liveness starts only once the startup probe passed: a 32B model plus its ZeRO states
    (~450 GB) read from the shared volume at 250 MB/s take ~30 min, not counted as failures."""
    name, objects = rendered
    for role, at_least_s in (("learner", 1800), ("rollout", 1200)):
        container = container_of(objects, role)
        assert probe_budget_s(container["startupProbe"]) >= at_least_s, (name, role)
        assert "initialDelaySeconds" not in container["livenessProbe"], (name, role)


# ---------------------------------------------------------------- GPUs and the run config
def test_gpus_match_the_run_config(rendered, tmp_path: Path) -> None:
    """A rollout server gets exactly rollout.engine.tensor_parallel_size GPUs; a learner
    pod GPUS_PER_NODE; NNODES nodes."""
    name, objects = rendered
    config = run_config_of(objects, tmp_path)
    assert config.rollout.engine.kind == "vllm"
    rollout = container_of(objects, "rollout")["resources"]
    assert int(rollout["requests"]["nvidia.com/gpu"]) == config.rollout.engine.tensor_parallel_size
    _, _, job, env = learner_parts(objects)
    learner = job["template"]["spec"]["containers"][0]["resources"]
    assert learner["requests"]["nvidia.com/gpu"] == env["GPUS_PER_NODE"], name
    assert "--nproc-per-node=$(GPUS_PER_NODE)" in job["template"]["spec"]["containers"][0]["args"]


def resolved_without(config: Any, fields: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    dumped = config.model_dump()
    for section, names in fields.items():
        for field in names:
            node = dumped
            *parents, leaf = (section, *field.split("."))
            for part in parents:
                node = node[part]
            node.pop(leaf)
    return dumped


@pytest.mark.parametrize(
    ("target", "differs"),
    [
        ("base", {"shared": ("model_path",)}),
        (
            "single-node",
            {
                "shared": ("model_path", "run_name"),
                "learner": ("checkpoint.dir",),
                "rollout": ("engine.tensor_parallel_size",),
            },
        ),
    ],
)
def test_the_run_config_equals_the_example_it_deploys(
    target: str, differs: dict[str, tuple[str, ...]], tmp_path: Path
) -> None:
    example = load_config(ROOT / "examples" / "dapo-qwen2.5-32b.yaml", env={})
    deployed = run_config_of(render(target), tmp_path)
    assert resolved_without(deployed, differs) == resolved_without(example, differs)
    assert deployed.model_path == "/models/policy"


def test_the_run_config_loads_with_each_pods_environment(rendered, tmp_path: Path) -> None:
    _, objects = rendered
    for role in DAPO_ROLES:
        config = run_config_of(objects, tmp_path, dapo_env(objects, role))
        assert getattr(config, role).server.host == "0.0.0.0"
        assert config.controller.dataset.path.startswith("/data/")


def test_the_learner_weight_socket_listens_on_the_port_that_is_exposed(
    rendered, tmp_path: Path
) -> None:
    """Port 0 (any free port) would be dropped by the NetworkPolicies: the learner pod's
    config must name the fixed port its container and policies expose."""
    _, objects = rendered
    learner = run_config_of(objects, tmp_path, dapo_env(objects, "learner")).learner
    assert learner.publication.transport == "socket"
    assert learner.publication.socket_port == WEIGHT_SOCKET_PORT
    ports = {p["name"]: p["containerPort"] for p in container_of(objects, "learner")["ports"]}
    assert ports["weights"] == WEIGHT_SOCKET_PORT


# ---------------------------------------------------------------- wiring
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


def test_volumes_and_config_resolve(rendered) -> None:
    _, objects = rendered
    names = {
        kind: {o["metadata"]["name"] for o in objects if o["kind"] == kind}
        for kind in ("ConfigMap", "PersistentVolumeClaim")
    }
    secrets = {SECRET["metadata"]["name"]: set(SECRET["stringData"])}
    secrets |= {  # cert-manager writes a Certificate's Secret (components/mtls)
        o["spec"]["secretName"]: {"ca.crt", "tls.crt", "tls.key"}
        for o in objects
        if o["kind"] == "Certificate"
    }
    for obj in objects:
        for template in pod_templates(obj):
            pod = template["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            volumes |= {
                t["metadata"]["name"]: t for t in obj["spec"].get("volumeClaimTemplates", [])
            }
            for volume in volumes.values():
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in names["ConfigMap"]
                if "persistentVolumeClaim" in volume:
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    assert claim in names["PersistentVolumeClaim"]
                for source in volume.get("projected", {}).get("sources", []):
                    secret = source["secret"]
                    if not secret.get("optional"):
                        assert {i["key"] for i in secret["items"]} <= secrets[secret["name"]]
            for container in pod["containers"] + pod.get("initContainers", []):
                assert {m["name"] for m in container.get("volumeMounts", [])} <= set(volumes)
                for entry in container.get("env", []):
                    ref = entry.get("valueFrom", {}).get("configMapKeyRef")
                    assert ref is None or ref["name"] in names["ConfigMap"], entry


def test_network_policies_allow_exactly_the_pipeline_flows() -> None:
    objects = render("base")
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
