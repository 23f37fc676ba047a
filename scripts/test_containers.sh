#!/bin/sh
# make test-containers (the end of `make test`): the CPU compose stack in real containers,
# on a machine that can reach Debian and PyPI but no image registry (docs/deploy.md,
# "Checked in containers"). Debian's docker.io (legacy builder) and docker-compose 1.29;
# one mmdebstrap bootstrap, imported as the base image and as stand-ins for the redis and
# prometheus images, under names of their own (dapo-ct-redis, dapo-ct-prometheus: never an
# upstream tag a later real `up` could mistake for the real image; no Grafana: no Debian
# package, its provisioning is checked by tests/test_deploy_grafana.py). Builds dapo-slim
# and dapo-cpu, runs the tiny preset and, mid-run, SIGKILLs the learner's process and then
# a rollout server's inside their containers (a crash, which `restart: on-failure`
# restarts; `docker kill` would not be one). Checks: the learner resumed from its
# checkpoint volume, the run reached its last step, every dapo service exited 0 (the two
# crashed ones after one restart each); `dapo ledger` holds, through a one-off container;
# Prometheus saw every scrape job up and every Grafana panel query has data; a learner
# restarted after the run trains nothing; a second run after `down -v` runs to its end.
# Leaves the images (cache), removes the rest.
#
# DAPO_CT_COLD=1: from a Docker daemon that has never run: a fresh, empty data root, the
# docker0 bridge removed first (its first start reports no gateway for the bridge
# network), no image cached; needs no other dockerd running; the data root is removed
# after. What CI gets on a new machine.
#
# Skips (exit 0, one line why) only where no container engine can be had or used: not
# root, docker.io/docker-compose/mmdebstrap not installable, dockerd not starting, under
# 8 GB of disk, no base image, a container that cannot run or reach PyPI, Debian or a CPU
# torch wheel; or DAPO_SKIP_CONTAINERS=1. Past those, anything wrong fails (exit 1) with
# logs.
#
# DAPO_CT_WHEELS: a directory with the CPU torch wheel, served to the build over HTTP
# (default /opt/wheels when it holds one; else download.pytorch.org's CPU index).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${DAPO_CT_WORK:-/tmp/dapo-containers}
PROJECT=dapo-ct
DOCKER=/usr/bin/docker
COLD=${DAPO_CT_COLD:-0}
# compose.test.yml: Prometheus with deploy/prometheus's jobs and rules, scraping every 3 s
# (not 15 s): a rollout server that lives 40 s on a fast machine is still scraped often.
COMPOSE="docker-compose -p $PROJECT --project-directory $ROOT
    --env-file $ROOT/deploy/compose/cpu.env -f $ROOT/docker-compose.yml -f $WORK/compose.test.yml"
SERVICES="reward buffer controller-cpu learner-cpu rollout-cpu"
REDIS_PASSWORD=dapo-cpu-demo  # deploy/compose/cpu.env
started=$(date +%s) STACK_UP=
say() { echo "[test-containers +$(( $(date +%s) - started ))s] $*"; }
skip() { echo "make test-containers: skipped: $*"; exit 0; }
# fail WHAT [LOG]: the reason, the log's tail and the stack's logs; exit 1.
fail() {
    [ -z "${2:-}" ] || tail -n 40 "$2"
    [ -z "$STACK_UP" ] || $COMPOSE logs --tail 30 2>/dev/null || true
    say "FAILED: $1 (wall time $(( $(date +%s) - started )) s)"
    exit 1
}
# free_port [HOST [PORT]]: PORT if it is free on HOST, else a free port there.
free_port() {
    python3 -c 'import socket, sys; s = socket.socket(); a = sys.argv[1:] + ["", "0"]
try:
    s.bind((a[0], int(a[1])))
except OSError:
    s.bind((a[0], 0))
print(s.getsockname()[1])' "$@"
}

