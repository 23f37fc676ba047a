"""Each image's exact install set resolves for its platform against its constraints file.

scripts/resolve_images.py runs uv (no cache, no Python download) against the package
index: the CPU images' set on Python 3.11, the GPU image's (vLLM, DeepSpeed, the project
with CUDA torch) on Python 3.12. A conflict, or a resolved package the file does not pin,
fails. No GPU and no Docker needed; skipped only when the index cannot be reached. The
file every image shared before (resolved for CPU torch on 3.11) fails the GPU set here.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import resolve_images  # noqa: E402

INDEX = os.environ.get("UV_INDEX_URL", "https://pypi.org/simple/")
IMAGES = {image.name: image for image in resolve_images.IMAGES}


@pytest.fixture(scope="module", autouse=True)
def index_reachable() -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(INDEX, method="HEAD"), timeout=10)
    except OSError as e:
        pytest.skip(f"package index {INDEX} unreachable ({e}): image resolution not checked")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(IMAGES))
def test_each_image_resolves_for_its_platform(name: str) -> None:
    started = time.monotonic()
    resolved = resolve_images.check(IMAGES[name])
    assert resolved["torch"] == "2.13.0"
    assert ("vllm" in resolved) == (name == "gpu")
    print(f"{name}: {len(resolved)} packages in {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(300)
def test_a_conflicting_pin_fails(tmp_path: Path) -> None:
    """The old shared file's first conflict: vllm 0.32 needs setuptools < 81."""
    gpu = IMAGES["gpu"]
    bad = tmp_path / "constraints.txt"
    bad.write_text(gpu.constraints.read_text().replace("setuptools==", "setuptools==84.2.1 #"))
    with pytest.raises(resolve_images.ResolutionError, match="setuptools"):
        resolve_images.check(gpu, bad)


@pytest.mark.timeout(300)
def test_a_package_the_file_misses_fails(tmp_path: Path) -> None:
    cpu = IMAGES["cpu"]
    lines = cpu.constraints.read_text().splitlines()
    partial = tmp_path / "constraints.txt"
    partial.write_text("\n".join(x for x in lines if not x.startswith("safetensors==")) + "\n")
    with pytest.raises(resolve_images.ResolutionError, match="not pinned.*safetensors"):
        resolve_images.check(cpu, partial)
