"""Shared helpers of the deploy tests: real tools (promtool, prometheus, docker-compose)
installed from Debian when missing, and a small kustomize renderer.

The deploy tests never mock a tool. When a binary is missing and we are root on Debian
(a fresh CI machine), its Debian package is installed; otherwise the test fails with a
message that says what to install, instead of skipping silently.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32.0"  # the Kubernetes API the manifests are validated against

# Kinds that live outside namespaces (kustomize leaves their namespace alone).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}  # fmt: skip


def _apt_install(package: str) -> subprocess.CompletedProcess[str]:
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:  # stale or missing package lists on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return done


def require_tool(binary: str, package: str) -> str:
    """Path of `binary`, installing Debian's `package` first if needed (root only)."""
    found = shutil.which(binary)
    if found:
        return found
    why = f"`{binary}` is not on PATH"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        done = _apt_install(package)
        found = shutil.which(binary)
        if found:
            return found
        why += f"; `apt-get install {package}` failed: {done.stderr.strip()[-500:]}"
    else:
        why += f" and this is not root on Debian: install the `{package}` package"
    pytest.fail(f"{why} (the deploy tests need the real tool)", pytrace=False)


def run_tool(*cmd: str, cwd: Path | None = None, env: dict[str, str] | None = None):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


# ---------------------------------------------------------------- kustomize (subset)
def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, parts[-1]


def _apply(parent: Any, key: str, op: dict[str, Any]) -> None:
    kind, path = op["op"], op["path"]
    if isinstance(parent, list):
        key = len(parent) if key == "-" else int(key)  # type: ignore[assignment]
    elif kind != "add" and key not in parent:
        raise KeyError(f"json patch {kind}: {path} does not exist")
    if kind == "test":
        assert parent[key] == op["value"], f"json patch test failed at {path}"
    elif kind == "remove":
        del parent[key]
    elif kind == "add" and isinstance(parent, list):
        parent.insert(key, op["value"])
    elif kind in ("add", "replace"):
        parent[key] = op["value"]
    else:
        raise ValueError(f"json patch op {kind} is not supported here")


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/replace/remove/test (what the overlays use) on a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parent, key = _parent(doc, _pointer(op["path"]))
        _apply(parent, key, op)
    return doc


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    checks = {"kind": obj["kind"], "name": obj["metadata"]["name"],
              "group": group, "version": version}  # fmt: skip
    return all(checks[k] == v for k, v in target.items() if k in checks)


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    template = obj.get("spec", {}).get("template")
    return [template["spec"]] if template else []


def _set_image(obj: dict[str, Any], rule: dict[str, Any]) -> None:
    for spec in _pod_specs(obj):
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            image = container["image"]
            name = image.split("@")[0].rsplit(":", 1)[0] if ":" in image else image
            if name == rule["name"]:
                new = rule.get("newName", name)
                container["image"] = f"{new}:{rule['newTag']}" if "newTag" in rule else new


def _load_resources(directory: Path, entries: list[str]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for entry in entries:
        path = directory / entry
        if path.is_dir():
            objects += kustomize(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return objects


def _patch(objects: list[dict[str, Any]], patches: list[dict[str, Any]]) -> None:
    for patch in patches:
        hits = [i for i, o in enumerate(objects) if _matches(o, patch["target"])]
        assert hits, f"patch target {patch['target']} matches nothing"
        for i in hits:
            objects[i] = json_patch(objects[i], yaml.safe_load(patch["patch"]))


def _set_replicas(objects: list[dict[str, Any]], rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        hits = [o for o in objects if o["metadata"]["name"] == rule["name"]
                and o["kind"] in ("Deployment", "StatefulSet", "ReplicaSet")]  # fmt: skip
        assert hits, f"replicas: nothing named {rule['name']}"
        for obj in hits:
            obj["spec"]["replicas"] = rule["count"]


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Render a kustomization with the fields this repo uses: resources (files and
    directories), namespace, replicas, images and JSON 6902 patches with a target."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "namespace", "replicas", "images", "patches"}
    assert set(spec) <= known, f"kustomization fields this renderer lacks: {set(spec) - known}"
    objects = _load_resources(directory, spec.get("resources", []))
    _patch(objects, spec.get("patches", []))
    _set_replicas(objects, spec.get("replicas", []))
    for rule in spec.get("images", []):
        for obj in objects:
            _set_image(obj, rule)
    for obj in objects:
        if "namespace" in spec and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


# ---------------------------------------------------------------- the tools themselves
@pytest.mark.parametrize(
    ("binary", "package", "words"),
    [("promtool", "prometheus", "promtool"), ("prometheus", "prometheus", "prometheus"),
     ("docker-compose", "docker-compose", "docker-compose")],
)  # fmt: skip
def test_tool_is_installed_and_runs(binary: str, package: str, words: str) -> None:
    done = run_tool(require_tool(binary, package), "--version")
    assert done.returncode == 0, done.stderr
    assert words in (done.stdout + done.stderr).lower()


def test_json_patch_applies_and_tests() -> None:
    doc = {"a": {"b/c": [1, 2]}, "x": 1}
    out = json_patch(doc, [
        {"op": "test", "path": "/x", "value": 1},
        {"op": "add", "path": "/a/b~1c/-", "value": 3},
        {"op": "replace", "path": "/a/b~1c/0", "value": 0},
        {"op": "remove", "path": "/x"},
    ])  # fmt: skip
    assert out == {"a": {"b/c": [0, 2, 3]}} and doc["x"] == 1
    with pytest.raises(AssertionError):
        json_patch(doc, [{"op": "test", "path": "/x", "value": 2}])
    with pytest.raises(KeyError):
        json_patch(doc, [{"op": "replace", "path": "/nope", "value": 2}])