# ------------------------------------------------ preconditions: skip where not met
case ${DAPO_SKIP_CONTAINERS:-0} in
    0 | "") ;;
    *) skip "by request (DAPO_SKIP_CONTAINERS=$DAPO_SKIP_CONTAINERS)" ;;
esac
[ "$(id -u)" = 0 ] || skip "not root"
mkdir -p "$WORK"
# The CPU torch wheel: from DAPO_CT_WHEELS (or /opt/wheels) over HTTP on the bridge's
# gateway (below), else from download.pytorch.org's CPU index (the Dockerfile's default).
WHEELS=${DAPO_CT_WHEELS:-}
if [ -z "$WHEELS" ] && ls /opt/wheels/torch-*.whl >/dev/null 2>&1; then WHEELS=/opt/wheels; fi
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
    fail "DAPO_CT_WHEELS=$WHEELS holds no torch wheel"  # a setting, not the machine
fi

install_tools() {
    command -v mmdebstrap >/dev/null && command -v docker-compose >/dev/null && [ -x $DOCKER ] \
        && return 0
    say "apt-get install docker.io docker-compose mmdebstrap"
    set -- apt-get install -y -q docker.io docker-compose mmdebstrap
    DEBIAN_FRONTEND=noninteractive "$@" >"$WORK/apt.log" 2>&1 && return 0
    apt-get update -q >>"$WORK/apt.log" 2>&1 || true  # stale lists on a fresh machine
    DEBIAN_FRONTEND=noninteractive "$@" >>"$WORK/apt.log" 2>&1
}
install_tools \
    || skip "apt-get could not install docker.io docker-compose mmdebstrap ($WORK/apt.log)"

DOCKERD_PID= WHEELS_PID= BUILD_PIDS= DATA_ROOT=
cleanup() {
    [ -z "$BUILD_PIDS" ] || kill $BUILD_PIDS 2>/dev/null || true  # the other build, on a failure
    if [ -n "$STACK_UP" ]; then
        $COMPOSE logs --no-color -t >"$WORK/stack.log" 2>&1 || true
        $COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    [ -z "$WHEELS_PID" ] || kill "$WHEELS_PID" 2>/dev/null || true
    [ -z "$DOCKERD_PID" ] || { kill "$DOCKERD_PID" 2>/dev/null; wait "$DOCKERD_PID"; } || true
    [ -z "$DATA_ROOT" ] || rm -rf "$DATA_ROOT"
}
trap cleanup EXIT
trap "exit 143" INT TERM  # so the EXIT trap cleans up after a signal too

start_dockerd() {
    if [ "$COLD" != 0 ]; then
        # A daemon that has never run: no data root, no docker0 bridge.
        ! $DOCKER info >/dev/null 2>&1 || fail "DAPO_CT_COLD=1 needs no dockerd running (stop it first)"
        DATA_ROOT=$WORK/cold-docker
        rm -rf "$DATA_ROOT"
        ip link del docker0 2>/dev/null || true
        set -- --data-root "$DATA_ROOT"
    else
        $DOCKER info >/dev/null 2>&1 && return 0
        set --
    fi
    dockerd --storage-driver=overlay2 "$@" >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        $DOCKER info >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    tail -n 5 "$WORK/dockerd.log"
    return 1
}
start_dockerd || skip "dockerd did not start ($WORK/dockerd.log)"
[ "$COLD" = 0 ] || say "cold: a new dockerd on the empty data root $DATA_ROOT"
# The images and their build layers took 4.3 GB from nothing here; the base tar 0.6 GB more.
data=$($DOCKER info -f '{{.DockerRootDir}}')
free_gb=$(( $(df -Pk "$data" "$WORK" | awk 'NR > 1 {print $4}' | sort -n | head -n 1) / 1048576 ))
[ "$free_gb" -ge 8 ] || skip "under 8 GB free for $data and $WORK ($free_gb GB)"

