"""scripts/k8s_overlay.py, the one-line install's overlay writer: what it writes renders
with `kubectl kustomize` and passes the same behaviour checks as the checked-in overlays,
with the user's values (model and data in the run config, GPUs, nodes) where they belong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_tools import CLUSTER_SCOPED, ROOT, by_key, kustomize
from test_deploy_autoscaling import pdb_problems
from test_deploy_k8s import NAMESPACE, container_of, learner_parts, pod_templates, template_of

from scripts import k8s_overlay

EXAMPLE = ROOT / "examples" / "dapo-qwen2.5-32b.yaml"


def run_config(tmp_path: Path, tensor_parallel: int) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["shared"]["model_path"] = "/models/my-model"
    config["shared"]["run_name"] = "my-run"
    config["rollout"]["engine"]["tensor_parallel_size"] = tensor_parallel
    path = tmp_path / "my-run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("flags", "tensor_parallel"),
    [
        (["--learner-nodes", "3", "--rollout-servers", "8", "--node-pools"], 2),
        (
            [
                "--autoscale",
                "keda",
                "--min-rollout-servers",
                "2",
                "--rollout-servers",
                "12",
                "--rdma",
                "--redis-tls",
                "--registry",
                "reg.example/me",
                "--tag",
                "1.2",
            ],
            4,
        ),
        (["--autoscale", "hpa", "--rollout-servers", "4", "--gpus-per-node", "4"], 1),
    ],
)
def test_the_written_overlay_deploys_the_users_values(
    flags: list[str], tensor_parallel: int, tmp_path: Path
) -> None:
    config = run_config(tmp_path, tensor_parallel)
    out = tmp_path / "overlay"
    assert k8s_overlay.main(["--config", str(config), "--out", str(out), *flags]) == 0
    objects = kustomize(out)
    found = by_key(objects)
    args = k8s_overlay.parse_args(["--config", "x", "--out", "y", *flags])
    assert all(
        o["metadata"].get("namespace") == NAMESPACE
        for o in objects
        if o["kind"] not in CLUSTER_SCOPED
    )
    run = yaml.safe_load(found[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"])
    assert run["shared"]["model_path"] == "/models/my-model"
    _, _, job, env = learner_parts(objects)
    assert job["parallelism"] == job["completions"] == int(env["NNODES"]) == args.learner_nodes
    assert env["GPUS_PER_NODE"] == str(args.gpus_per_node)
    rollout = container_of(objects, "rollout")["resources"]
    assert rollout["requests"]["nvidia.com/gpu"] == str(tensor_parallel)
    assert pdb_problems(found) == []
    statefulset = found[("StatefulSet", "rollout")]["spec"]
    if args.autoscale == "none":
        assert statefulset["replicas"] == args.rollout_servers
    else:
        assert "replicas" not in statefulset
    if args.autoscale == "keda":
        trigger = found[("ScaledObject", "rollout")]["spec"]["triggers"][0]["metadata"]
        assert trigger["stream"] == "dapo:my-run:generating"
        assert args.rollout_servers * int(trigger["streamLength"]) <= 1536
        assert trigger["enableTLS"] == "true"
    selector = template_of(objects, "learner")["spec"].get("nodeSelector")
    assert (selector == {"dapo.io/pool": "learner"}) == args.node_pools
    images = {c["image"] for o in objects for c in _containers(o)}
    if args.registry:
        assert images >= {"reg.example/me/dapo-gpu:1.2", "reg.example/me/dapo-slim:1.2"}


def _containers(obj: dict) -> list[dict]:
    return [c for t in pod_templates(obj) for c in t["spec"]["containers"]]


def test_bad_values_fail_in_one_line(tmp_path: Path) -> None:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["shared"]["model_path"] = "/home/me/model"  # not on the shared volume
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    script = ROOT / "scripts" / "k8s_overlay.py"
    for extra, message in (
        (["--config", str(path)], "shared.model_path must be under /models/"),
        (["--config", str(tmp_path / "none.yaml")], "no run config at"),
        (
            ["--config", str(run_config(tmp_path, 4)), "--autoscale", "keda"]
            + ["--min-rollout-servers", "0"],
            "--min-rollout-servers must be at least 1",
        ),
    ):
        done = subprocess.run(
            [sys.executable, str(script), "--out", str(tmp_path / "o"), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
