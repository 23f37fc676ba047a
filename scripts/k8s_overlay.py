"""Write a kustomize overlay of deploy/k8s for one run: the run config, the learner's nodes
and GPUs, the rollout servers, optional autoscaling, RDMA and Redis TLS. One line installs
it (docs/deploy.md, "Your own run in one line"):

    .venv/bin/python scripts/k8s_overlay.py --config my-run.yaml --learner-nodes 2 \\
        --gpus-per-node 8 --rollout-servers 6 --out deploy/k8s/overlays/mine \\
      && kubectl apply -k deploy/k8s/overlays/mine

What it derives: docs/deploy.md, same section; why not Helm: "Why kustomize and not Helm".
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
LABELS = {"app.kubernetes.io/name": "dapo", "app.kubernetes.io/part-of": "dapo"}
JOB = "/spec/replicatedJobs/0/template/spec"
LEARNER = f"{JOB}/template/spec/containers/0"
ROLLOUT = "/spec/template/spec/containers/0"
EXCLUSIVE = "/metadata/annotations/alpha.jobset.sigs.k8s.io~1exclusive-topology"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="k8s_overlay.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the run config (YAML) the pods read")
    p.add_argument("--out", required=True, help="directory of the overlay to write")
    p.add_argument("--learner-nodes", type=int, default=1, help="learner pods, one per node")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of every GPU node")
    p.add_argument("--learner-gpus", type=int, help="GPUs per learner pod (default: all)")
    p.add_argument("--rollout-servers", type=int, default=1, help="rollout servers (or max)")
    p.add_argument("--autoscale", choices=["none", "keda", "hpa"], default="none")
    p.add_argument("--min-rollout-servers", type=int, default=1, help="with --autoscale")
    p.add_argument("--rdma", action="store_true", help="NCCL over InfiniBand/RoCE")
    p.add_argument("--redis-tls", action="store_true", help="Redis over TLS only")
    p.add_argument(
        "--node-pools",
        action="store_true",
        help="place pods by node label dapo.io/pool=learner|rollout",
    )
    p.add_argument("--registry", help="image registry, e.g. ghcr.io/me (dapo-slim, dapo-gpu)")
    p.add_argument("--tag", default="0.1.0", help="image tag")
    return p.parse_args(argv)


def run_values(config_path: Path) -> dict[str, Any]:
    """What the overlay derives from the run config, resolved by the project's own loader."""
    from services.tools.config import load_config

    config = load_config(config_path, env={})
    if config.rollout.engine.kind != "vllm":
        raise SystemExit("k8s_overlay.py: the GPU images run rollout.engine.kind=vllm")
    for what, path, mount in (
        ("shared.model_path", config.model_path, "/models/"),
        ("controller.dataset.path", config.controller.dataset.path, "/data/"),
        ("learner.checkpoint.dir", config.learner.checkpoint.dir, "/checkpoints"),
    ):
        if not path or not str(path).startswith(mount):
            raise SystemExit(f"k8s_overlay.py: {what} must be under {mount} (the shared volume)")
    return {
        "run_name": config.shared.run_name,
        "tensor_parallel": config.rollout.engine.tensor_parallel_size,
        "max_groups_in_flight": config.controller.max_groups_in_flight,
    }


def op(kind: str, path: str, value: Any = None) -> dict[str, Any]:
    return {"op": kind, "path": path, **({} if kind == "remove" else {"value": value})}


def learner_patch(args: argparse.Namespace, gpus: int) -> list[dict[str, Any]]:
    ops = [
        op("test", f"{LEARNER}/env/0/name", "NNODES"),
        op("replace", f"{LEARNER}/env/0/value", str(args.learner_nodes)),
        op("test", f"{LEARNER}/env/1/name", "GPUS_PER_NODE"),
        op("replace", f"{LEARNER}/env/1/value", str(gpus)),
        op("replace", f"{JOB}/parallelism", args.learner_nodes),
        op("replace", f"{JOB}/completions", args.learner_nodes),
        op("replace", f"{LEARNER}/resources/requests/nvidia.com~1gpu", str(gpus)),
        op("replace", f"{LEARNER}/resources/limits/nvidia.com~1gpu", str(gpus)),
    ]
    if args.node_pools:
        ops.append(op("add", f"{JOB}/template/spec/nodeSelector", {"dapo.io/pool": "learner"}))
    if args.learner_nodes > 1:  # one Job's pods on one host would contradict anti-affinity
        pool = (
            op("replace", EXCLUSIVE, "dapo.io/pool") if args.node_pools else op("remove", EXCLUSIVE)
        )
        ops.append(pool)
    return ops


