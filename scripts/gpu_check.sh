#!/usr/bin/env bash
# The GPU check, in one call on a GPU machine (torch 2.11 + CUDA 13, no vLLM, no network):
#   scripts/gpu_check.sh WHEEL_DIR [OUT_DIR]
# installs scripts/gpu_wheels.txt from WHEEL_DIR (no index) into a venv that sees the
# machine's torch, then runs scripts/gpu_check.py: the torch engine generating on the GPU,
# a learner step at 4k/16k/32k tokens on a Qwen2.5-1.5B-shaped random model in bf16, a
# weight publication to a rollout server on the GPU. Figures: OUT_DIR/gpu_check.json (for
# docs/gpu.md), log: OUT_DIR/gpu_check.log. Exit 3: no CUDA here (it ran up to that point).
#   scripts/gpu_check.sh --fetch WHEEL_DIR   (on a machine with network) downloads the wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LIMIT_MIB=64

if [[ "${1:-}" == "--fetch" ]]; then
  dir="${2:?usage: gpu_check.sh --fetch WHEEL_DIR}"
  python3 -m pip download --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.11}" --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$dir" -r "$ROOT/scripts/gpu_wheels.txt"
  size=$(du -sm "$dir" | cut -f1)
  echo "gpu_check: $size MiB of wheels in $dir (limit $LIMIT_MIB)"
  [[ "$size" -le "$LIMIT_MIB" ]] || { echo "gpu_check: over $LIMIT_MIB MiB" >&2; exit 1; }
  exit 0
fi

wheels="${1:?usage: gpu_check.sh WHEEL_DIR [OUT_DIR]}"
out="${2:-${OUT:-$ROOT/gpu-check-out}}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
python="${PYTHON:-python3}"
echo "gpu_check: $("$python" -c 'import sys; print(sys.version.split()[0])') at $(command -v "$python")"

# 1. torch from the machine: a venv that sees its site-packages, then the wheels, offline.
"$python" -c 'import torch; print("gpu_check: torch", torch.__version__, "cuda", torch.version.cuda)' \
  || { echo "gpu_check: no torch on this machine's $python" >&2; exit 2; }
venv="$out/venv"
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv --system-site-packages "$venv"
  # torch's own site-packages too, wherever it lives (a conda env or venv of the machine)
  torch_site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  echo "$torch_site" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
fi
"$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" -r "$ROOT/scripts/gpu_wheels.txt"
"$venv/bin/python" - <<'PY'
import importlib
for name in ("transformers", "grpc", "fastapi", "pydantic", "redis", "safetensors"):
    importlib.import_module(name)
print("gpu_check: every package imports")
PY

# 2. The check itself; stops with exit 3 (and says so) where there is no CUDA.
cd "$ROOT"
PYTHONPATH="$ROOT:$ROOT/proto" "$venv/bin/python" -m scripts.gpu_check "$out/gpu_check.json"
