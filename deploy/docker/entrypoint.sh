#!/bin/sh
# Container entry point: `dapo-entrypoint ROLE ARGS...` runs `dapo ROLE ARGS...`.
#
# DAPO_GPU_SLOTS (optional, docker-compose): the container-local GPU indices that several
# replicas of one service share, e.g. "0,1,2". Each replica claims one index with an
# atomic mkdir under DAPO_GPU_LOCK_DIR (a volume the replicas share) and runs with
# CUDA_VISIBLE_DEVICES set to it, so `--scale rollout=3` puts the servers on 3 GPUs.
set -eu

claim_gpu() {
    lock_dir="${DAPO_GPU_LOCK_DIR:-/run/dapo-gpus}"
    me="$(hostname)"
    for gpu in $(echo "$DAPO_GPU_SLOTS" | tr ',' ' '); do
        slot="$lock_dir/gpu-$gpu"
        if mkdir "$slot" 2>/dev/null || [ "$(cat "$slot/owner" 2>/dev/null)" = "$me" ]; then
            echo "$me" > "$slot/owner"
            echo "$gpu"
            return 0
        fi
    done
    return 1
}

if [ -n "${DAPO_GPU_SLOTS:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    if ! gpu="$(claim_gpu)"; then
        echo "dapo-entrypoint: every GPU in DAPO_GPU_SLOTS=$DAPO_GPU_SLOTS is taken" >&2
        exit 1
    fi
    export CUDA_VISIBLE_DEVICES="$gpu"
    echo "dapo-entrypoint: $(hostname) runs on GPU $gpu" >&2
fi

exec dapo "$@"