def rollout_patch(args: argparse.Namespace, tp: int) -> list[dict[str, Any]]:
    ops = [
        op("add", "/metadata/annotations", {"dapo.io/gpus-per-node": str(args.gpus_per_node)}),
        op("replace", f"{ROLLOUT}/resources/requests/nvidia.com~1gpu", str(tp)),
        op("replace", f"{ROLLOUT}/resources/limits/nvidia.com~1gpu", str(tp)),
    ]
    if args.node_pools:
        ops.append(op("add", "/spec/template/spec/nodeSelector", {"dapo.io/pool": "rollout"}))
    return ops


def scaler_patch(args: argparse.Namespace, values: dict[str, Any]) -> dict[str, Any]:
    per_server = str(max(1, values["max_groups_in_flight"] // args.rollout_servers))
    low, high = args.min_rollout_servers, args.rollout_servers
    if low < 1:  # KEDA idles at 0 itself once the run is done (idleReplicaCount)
        raise SystemExit("k8s_overlay.py: --min-rollout-servers must be at least 1")
    if args.autoscale == "keda":
        target = {"group": "keda.sh", "version": "v1alpha1", "kind": "ScaledObject"}
        stream = f"dapo:{values['run_name']}:generating"
        ops = [
            op("replace", "/spec/minReplicaCount", low),
            op("replace", "/spec/maxReplicaCount", high),
            op("replace", "/spec/triggers/0/metadata/stream", stream),
            op("replace", "/spec/triggers/0/metadata/streamLength", per_server),
        ]
    else:
        target = {"group": "autoscaling", "version": "v2", "kind": "HorizontalPodAutoscaler"}
        ops = [
            op("replace", "/spec/minReplicas", low),
            op("replace", "/spec/maxReplicas", high),
            op("replace", "/spec/metrics/0/external/target/averageValue", per_server),
        ]
    return {"target": {**target, "name": "rollout"}, "patch": yaml.safe_dump(ops)}


def kustomization(args: argparse.Namespace, values: dict[str, Any], out: Path) -> dict[str, Any]:
    tp = values["tensor_parallel"]
    gpus = args.learner_gpus or args.gpus_per_node
    if tp > args.gpus_per_node or gpus > args.gpus_per_node:
        raise SystemExit("k8s_overlay.py: a pod cannot have more GPUs than its node")
    base = os.path.relpath(K8S, out.resolve())
    components = {"keda": "autoscaling/keda", "hpa": "autoscaling/hpa", "none": None}
    chosen = [components[args.autoscale]]
    chosen += ["components/rdma"] * args.rdma + ["components/redis-tls"] * args.redis_tls
    per_node = max(1, args.gpus_per_node // tp)
    patches = [
        {
            "target": {
                "group": "jobset.x-k8s.io",
                "version": "v1alpha2",
                "kind": "JobSet",
                "name": "learner",
            },
            "patch": yaml.safe_dump(learner_patch(args, gpus)),
        },
        {
            "target": {"group": "apps", "version": "v1", "kind": "StatefulSet", "name": "rollout"},
            "patch": yaml.safe_dump(rollout_patch(args, tp)),
        },
        {
            "target": {
                "group": "policy",
                "version": "v1",
                "kind": "PodDisruptionBudget",
                "name": "rollout",
            },
            "patch": yaml.safe_dump([op("replace", "/spec/maxUnavailable", per_node)]),
        },
    ]
    spec: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "dapo",
        "resources": [f"{base}/base"],
        "components": [f"{base}/{c}" for c in chosen if c],
        "configMapGenerator": [
            {
                "name": "dapo-run-config",
                "behavior": "replace",
                "files": ["run.yaml"],
                "options": {"labels": LABELS},  # hashed: an edit rolls the pods
            }
        ],
    }
    if args.autoscale == "none":
        spec["replicas"] = [{"name": "rollout", "count": args.rollout_servers}]
    else:
        patches.append(scaler_patch(args, values))
    spec["patches"] = patches
    if args.registry:  # base renames dapo-slim/dapo-gpu: rename what it named them
        base_images = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]
        spec["images"] = [
            {"name": i["newName"], "newName": f"{args.registry}/{i['name']}", "newTag": args.tag}
            for i in base_images
        ]
    return spec


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = Path(args.config)
    if not config.is_file():
        print(f"k8s_overlay.py: no run config at {config}", file=sys.stderr)
        return 2
    out = Path(args.out)
    sys.path.insert(0, str(ROOT))
    from services.common.errors import DapoError

    try:
        values = run_values(config)
    except DapoError as exc:
        print(f"k8s_overlay.py: {config}: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    spec = kustomization(args, values, out)
    header = f"# Written by scripts/k8s_overlay.py {' '.join(argv or sys.argv[1:])}\n"
    (out / "kustomization.yaml").write_text(header + yaml.safe_dump(spec, sort_keys=False))
    shutil.copyfile(config, out / "run.yaml")
    print(f"wrote {out}/kustomization.yaml; apply it with: kubectl apply -k {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
