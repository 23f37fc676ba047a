"""A week of cluster operations, read off every overlay `kubectl kustomize` renders
(docs/deploy.md, "A week on a cluster"): rollout servers stay in DNS through weight
updates, the learner gang is admitted whole and restarts for free after disruptions, its
rendezvous outlasts Kueue's requeue, monitors scrape only ports that serve, KEDA keeps
servers through a synchronous step and releases them when the run is done, and every pod
passes Pod Security "restricted" with a read-only root and portable DNS."""

from __future__ import annotations

import ipaddress
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY, ROOT, by_key, generated_name, kustomize
from test_deploy_k8s import (
    DAPO_ROLES,
    GPU_ROLES,
    K8S,
    NAMESPACE,
    SECRET,
    TARGETS,
    container_of,
    dapo_env,
    every_container,
    learner_parts,
    pod_templates,
    probe_budget_s,
    render,
    run_config_of,
    selects,
    template_of,
    workloads,
)

PRODUCTION = "multi-node-production"
KUEUE = K8S / "components" / "kueue"
LOAD_32B_S = 1800  # a 32B model and its ZeRO states from the shared volume (docs/deploy.md)
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"


@pytest.fixture(scope="module", params=list(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def seconds(duration: str) -> int:
    """'45m' → 2700 (Kueue's and Prometheus' durations)."""
    value, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()  # type: ignore[union-attr]
    return int(value) * {"s": 1, "m": 60, "h": 3600}[unit]


# ---------------------------------------------------------------- rollouts stay reachable
def test_rollout_names_resolve_while_not_ready(rendered) -> None:
    """The relay chain dials rollout-i.rollout by name: a server that is not ready (its
    first load, a drain) must still resolve, or its children fall back to the learner."""
    name, objects = rendered
    service = by_key(objects)[("Service", "rollout")]
    assert service["spec"]["clusterIP"] == "None", name
    assert service["spec"].get("publishNotReadyAddresses") is True, name


# ---------------------------------------------------------------- the learner gang
def torchrun_config(container: dict[str, Any], tmp_path: Path) -> Any:
    """torchrun's LaunchConfig for the learner's argv, $(VAR)s expanded as the kubelet does."""
    from torch.distributed.run import config_from_args, get_args_parser

    env = {e["name"]: e.get("value", "0") for e in container["env"]}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    with pytest.MonkeyPatch.context() as patch:  # it sets OMP_NUM_THREADS, makes a log dir
        patch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        patch.setattr(tempfile, "tempdir", str(tmp_path))
        config, _, _ = config_from_args(get_args_parser().parse_args(argv))
    return config


def kueue_pods_ready_timeout_s() -> int:
    config = yaml.safe_load((KUEUE / "kueue-config.example.yaml").read_text())
    wait = config["waitForPodsReady"]
    assert wait["enable"] is True and wait["blockAdmission"] is True
    return seconds(wait["timeout"])


def test_rendezvous_outlasts_kueue_requeue_and_the_startup_probe_outlasts_both(
    rendered, tmp_path: Path
) -> None:
    """A gang with a pod that cannot be scheduled: Kueue's waitForPodsReady evicts and
    requeues it (no restart spent) before torchrun's rendezvous on node 0 times out (a
    failure that spends one); node 0's startup probe allows the wait plus a 32B load, and
    the Kueue timeout allows that load too. torchrun's default (600 s) failed all three."""
    name, objects = rendered
    _, _, job, _ = learner_parts(objects)
    (container,) = job["template"]["spec"]["containers"]
    config = torchrun_config(container, tmp_path)
    rendezvous = int(config.rdzv_configs["timeout"])
    pods_ready = kueue_pods_ready_timeout_s()
    assert config.rdzv_backend == "static" and config.max_restarts == 0, name
    assert LOAD_32B_S < pods_ready < rendezvous, (name, pods_ready, rendezvous)
    assert probe_budget_s(container["startupProbe"]) >= rendezvous + LOAD_32B_S, name


def job_failure_reason(job: dict[str, Any], pod_conditions: set[str]) -> str:
    """The reason the Job controller gives a Job whose pod failed with these conditions."""
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        wanted = {c["type"] for c in rule.get("onPodConditions", []) if c["status"] == "True"}
        if wanted & pod_conditions and rule["action"] == "FailJob":
            return "PodFailurePolicy"
    assert job["backoffLimit"] == 0
    return "BackoffLimitExceeded"


def restart_counts(jobset: dict[str, Any], reason: str) -> bool:
    """Whether the JobSet spends one of maxRestarts on a Job failed for `reason`."""
    for rule in jobset["spec"]["failurePolicy"].get("rules", []):
        if reason in rule.get("onJobFailureReasons", [reason]):
            assert rule["action"] != "FailJobSet", rule
            return rule["action"] == "RestartJobSet"
    return True


def test_disruptions_restart_the_gang_for_free_and_failures_have_a_budget(rendered) -> None:
    """Evictions by a drain, preemption and a lost node's pod GC all set DisruptionTarget:
    restarts that spend nothing. A crash spends one of maxRestarts, sized for weeks."""
    name, objects = rendered
    jobset, _, job, _ = learner_parts(objects)
    disrupted = job_failure_reason(job, {"DisruptionTarget"})
    crashed = job_failure_reason(job, set())
    assert not restart_counts(jobset, disrupted), name
    assert restart_counts(jobset, crashed), name
    assert jobset["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 14, "about one a day for weeks"


def test_each_learner_job_owns_its_topology_domain(rendered) -> None:
    """exclusive-topology: one Job per domain, no other JobSet's Job in it. With several
    pods per Job the domain must hold several nodes (not the hostname, which the pods'
    anti-affinity forbids sharing), and the pods must be placed within that label."""
    name, objects = rendered
    jobset, _, job, env = learner_parts(objects)
    key = jobset["metadata"]["annotations"][EXCLUSIVE]
    spec = job["template"]["spec"]
    if int(env["NNODES"]) > 1:
        assert key != "kubernetes.io/hostname", name
        assert key in spec["nodeSelector"], name
    else:
        assert key == "kubernetes.io/hostname", name


@pytest.mark.parametrize("pools", [True, False])
def test_written_overlays_keep_the_gang_schedulable(pools: bool, tmp_path: Path) -> None:
    """scripts/k8s_overlay.py with several learner nodes: their Job's domain is the
    learner pool (with --node-pools) or none, never one host."""
    from test_deploy_k8s_overlay import run_config

    from scripts import k8s_overlay

    out, flags = tmp_path / "overlay", ["--learner-nodes", "2"] + ["--node-pools"] * pools
    argv = ["--config", str(run_config(tmp_path, 4)), "--out", str(out), *flags]
    assert k8s_overlay.main(argv) == 0
    jobset = by_key(kustomize(out))[("JobSet", "learner")]
    key = jobset["metadata"].get("annotations", {}).get(EXCLUSIVE)
    assert key == ("dapo.io/pool" if pools else None)


def test_the_production_overlay_queues_the_gang_in_kueue() -> None:
    objects = render(PRODUCTION)
    jobset, _, _, _ = learner_parts(objects)
    queue = jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    local = by_key(objects)[("LocalQueue", queue)]
    admin = {
        o["kind"]: o for o in yaml.safe_load_all((KUEUE / "cluster-queue.example.yaml").read_text())
    }
    assert local["spec"]["clusterQueue"] == admin["ClusterQueue"]["metadata"]["name"]
    rollout = workloads(objects)["rollout"]
    assert "kueue.x-k8s.io/queue-name" not in rollout["metadata"].get("labels", {})


# ---------------------------------------------------------------- monitoring
def running_pods(objects: list[dict[str, Any]]) -> list[tuple[dict[str, str], set[str]]]:
    """(labels, ports something listens on) of every pod the workloads run: a JobSet's
    pods with their completion index (Kubernetes >= 1.28 labels it); of the learner only
    pod 0 (global rank 0) serves HTTP."""
    out = []
    for obj in objects:
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            if obj["kind"] != "JobSet":
                out.append((labels, ports))
                continue
            for index in range(obj["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"]):
                serving = ports if index == 0 else ports - {"http", "grpc", "weights"}
                out.append(({**labels, INDEX_LABEL: str(index)}, serving))
    return out


def test_every_pod_monitor_scrapes_only_ports_that_serve() -> None:
    objects = render(PRODUCTION)
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    pods = running_pods(objects)
    scraped = set()
    for monitor in monitors:
        chosen = [
            (labels, ports)
            for labels, ports in pods
            if selects(monitor["spec"]["selector"], labels)
        ]
        assert chosen, f"{monitor['metadata']['name']} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for labels, ports in chosen:
                assert endpoint["port"] in ports, (monitor["metadata"]["name"], labels)
                scraped.add(labels["app.kubernetes.io/component"])
            relabel = endpoint["relabelings"][0]
            assert relabel["targetLabel"] == "job" and relabel["replacement"] == "dapo-$1"
    assert scraped == set(DAPO_ROLES)
    learners = [labels for labels, _ in pods if labels["app.kubernetes.io/component"] == "learner"]
    assert len(learners) >= 2, "multi-node: pods that list http but do not serve it"


def test_the_alert_rules_and_dashboard_ship_as_the_stack_reads_them() -> None:
    objects = by_key(render(PRODUCTION))
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    rule = objects[("PrometheusRule", "dapo")]
    assert rule["spec"]["groups"] == alerts["groups"], "edit both together"
    dashboard = objects[("ConfigMap", "dapo-grafana-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    assert text == (DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text()
    for obj in (rule, *[o for o in objects.values() if o["kind"] == "PodMonitor"]):
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    jobs = set(re.findall(r'job="(dapo-\w+)"', yaml.safe_dump(alerts)))
    assert jobs <= {f"dapo-{role}" for role in DAPO_ROLES}


# ---------------------------------------------------------------- KEDA
# The newest KEDA feature each manifest field needs (the KEDA changelog).
KEDA_FEATURES = {"streamLength": (2, 11), "ca": (2, 12), "idleReplicaCount": (2, 4)}


def keda_features(objects: list[dict[str, Any]]) -> set[str]:
    used = set()
    for obj in objects:
        if obj["kind"] == "ScaledObject":
            used |= {k for t in obj["spec"]["triggers"] for k in t["metadata"]} | set(obj["spec"])
        if obj["kind"] == "TriggerAuthentication":
            used |= {r["parameter"] for r in obj["spec"]["secretTargetRef"]}
    return used & set(KEDA_FEATURES)


def test_the_stated_keda_version_covers_the_features_used() -> None:
    needed = max(KEDA_FEATURES[f] for name in TARGETS for f in keda_features(render(name)))
    version = ".".join(map(str, needed))
    docs = (ROOT / "docs" / "deploy.md").read_text()
    component = (K8S / "autoscaling" / "keda" / "kustomization.yaml").read_text()
    stated = set(re.findall(r"KEDA (?:≥|>=) ?(\d+\.\d+)", docs + component))
    assert stated == {version}, (stated, version)


def test_keda_keeps_servers_through_a_step_and_releases_them_when_done(rendered) -> None:
    """A synchronous run empties the `generating` stream while the learner trains, each
    step: a server must not be removed unless the backlog stayed low for longer than one
    takes to come back (its startup budget). A finished run (the stream empty for the
    cooldown, longer than any training phase) goes to 0 servers and frees the GPUs."""
    name, objects = rendered
    comeback = probe_budget_s(container_of(objects, "rollout")["startupProbe"])
    for obj in objects:
        if obj["kind"] == "ScaledObject":
            spec = obj["spec"]
            behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= comeback, name
            assert spec["idleReplicaCount"] == 0 < spec["minReplicaCount"], name
            assert spec["cooldownPeriod"] >= 2 * 3600, name
        if obj["kind"] == "HorizontalPodAutoscaler":
            window = obj["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
            assert window >= comeback, name


# ---------------------------------------------------------------- security
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral"}
RESTRICTED_VOLUMES |= {"persistentVolumeClaim", "projected", "secret"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What Pod Security "restricted" (v1.25+) refuses in a pod spec."""
    out = [k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    out += [
        v["name"] for v in spec.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES
    ]
    pod = spec.get("securityContext", {})
    for c in spec["containers"] + spec.get("initContainers", []):
        own = c.get("securityContext", {})
        if own.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{c['name']}: runAsNonRoot")
        if own.get("privileged") or own.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: privilege")
        caps = own.get("capabilities", {})
        if caps.get("drop") != ["ALL"] or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities")
        seccomp = own.get("seccompProfile", pod.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccomp")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
    return out


def test_every_pod_passes_the_namespace_pod_security_level(rendered) -> None:
    name, objects = rendered
    namespace = by_key(objects)[("Namespace", NAMESPACE)]["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted", name
    assert namespace["pod-security.kubernetes.io/warn"] == "restricted", name
    for obj in objects:
        for template in pod_templates(obj):
            assert not restricted_violations(template["spec"]), (name, obj["metadata"]["name"])


def test_roots_are_read_only_and_caches_have_somewhere_to_go(rendered) -> None:
    name, objects = rendered
    for workload, _, container, _ in every_container(objects):
        assert container["securityContext"].get("readOnlyRootFilesystem") is True, (
            name,
            workload,
            container["name"],
        )
    for role in GPU_ROLES:  # torch, Triton, DeepSpeed, vLLM write under $HOME and /tmp
        spec = template_of(objects, role)["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container_of(objects, role)["volumeMounts"]}
        for path in ("/tmp", "/home/dapo", "/dev/shm"):
            assert "emptyDir" in volumes[mounts[path]], (name, role, path)


def peer_matches(peer: dict[str, Any], namespace: str | None, address: str) -> bool:
    """A NetworkPolicy peer against a pod without labels in `namespace` at `address`
    (namespace None: a host address, not a pod)."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(address)
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if namespace is None or "namespaceSelector" not in peer:
        return False  # a podSelector alone means this policy's namespace (dapo)
    name = {"kubernetes.io/metadata.name": namespace}
    return selects(peer["namespaceSelector"], name) and selects(peer.get("podSelector", {}), {})


def dns_allowed(objects: list[dict[str, Any]], namespace: str | None, address: str, port: int):
    """Whether a dapo pod may send UDP `port` to that resolver under the egress policies."""
    for policy in objects:
        if policy["kind"] != "NetworkPolicy" or "Egress" not in policy["spec"]["policyTypes"]:
            continue
        if not selects(policy["spec"]["podSelector"], {"app.kubernetes.io/part-of": "dapo"}):
            continue
        for rule in policy["spec"].get("egress", []):
            ports = {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])}
            if ports and ("UDP", port) not in ports:
                continue
            peers = rule.get("to")
            if peers is None or any(peer_matches(p, namespace, address) for p in peers):
                return True
    return False


def test_dns_egress_works_with_any_cluster_dns(rendered) -> None:
    """CoreDNS in kube-system under any labels, NodeLocal DNSCache on 169.254.20.10 (not a
    pod), OpenShift's resolvers in openshift-dns on 5353."""
    name, objects = rendered
    assert dns_allowed(objects, "kube-system", "10.96.0.10", 53), name
    assert dns_allowed(objects, None, "169.254.20.10", 53), name
    assert dns_allowed(objects, "openshift-dns", "10.128.0.5", 5353), name


def mounted_files(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """path in the container → (Secret, key) of every projected Secret item it mounts."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for mount in container["volumeMounts"]:
        for source in volumes[mount["name"]].get("projected", {}).get("sources", []):
            for item in source["secret"]["items"]:
                out[f"{mount['mountPath']}/{item['path']}"] = (
                    source["secret"]["name"],
                    item["key"],
                )
    return out


def test_the_production_services_talk_mtls_with_a_token(tmp_path: Path) -> None:
    """components/mtls: every dapo pod loads a config with TLS, mTLS and a token file on,
    and every file it names is mounted from the Secret that holds it: the certificate's
    (issued by cert-manager for the name clients verify) or dapo-secrets' token."""
    objects = render(PRODUCTION)
    found = by_key(objects)
    certificate = found[("Certificate", "dapo-tls")]["spec"]
    assert {"server auth", "client auth"} <= set(certificate["usages"])
    issuer = found[("Issuer", certificate["issuerRef"]["name"])]["spec"]
    assert found[("Certificate", issuer["ca"]["secretName"])]["spec"]["isCA"] is True
    for role in DAPO_ROLES:
        config = run_config_of(objects, tmp_path, dapo_env(objects, role))
        tls, auth = config.security.tls, config.security.auth
        assert tls.enabled and tls.mtls and tls.server_name in certificate["dnsNames"], role
        files = mounted_files(template_of(objects, role)["spec"], container_of(objects, role))
        secret = certificate["secretName"]
        assert files[tls.ca] == (secret, "ca.crt") and files[tls.cert] == (secret, "tls.crt")
        assert files[tls.key] == (secret, "tls.key"), role
        assert files[auth.token_file] == ("dapo-secrets", "auth-token"), role
    assert "auth-token" in SECRET["stringData"]


# ---------------------------------------------------------------- the small ones
def test_single_node_cpu_services_tolerate_the_gpu_taint() -> None:
    objects = render("single-node")
    for role in ("controller", "buffer", "reward", "redis"):
        tolerations = template_of(objects, role)["spec"].get("tolerations", [])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            tolerations
        ), role


def test_pods_name_the_run_config_by_its_content_hash(rendered) -> None:
    """An edited run.yaml is a new ConfigMap (dapo-run-config-<hash>) every pod template
    names, so every workload rolls and no pod reads a run.yaml other than its own."""
    name, objects = rendered
    configmaps = [o for o in objects if o["kind"] == "ConfigMap"]
    (run,) = [c for c in configmaps if generated_name(c) == "dapo-run-config"]
    assert run["metadata"]["name"] != "dapo-run-config", name
    for role in DAPO_ROLES:
        volumes = template_of(objects, role)["spec"]["volumes"]
        (config,) = [v for v in volumes if v["name"] == "config"]
        assert config["configMap"]["name"] == run["metadata"]["name"], (name, role)
