#!/bin/sh
# Container entry point: `dapo-entrypoint ROLE ARGS...` runs `dapo ROLE ARGS...`.
#
# DAPO_GPU_SLOTS (optional, docker-compose): the container-local GPU indices that several
# replicas of one service share, e.g. "0,1,2". Each replica claims one index by holding
# an flock on DAPO_GPU_LOCK_DIR/gpu-N.lock (a volume the replicas share) for as long as
# its process lives, and runs with CUDA_VISIBLE_DEVICES set to it, so `--scale rollout=3`
# puts the servers on 3 GPUs. The kernel drops the lock when the replica exits: nothing
# to reset, and `dapo-entrypoint gpu-slots` (compose's gpu-slots-reset) only lists them.
#
# DAPO_LEARNER_GPU_IDS (optional, docker-compose: LEARNER_GPU_IDS): the host GPUs the
# learner container reserves, e.g. "0,1,2,3"; one data-parallel rank per GPU
# (learner.launch.ranks, unless DAPO_LEARNER__LAUNCH__RANKS says otherwise).
set -eu
lock_dir="${DAPO_GPU_LOCK_DIR:-/run/dapo-gpus}"

claim_gpu() {  # on success fd 9 holds the lock of the GPU printed
    for gpu in $(echo "$DAPO_GPU_SLOTS" | tr ',' ' '); do
        exec 9>>"$lock_dir/gpu-$gpu.lock"
        if flock -n 9; then
            echo "$(hostname)" > "$lock_dir/gpu-$gpu.owner"
            echo "$gpu"
            return 0
        fi
        exec 9>&-
    done
    return 1
}

if [ "${1:-}" = "gpu-slots" ]; then  # who holds which GPU; frees nothing (nothing to free)
    for lock in "$lock_dir"/gpu-*.lock; do
        [ -e "$lock" ] || continue
        gpu="${lock##*/gpu-}"; gpu="${gpu%.lock}"
        if flock -n "$lock" true; then
            echo "gpu-slots: GPU $gpu free"
        else
            echo "gpu-slots: GPU $gpu held by $(cat "$lock_dir/gpu-$gpu.owner" 2>/dev/null || echo '?')"
        fi
    done
    exit 0
fi

if [ -n "${DAPO_GPU_SLOTS:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    # In the current shell, not $(...): the lock's fd must stay open into `exec dapo`.
    if ! claim_gpu > "$lock_dir/.claim-$$"; then
        rm -f "$lock_dir/.claim-$$"
        echo "dapo-entrypoint: every GPU in DAPO_GPU_SLOTS=$DAPO_GPU_SLOTS is taken" >&2
        exit 1
    fi
    CUDA_VISIBLE_DEVICES="$(cat "$lock_dir/.claim-$$")"
    rm -f "$lock_dir/.claim-$$"
    export CUDA_VISIBLE_DEVICES
    echo "dapo-entrypoint: $(hostname) runs on GPU $CUDA_VISIBLE_DEVICES" >&2
fi

if [ -n "${DAPO_LEARNER_GPU_IDS:-}" ] && [ -z "${DAPO_LEARNER__LAUNCH__RANKS:-}" ]; then
    DAPO_LEARNER__LAUNCH__RANKS="$(echo "$DAPO_LEARNER_GPU_IDS" | tr ',' '\n' | grep -c .)"
    export DAPO_LEARNER__LAUNCH__RANKS
fi

exec dapo "$@"