# One minbase bootstrap for the three images (each import shares its one layer): the
# python for the dapo builds, redis-server and prometheus for the stand-ins.
CERT=/etc/ssl/certs/ca-certificates.crt
# Stand-ins under names of their own: an upstream tag (redis:7.4.2-alpine) on a Debian
# build would be used by a later real `up` on this host without a pull.
BASE=dapo-base:bookworm REDIS=dapo-ct-redis:bookworm PROMETHEUS=dapo-ct-prometheus:bookworm
base_images() {
    missing=
    for name in $BASE $REDIS $PROMETHEUS; do
        $DOCKER image inspect "$name" >/dev/null 2>&1 || missing="$missing $name"
    done
    [ -n "$missing" ] || return 0
    # A bootstrap of an earlier run is Debian's state, not Docker's: reused even when cold.
    if [ -f "$WORK/base.tar" ] && [ -s "$WORK/base.tar" ]; then
        say "docker import$missing (bootstrap of an earlier run)"
    else
        say "mmdebstrap bookworm for$missing"
        bootstrap || return 1
    fi
    import_images $missing
}
bootstrap() {
    rm -rf "$WORK/base.new.tar"
    packages=python3,python3-venv,python-is-python3,ca-certificates,libgomp1,passwd
    mmdebstrap -q --variant=minbase --include=$packages,redis-server,redis-tools,prometheus,wget \
        --customize-hook='mkdir -p "$1/etc/ssl/certs"' \
        --customize-hook="copy-in $CERT /etc/ssl/certs" \
        bookworm "$WORK/base.new.tar" >"$WORK/mmdebstrap.log" 2>&1 || return 1
    mv "$WORK/base.new.tar" "$WORK/base.tar"
}
import_images() {
    for name in "$@"; do
        case $name in
            "$BASE") set -- --change "ENV PIP_CERT=$CERT" --change "ENV SSL_CERT_FILE=$CERT" ;;
            "$REDIS") set -- --change 'WORKDIR /data' --change 'CMD ["redis-server"]' ;;
            "$PROMETHEUS") set -- --change 'ENTRYPOINT ["/usr/bin/prometheus"]' ;;
        esac
        $DOCKER import "$@" "$WORK/base.tar" "$name" >/dev/null || return 1
    done
}
base_images \
    || skip "mmdebstrap + docker import could not make the base images ($WORK/mmdebstrap.log)"
$DOCKER run --rm $BASE true >"$WORK/smoke.log" 2>&1 \
    || skip "a container could not run: $(tail -n 1 "$WORK/smoke.log")"

