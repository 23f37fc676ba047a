#!/usr/bin/env bash
# The GPU check, in one call on a GPU machine (torch + CUDA 13, no vLLM, no network):
#   scripts/gpu_check.sh [--device cuda|cpu] [--steps N] [--wheels DIR] [--out DIR] [--parts abcd]
#   scripts/gpu_check.sh WHEEL_DIR [OUT_DIR]          (the same as --wheels DIR --out DIR)
# With --wheels, installs scripts/gpu_wheels.txt from DIR (no index) into a venv that sees
# the machine's torch; then runs scripts/gpu_check.py, each part recorded as it finishes:
# (a) `dapo up --preset tiny` with the torch engine and the DeepSpeed learner (ZeRO-2,
# bf16) on the device, ledger and held-out accuracy checked; (b) the same with
# --rollouts 2 sharing it; (c) the torch engine and DeepSpeed learner steps at 4k/16k/32k
# tokens; (d) the weight path into a rollout server on the device against a raw copy.
# Figures: OUT/gpu_check.json (docs/gpu.md), log: OUT/gpu_check.log. Exit 3: no CUDA.
# --device cpu: every part small on the CPU (tests/test_gpu_check.py runs it in make test).
#   scripts/gpu_check.sh --fetch WHEEL_DIR   (on a machine with network) downloads the wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LIMIT_MIB=64

if [[ "${1:-}" == "--fetch" ]]; then
  dir="${2:?usage: gpu_check.sh --fetch WHEEL_DIR}"
  py="${GPU_PYTHON_VERSION:-3.11}"
  python3 -m pip download --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$dir" -r "$ROOT/scripts/gpu_wheels.txt"
  # DeepSpeed is published as an sdist only: its pure-Python wheel (ops built at run time).
  DS_BUILD_OPS=0 python3 -m pip wheel --no-deps -w "$dir" \
    "deepspeed==$(sed -n 's/^ARG DEEPSPEED_VERSION=//p' "$ROOT/deploy/docker/Dockerfile.gpu")"
  # What the machine's torch already brings is not carried (numpy alone is 17 MB).
  for have in numpy sympy mpmath filelock fsspec networkx jinja2 markupsafe typing_extensions; do
    rm -f "$dir/$have"-*.whl
  done
  size=$(du -sm "$dir" | cut -f1)
  echo "gpu_check: $size MiB of wheels in $dir (limit $LIMIT_MIB)"
  [[ "$size" -le "$LIMIT_MIB" ]] || { echo "gpu_check: over $LIMIT_MIB MiB" >&2; exit 1; }
  exit 0
fi

device=cuda steps= wheels= out= parts=abcd
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --parts) parts="$2"; shift 2 ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) if [[ -z "$wheels" ]]; then wheels="$1"; else out="$1"; fi; shift ;;
  esac
done
[[ "$device" == cuda || "$device" == cpu ]] || { echo "gpu_check: --device cuda or cpu" >&2; exit 2; }
steps="${steps:-$([[ "$device" == cuda ]] && echo 10 || echo 1)}"
out="${out:-${OUT:-$ROOT/gpu-check-out}}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
python="${PYTHON:-python3}"
echo "gpu_check: $("$python" -c 'import sys; print(sys.version.split()[0])') at $(command -v "$python"), device $device"
"$python" -c 'import torch; print("gpu_check: torch", torch.__version__, "cuda", torch.version.cuda)' \
  || { echo "gpu_check: no torch on this machine's $python" >&2; exit 2; }

# 1. With wheels: a venv that sees the machine's torch, then the wheels, offline.
if [[ -n "$wheels" ]]; then
  venv="$out/venv"
  if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv --system-site-packages "$venv"
    # torch's own site-packages too, wherever it lives (a conda env or venv of the machine)
    torch_site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
    echo "$torch_site" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
  fi
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" -r "$ROOT/scripts/gpu_wheels.txt" deepspeed
  python="$venv/bin/python"
fi
# `dapo up` starts its children with this interpreter's `-m services.tools.cli`.
export PATH="$(dirname "$python"):$PATH"

# 2. The parts, in order; stops with exit 3 (and says so) where --device cuda finds no CUDA.
cd "$ROOT"
PYTHONPATH="$ROOT:$ROOT/proto${PYTHONPATH:+:$PYTHONPATH}" \
  "$python" -m scripts.gpu_check "$out/gpu_check.json" --device "$device" --steps "$steps" \
  --parts "$parts"
