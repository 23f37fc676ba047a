#!/bin/sh
# make test-containers: the CPU compose stack in real containers, on a machine that can
# reach Debian and PyPI but no image registry (docs/deploy.md, "Checked in containers").
# Debian's docker.io (legacy builder) and docker-compose 1.29; base images made with
# mmdebstrap + docker import; redis and prometheus stand in from Debian packages (no
# Grafana: no Debian package). Builds dapo-slim and dapo-cpu, runs the tiny preset to its
# last step, checks that every dapo service exited 0 and stayed down, and that the run is
# done at version == total_steps. Needs root. Leaves the images (cache), removes the rest.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${DAPO_CT_WORK:-/tmp/dapo-containers}
PROJECT=dapo-ct
DOCKER=/usr/bin/docker
COMPOSE="docker-compose -p $PROJECT --project-directory $ROOT -f $ROOT/docker-compose.yml --env-file $ROOT/deploy/compose/cpu.env"
mkdir -p "$WORK"
started=$(date +%s)
say() { echo "[test-containers +$(( $(date +%s) - started ))s] $*"; }

command -v mmdebstrap >/dev/null && command -v docker-compose >/dev/null && [ -x $DOCKER ] \
    || apt-get install -y -q docker.io docker-compose mmdebstrap >"$WORK/apt.log"
DOCKERD_PID= WHEELS_PID=
if ! $DOCKER info >/dev/null 2>&1; then
    dockerd --storage-driver=overlay2 >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 1; done
fi
cleanup() {
    $COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
    [ -z "$WHEELS_PID" ] || kill "$WHEELS_PID" 2>/dev/null || true
    if [ -n "$DOCKERD_PID" ]; then kill "$DOCKERD_PID"; wait "$DOCKERD_PID" || true; fi
}
trap cleanup EXIT

# image NAME PACKAGES DOCKER-IMPORT-CHANGES...: a Debian bookworm image, unless it exists.
image() {
    name=$1 packages=$2; shift 2
    $DOCKER image inspect "$name" >/dev/null 2>&1 && return 0
    say "mmdebstrap $name ($packages)"
    mmdebstrap -q --variant=minbase --include="$packages" \
        --customize-hook='mkdir -p "$1/etc/ssl/certs"' \
        --customize-hook='copy-in /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs' \
        bookworm "$WORK/base.tar"
    $DOCKER import "$@" "$WORK/base.tar" "$name" >/dev/null
    rm -f "$WORK/base.tar"
}
CERT=/etc/ssl/certs/ca-certificates.crt
image dapo-base:bookworm python3,python3-venv,python-is-python3,ca-certificates,libgomp1,passwd \
    --change "ENV PIP_CERT=$CERT" --change "ENV SSL_CERT_FILE=$CERT"
image redis:7.4.2-alpine redis-server,redis-tools --change 'WORKDIR /data' \
    --change 'CMD ["redis-server"]'
image prom/prometheus:v2.53.4 prometheus,wget --change 'ENTRYPOINT ["/usr/bin/prometheus"]'

# DAPO_CT_WHEELS: a directory with the CPU torch wheel, served to the build over HTTP where
# download.pytorch.org cannot be reached.
TORCH_ARGS=
if [ -n "${DAPO_CT_WHEELS:-}" ]; then
    gateway=$($DOCKER network inspect bridge -f '{{(index .IPAM.Config 0).Gateway}}')
    python3 -m http.server 8765 --bind "$gateway" --directory "$DAPO_CT_WHEELS" \
        >"$WORK/wheels.log" 2>&1 &
    WHEELS_PID=$!
    TORCH_ARGS="--find-links http://$gateway:8765/ --trusted-host $gateway"
fi
for kind in slim cpu; do
    say "docker build dapo-$kind (legacy builder)"
    DOCKER_BUILDKIT=0 $DOCKER build -q --build-arg PYTHON_IMAGE=dapo-base:bookworm \
        ${TORCH_ARGS:+--build-arg "TORCH_PIP_ARGS=$TORCH_ARGS"} \
        -f "$ROOT/deploy/docker/Dockerfile.$kind" -t "dapo-$kind:latest" "$ROOT" >/dev/null
done
[ -z "${WHEELS_PID:-}" ] || kill "$WHEELS_PID"

STEPS=$(sed -n 's/^  total_steps: *//p' "$ROOT/examples/tiny-cpu.yaml")
say "compose up (cpu profile, $STEPS steps)"
$COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
$COMPOSE up -d redis reward buffer controller learner-cpu rollout-cpu prometheus
learner=$($COMPOSE ps -q learner-cpu)
timeout "${DAPO_CT_RUN_TIMEOUT:-600}" $DOCKER wait "$learner" >/dev/null
sleep 15  # the other services see "run done" and exit; on-failure must leave them down
say "checking"
$COMPOSE ps
status=0
for service in reward buffer controller learner-cpu rollout-cpu; do
    id=$($COMPOSE ps -q "$service")
    state=$($DOCKER inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$id")
    echo "$service: $state (status, exit code, restarts)"
    [ "$state" = "exited 0 0" ] || status=1
done
cli="$COMPOSE exec -T -e REDISCLI_AUTH=dapo-cpu-demo redis redis-cli"
version=$($cli GET dapo:tiny:version | tr -d '\r')
done_at=$($cli GET dapo:tiny:done | tr -d '\r')
echo "version=$version done=$done_at total_steps=$STEPS"
[ "$version" = "$STEPS" ] && [ "$done_at" = "$STEPS" ] || status=1
[ $status = 0 ] || { $COMPOSE logs --tail 30; say "FAILED"; exit 1; }
say "passed"