TORCH_ARGS= TORCH_URL=https://download.pytorch.org/whl/cpu/torch/
# bridge_gateway: the host's address on Docker's default bridge, which containers (and so
# builds) reach. A daemon's first start reports no Gateway for the bridge network: then the
# docker0 interface's address, then the first address of the bridge's subnet.
bridge_gateway() {
    gw=$($DOCKER network inspect bridge -f '{{range .IPAM.Config}}{{.Gateway}}{{end}}' 2>/dev/null)
    [ -n "$gw" ] || gw=$(ip -4 -o addr show dev docker0 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    if [ -z "$gw" ]; then
        subnet=$($DOCKER network inspect bridge -f '{{range .IPAM.Config}}{{.Subnet}}{{end}}' 2>/dev/null)
        [ -z "$subnet" ] || gw=$(python3 -c 'import ipaddress, sys
print(next(ipaddress.ip_network(sys.argv[1]).hosts()))' "$subnet")
    fi
    echo "$gw"
}
if [ -n "$WHEELS" ]; then
    gateway=$(bridge_gateway)
    [ -n "$gateway" ] || fail "no address for the docker0 bridge (docker network inspect bridge)"
    port=$(free_port "$gateway" 8765)  # the same port each run, or the build's cache misses
    python3 -m http.server "$port" --bind "$gateway" --directory "$WHEELS" \
        >"$WORK/wheels.log" 2>&1 &
    WHEELS_PID=$!
    TORCH_ARGS="--find-links http://$gateway:$port/ --trusted-host $gateway"
    TORCH_URL=http://$gateway:$port/
fi
# python3 -c "$FETCH" URL...: print each URL that cannot be fetched, and why.
FETCH='
import sys, urllib.request
bad = []
for url in sys.argv[1:]:
    try:
        urllib.request.urlopen(url, timeout=20).close()
    except Exception as exc:
        bad.append(f"{url} ({exc})")
print(", ".join(bad))
sys.exit(1 if bad else 0)'
if [ -n "$WHEELS" ]; then
    for _ in $(seq 20); do python3 -c "$FETCH" "$TORCH_URL" >/dev/null && break; sleep 0.5; done
    python3 -c "$FETCH" "$TORCH_URL" >/dev/null \
        || fail "the wheel server did not start ($WORK/wheels.log)"
fi
# What the builds fetch: PyPI (pip), Debian (apt-get in Dockerfile.cpu), the torch wheel.
unreachable=$($DOCKER run --rm $BASE python3 -c "$FETCH" https://pypi.org/simple/pip/ \
    http://deb.debian.org/debian/dists/bookworm/Release "$TORCH_URL" 2>&1) \
    || skip "containers cannot reach $unreachable"
say "preconditions met (torch from ${WHEELS:-download.pytorch.org})"

# ------------------------------------------------ from here on: failures are failures
# build KIND: dapo-KIND with the legacy builder; its log in WORK.
build() {
    DOCKER_BUILDKIT=0 $DOCKER build --force-rm --build-arg PYTHON_IMAGE=$BASE \
        ${TORCH_ARGS:+--build-arg "TORCH_PIP_ARGS=$TORCH_ARGS"} \
        -f "$ROOT/deploy/docker/Dockerfile.$1" -t "dapo-$1:latest" "$ROOT" \
        >"$WORK/build-$1.log" 2>&1
}
# rebuild KIND: once more, from the layers cached so far: a download that broke mid-build
# is not a failure of the images; the same error twice is.
rebuild() {
    tail -n 5 "$WORK/build-$1.log"
    say "docker build dapo-$1 failed; once more"
    build "$1" || fail "docker build dapo-$1, twice" "$WORK/build-$1.log"
}
say "docker build dapo-slim and dapo-cpu (legacy builder, side by side)"
build slim & slim_pid=$!
build cpu & cpu_pid=$!
BUILD_PIDS="$slim_pid $cpu_pid"
wait $slim_pid || rebuild slim
wait $cpu_pid || rebuild cpu
BUILD_PIDS=
[ -z "$WHEELS_PID" ] || { kill "$WHEELS_PID"; WHEELS_PID=; }
say "built"

# The run: up; mid-run the learner's process, then a rollout server's, is SIGKILLed inside
# its container; then until every dapo service has exited (a restart is seen as running).
STEPS=$(sed -n 's/^  total_steps: *//p' "$ROOT/examples/tiny-cpu.yaml")
EVERY=$(sed -n '/^  checkpoint:/,/^  [a-z]/s/^    every: *//p' "$ROOT/examples/tiny-cpu.yaml")
KILL_LEARNER_AT=$(( EVERY + EVERY / 2 ))  # past the first checkpoint
KILL_ROLLOUT_AT=$(( STEPS * 3 / 4 ))
PROMETHEUS_PORT=$(free_port)
export PROMETHEUS_PORT  # over cpu.env's 9090, which may be taken here
rm -rf "$WORK/prometheus" && cp -r "$ROOT/deploy/prometheus" "$WORK/prometheus"
sed -Ei 's/^([[:space:]]*(scrape|evaluation|refresh)_interval:).*/\1 3s/' \
    "$WORK/prometheus/prometheus.yml"
cat >"$WORK/compose.test.yml" <<EOF
services:
  redis:
    image: $REDIS
  prometheus:
    image: $PROMETHEUS
    volumes: ["$WORK/prometheus:/etc/prometheus:ro"]
EOF
$COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
status=0
check() { echo "FAILED: $*"; status=1; }
redis_get() {
    $COMPOSE exec -T -e REDISCLI_AUTH=$REDIS_PASSWORD redis redis-cli GET "$1" 2>/dev/null \
        | tr -d '\r'
}
# crash SERVICE VERSION: SIGKILL its process (the container's PID 1, `dapo ROLE`) from the
# host, as the OOM killer or a segfault would end it. Docker applies the restart policy to
# this, not to `docker kill` / `docker compose kill`.
crash() {
    pid=$($DOCKER inspect -f '{{.State.Pid}}' "$($COMPOSE ps -q "$1")")
    [ "$pid" -gt 0 ] || fail "$1 has no process to kill"
    kill -9 "$pid"
    say "SIGKILL to $1's process (host pid $pid) at version $2"
}
restarts() { $DOCKER inspect -f '{{.RestartCount}}' "$($COMPOSE ps -q "$1")"; }
# versions LABEL [EXACT]: the run is marked done at the version it ended with; with EXACT
# (no learner crash) that is total_steps. A learner restored from an older checkpoint
# republishes from there under new, higher versions (the version never goes back), so a
# crashed run ends at a version above total_steps. FINAL: the version it ended with.
versions() {
    version=$(redis_get dapo:tiny:version) done_at=$(redis_get dapo:tiny:done)
    echo "version=$version done=$done_at total_steps=$STEPS ($1)"
    [ -n "$version" ] && [ "$version" = "$done_at" ] && [ "$version" -ge "$STEPS" ] \
        || check "done ($done_at) is not the last version ($version) >= $STEPS [$1]"
    [ -z "${2:-}" ] || [ "$version" = "$STEPS" ] || check "version $version != $STEPS [$1]"
    FINAL=$version
}
# `dapo ledger` (services/tools/ledger.py) in a one-off dapo-slim container on the stack's
# network: the controller has exited by now, so `exec controller-cpu` could not run it.
ledger() {
    $COMPOSE run --rm --no-deps -T controller-cpu ledger --config /etc/dapo/run.yaml \
        >"$WORK/ledger.log" 2>&1 || { cat "$WORK/ledger.log"; check "dapo ledger ($1)"; return; }
    tail -n 1 "$WORK/ledger.log"
    grep -q '^identity holds$' "$WORK/ledger.log" || check "dapo ledger ($1): no 'identity holds'"
}

# run LABEL KILLS: up; wait for the end, crashing the learner then a rollout server mid-run
# when KILLS=yes; check how every dapo service ended, the versions and the ledger.
run() {
    say "compose up (cpu profile, $STEPS steps; Prometheus on :$PROMETHEUS_PORT) [$1]"
    run_since=$(date +%s) STACK_UP=1
    $COMPOSE up -d redis reward buffer controller-cpu learner-cpu rollout-cpu prometheus \
        >"$WORK/up.log" 2>&1 || fail "compose up [$1]" "$WORK/up.log"
    ids=$(for service in $SERVICES; do $COMPOSE ps -q "$service"; done)
    [ "$(echo $ids | wc -w)" = "$(echo $SERVICES | wc -w)" ] || fail "a dapo service has no container"
    deadline=$(( $(date +%s) + ${DAPO_CT_RUN_TIMEOUT:-900} ))
    killed_learner= killed_rollout=
    while $DOCKER inspect -f '{{.State.Status}}' $ids | grep -qv '^exited$'; do
        [ "$(date +%s)" -lt $deadline ] || fail "the run did not end in ${DAPO_CT_RUN_TIMEOUT:-900} s"
        if [ "$2" = yes ]; then
            version=$(redis_get dapo:tiny:version)
            if [ -z "$killed_learner" ] && [ "${version:-0}" -ge $KILL_LEARNER_AT ]; then
                crash learner-cpu "$version"
                # The learner may have stepped (and checkpointed) between the poll and
                # the kill: the version it died at is the one Redis holds now.
                killed_learner=$(redis_get dapo:tiny:version)
            elif [ -n "$killed_learner" ] && [ -z "$killed_rollout" ] \
                && [ "${version:-0}" -ge $KILL_ROLLOUT_AT ] && [ "$(restarts learner-cpu)" = 1 ]
            then
                crash rollout-cpu "$version"
                killed_rollout=$version
            fi
        fi
        sleep 1
    done
    sleep 5  # on-failure would restart a crashed one by now
    say "run ended [$1]; checking"
    $COMPOSE ps
    if [ "$2" = yes ]; then
        [ -n "$killed_learner" ] || check "the learner was not killed mid-run (the run ended first)"
        [ -n "$killed_rollout" ] || check "no rollout server was killed mid-run (the run ended first)"
    fi
    for id in $ids; do
        service=$($DOCKER inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$id")
        state=$($DOCKER inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$id")
        echo "$service: $state (status, exit code, restarts)"
        expected="exited 0 0"
        case "$2 $service" in
            "yes learner-cpu" | "yes rollout-cpu") expected="exited 0 1" ;;  # crashed once
        esac
        [ "$state" = "$expected" ] || check "$service: $state, not $expected [$1]"
    done
    if [ "$2" = yes ]; then
        $COMPOSE logs --no-color learner-cpu >"$WORK/learner.log" 2>&1
        resumed=$(sed -n 's/.*resumed step=\([0-9]*\) .*/\1/p' "$WORK/learner.log" | head -n 1)
        echo "learner: killed at version ${killed_learner:-none}, resumed at step ${resumed:-none}"
        [ -n "$resumed" ] && [ "$resumed" -gt 0 ] && [ "$resumed" -le "${killed_learner:-0}" ] \
            || check "the restarted learner did not resume from a checkpoint taken before its crash"
        grep -q "reached total_steps=$STEPS; run done" "$WORK/learner.log" \
            || check "the learner did not reach total_steps=$STEPS"
        versions "$1"
    else
        versions "$1" exact
    fi
    ledger "$1"
}

run_first=$(date +%s)
run "first run" yes
phase=$(date +%s)

say "Prometheus: every scrape job up, every Grafana panel query with data"
python3 "$ROOT/scripts/prometheus_checks.py" --url "http://127.0.0.1:$PROMETHEUS_PORT" \
    --config "$WORK/prometheus/prometheus.yml" --since "$run_since" || check "Prometheus (above)"

# The learner again after the run, as `restart: on-failure` would start it (same image,
# volumes and command; no lingering): it must restore step STEPS from the checkpoint
# volume and publish no new version (a learner without its checkpoint would publish the
# base model as version STEPS + 1).
say "learner-cpu restarted after the run"
$COMPOSE run --rm --no-deps -T -e DAPO_LEARNER__LINGER_S=0 learner-cpu \
    >"$WORK/learner-restart.log" 2>&1 || check "the restarted learner exited $?"
grep -q "resumed step=$STEPS version=$FINAL " "$WORK/learner-restart.log" \
    || check "the restarted learner did not resume at step $STEPS, version $FINAL"
grep -q "reached total_steps=$STEPS; run done" "$WORK/learner-restart.log" \
    || check "the restarted learner did not see the run done"
if grep -q ' step=[0-9]* loss=' "$WORK/learner-restart.log"; then
    check "the restarted learner trained"
fi
final=$FINAL
versions "after the restart"
[ "$FINAL" = "$final" ] || check "the restarted learner published a new version ($FINAL)"

# A second run: `down -v` (docs/deploy.md: the volumes hold the finished run), then up.
say "down -v, then a second run"
$COMPOSE down -v --remove-orphans >"$WORK/down.log" 2>&1 || check "compose down -v"
STACK_UP=
run "second run" no
say "first run $(( phase - run_first )) s, then checks and a second run $(( $(date +%s) - phase )) s"

wall=$(( $(date +%s) - started ))
[ $status = 0 ] || fail "checks above" "$WORK/learner.log"
say "passed (wall time $wall s)"
