"""The images' constraints files, one per image platform, from one resolver (uv).

    python scripts/resolve_images.py            # rewrite both files (upgrade: --upgrade)
    python scripts/resolve_images.py --check    # resolve each install set against its file

Each image installs its set for its own platform: the CPU images (Dockerfile.cpu, .slim)
on Python 3.11, the GPU image on Ubuntu 24.04's Python 3.12 with CUDA torch. Resolving
both for one platform (the old single file) pinned packages the GPU image cannot install.
Versions come from the Dockerfiles' ARGs and pyproject.toml. The CPU set resolves PyPI's
torch (same version as the CPU index's wheel, whose CUDA pins then go unused).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "deploy" / "docker"
sys.path.insert(0, str(DOCKER))
from requirements import requirements  # noqa: E402  (deploy/docker/requirements.py)

EXTRAS = ("rollout", "learner", "reward")


@dataclass(frozen=True)
class Image:
    """One image platform: what it installs, for which Python and wheel platform."""

    name: str
    python: str
    platform: str  # uv's --python-platform
    constraints: Path
    dockerfile: Path

    def install_set(self) -> list[str]:
        """Every requirement the image's `pip install` lines name, in one list."""
        args = dockerfile_args(self.dockerfile)
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        own = requirements(project, list(EXTRAS))
        if "VLLM_VERSION" in args:  # the GPU image: vLLM (its CUDA torch), DeepSpeed, then us
            engines = f"vllm=={args['VLLM_VERSION']}", f"deepspeed=={args['DEEPSPEED_VERSION']}"
            return [*engines, *own]
        return [f"torch=={args['TORCH_VERSION']}"] + own


# python:3.11-slim-bookworm has glibc 2.36, ubuntu 24.04 glibc 2.39: manylinux_2_28 wheels
# install on both, and every wheel these sets need is published for it.
IMAGES = (
    Image(
        "cpu", "3.11", "x86_64-manylinux_2_28", DOCKER / "constraints.txt",
        DOCKER / "Dockerfile.cpu",
    ),
    Image(
        "gpu", "3.12", "x86_64-manylinux_2_28", DOCKER / "constraints-gpu.txt",
        DOCKER / "Dockerfile.gpu",
    ),
)  # fmt: skip

HEADER = """\
# The {name} image's versions ({dockerfile}, pip -c): its install set resolved for
# Python {python} on {platform} by scripts/resolve_images.py. Regenerate with
#   .venv/bin/python scripts/resolve_images.py [--upgrade]
# tests/test_image_resolution.py resolves the set against this file and fails on a conflict.
"""


def dockerfile_args(path: Path) -> dict[str, str]:
    """NAME → default of every `ARG NAME=value` in a Dockerfile."""
    found = re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), re.M)
    return {name: value.strip('"') for name, value in found}


def uv() -> str:
    """The uv binary of this environment (the dev extra installs it), else PATH's."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        raise SystemExit("resolve_images: uv not found (pip install uv, or the dev extra)")
    return found


def compile_args(image: Image, requirements_file: Path) -> list[str]:
    return [
        uv(), "pip", "compile", "--no-cache", "--quiet", "--no-header", "--no-annotate",
        "--python-version", image.python, "--python-platform", image.platform,
        str(requirements_file),
    ]  # fmt: skip


def run_uv(args: list[str]) -> subprocess.CompletedProcess[str]:
    # Python builds of sdists (DeepSpeed's metadata) use the local interpreter, never a download.
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)


def resolve(image: Image, constraints: Path | None, upgrade: bool = False) -> str:
    """The pinned install set (NAME==VERSION lines); raises ResolutionError on a conflict."""
    with tempfile.TemporaryDirectory() as tmp:
        wanted = Path(tmp) / "in.txt"
        wanted.write_text("\n".join(image.install_set()) + "\n")
        args = compile_args(image, wanted)
        if constraints is not None:
            args += ["--constraint", str(constraints)]
        out = Path(tmp) / "out.txt"
        if not upgrade and image.constraints.exists():
            shutil.copy(image.constraints, out)  # uv prefers the versions of its -o file
        done = run_uv(args + ["--output-file", str(out)])
        if done.returncode != 0:
            raise ResolutionError(f"{image.name}: {last_lines(done.stderr)}")
        return out.read_text()


class ResolutionError(Exception):
    """An install set that does not resolve (with its constraints) for its platform."""


def last_lines(text: str, n: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def pins(text: str) -> dict[str, str]:
    """name (lower-case, `_`/`.` as `-`) → version of a NAME==VERSION file."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return found


def check(image: Image, constraints: Path | None = None) -> dict[str, str]:
    """Resolve the image's set against its file: every package resolved must be pinned
    there at the version resolved (a package the file misses would float)."""
    file = constraints or image.constraints
    resolved = pins(resolve(image, file, upgrade=True))
    pinned = pins(file.read_text())
    loose = sorted(f"{n}=={v}" for n, v in resolved.items() if pinned.get(n) != v)
    if loose:
        raise ResolutionError(f"{image.name}: not pinned in {file.name}: {', '.join(loose)}")
    return resolved


def write(image: Image, upgrade: bool) -> None:
    text = resolve(image, None, upgrade)
    header = HEADER.format(
        name=image.name,
        dockerfile=image.dockerfile.name,
        python=image.python,
        platform=image.platform,
    )
    image.constraints.write_text(header + text)
    print(f"resolve_images: {image.constraints.relative_to(ROOT)}: {len(pins(text))} pins")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="resolve against the files")
    parser.add_argument("--upgrade", action="store_true", help="ignore the current pins")
    parser.add_argument("--image", choices=[i.name for i in IMAGES], action="append")
    args = parser.parse_args(argv)
    chosen = [i for i in IMAGES if not args.image or i.name in args.image]
    try:
        for image in chosen:
            if args.check:
                print(f"resolve_images: {image.name}: {len(check(image))} packages resolve")
            else:
                write(image, args.upgrade)
    except ResolutionError as e:
        print(f"resolve_images: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
