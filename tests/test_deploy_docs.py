"""The commands of docs/deploy.md that need no cluster, run as the page writes them: the
deploy tests' pytest line (it failed to collect without PYTHONPATH), the one-line
overlay of `scripts/k8s_overlay.py` and the render of what it wrote, and every overlay
the page applies renders."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from deploy_tools import ROOT, kubectl, kustomize
from test_deploy_k8s_overlay import run_config

DOCS = ROOT / "docs" / "deploy.md"


def commands(text: str) -> list[str]:
    """Every command of the page's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def clean_env() -> dict[str, str]:
    """The environment of a user who set nothing: no PYTHONPATH, no DAPO_* variables."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DAPO")}


def test_the_deploy_tests_collect_with_the_line_the_page_gives() -> None:
    (line,) = set(re.findall(r"`(\.venv/bin/pytest [^`]+)`", DOCS.read_text()))
    pytest_binary = Path(sys.executable).parent / "pytest"  # .venv/bin/pytest: no cwd on path
    argv = [str(pytest_binary), *line.split()[1:], "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        " ".join(shlex.quote(a) if "*" not in a else a for a in argv),
        shell=True,  # the page's glob, expanded as a shell would
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = re.search(r"(\d+) tests? collected", done.stdout)
    assert collected and int(collected[1]) >= 100, done.stdout[-500:]


def test_the_one_line_overlay_is_written_and_renders(tmp_path: Path) -> None:
    """The page's `k8s_overlay.py … && kubectl apply -k …`, with its placeholders (the run
    config, the output directory) made real and `apply -k` as `kustomize` (no cluster)."""
    (line,) = [c for c in commands(DOCS.read_text()) if "scripts/k8s_overlay.py" in c]
    write, apply = (part.strip() for part in line.split("&&"))
    out = tmp_path / "mine"
    config = run_config(tmp_path, tensor_parallel=4)
    argv = shlex.split(write.replace("deploy/k8s/overlays/mine", str(out)))
    argv = [sys.executable if a == ".venv/bin/python" else a for a in argv]
    argv = [str(config) if a == "my-run.yaml" else a for a in argv]
    done = subprocess.run(argv, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert apply == "kubectl apply -k deploy/k8s/overlays/mine"
    objects = kustomize(out)
    images = {c["image"] for o in objects for c in _containers(o)}
    assert {"ghcr.io/me/dapo-gpu:0.1.0", "ghcr.io/me/dapo-slim:0.1.0"} <= images


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    templates = [r["template"]["spec"]["template"] for r in spec.get("replicatedJobs", [])]
    templates += [spec["template"]] if "template" in spec else []
    return [c for t in templates for c in t["spec"]["containers"]]


def test_every_overlay_the_page_applies_exists_and_renders() -> None:
    named = set(
        re.findall(r"kubectl (?:apply|delete) -k (deploy/k8s/overlays/[\w-]+)", DOCS.read_text())
    )
    named.discard("deploy/k8s/overlays/mine")  # written by the one-liner above
    assert named
    for directory in sorted(named):
        done = subprocess.run(
            [kubectl(), "kustomize", directory], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, (directory, done.stderr)
