"""docker-compose.yml, .env.example and the Dockerfiles, checked without a Docker engine:
the real docker-compose parser (Debian's docker-compose 1.29, which validates against the
Compose schema) resolves the file for both profiles, and the resolved services are checked
for what a run needs; the Dockerfiles are parsed; the entry point's GPU claim runs."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY, ROOT, require_tool, run_tool

from services.tools.config import load_config

DAPO_HTTP = {"reward": 8001, "buffer": 8005, "controller": 8004, "learner": 8003, "rollout": 8002}
# The services that mount the model (their own per profile): role → service name.
PROFILES = {
    "gpu": (
        ROOT / ".env.example",
        {"controller": "controller", "learner": "learner", "rollout": "rollout"},
    ),
    "cpu": (
        DEPLOY / "compose" / "cpu.env",
        {"controller": "controller-cpu", "learner": "learner-cpu", "rollout": "rollout-cpu"},
    ),
}


def compose_config(env_file: Path, compose_file: Path = ROOT / "docker-compose.yml"):
    binary = require_tool("docker-compose", "docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAPO_", "COMPOSE_"))}
    env.pop("REDIS_PASSWORD_FILE", None)
    return run_tool(
        binary,
        "-f",
        str(compose_file),
        "--project-directory",
        str(ROOT),
        "--env-file",
        str(env_file),
        "config",
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module", params=list(PROFILES))
def resolved(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    done = compose_config(PROFILES[request.param][0])
    assert done.returncode == 0, done.stderr
    return request.param, yaml.safe_load(done.stdout)


def active(config: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services `docker compose up` starts with COMPOSE_PROFILES=profile."""
    return {
        name: s
        for name, s in config["services"].items()
        if not s.get("profiles") or profile in s["profiles"]
    }


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """target → source of a resolved service's volumes (short or long syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        out[target] = source
    return out


def test_the_parser_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = (ROOT / "docker-compose.yml").read_text()
    broken.write_text(text.replace("condition: service_healthy", "condition: service_happy"))
    done = compose_config(ROOT / ".env.example", broken)
    assert done.returncode != 0 and "service_happy" in done.stderr


def test_redis_password_is_required(tmp_path: Path) -> None:
    env_file = tmp_path / "empty.env"
    env_file.write_text("COMPOSE_PROFILES=gpu\nGRAFANA_ADMIN_PASSWORD=x\n")
    done = compose_config(env_file)
    assert done.returncode != 0 and "set REDIS_PASSWORD_FILE in .env" in done.stderr


def test_every_profile_starts_the_whole_pipeline(resolved) -> None:
    profile, config = resolved
    services = active(config, profile)
    roles = PROFILES[profile][1]
    expected = {"redis", "reward", "buffer", "prometheus", "grafana"}
    assert expected | set(roles.values()) <= set(services)
    other = "cpu" if profile == "gpu" else "gpu"
    assert not set(PROFILES[other][1].values()) & set(services)
    gpu_services = {n for n, s in services.items() if "deploy" in s and "resources" in s["deploy"]}
    assert gpu_services == ({"learner", "rollout"} if profile == "gpu" else set())
    # memlock only where NCCL/RDMA pin memory: a host with a low hard limit refuses it
    assert {n for n, s in services.items() if "memlock" in s.get("ulimits", {})} == gpu_services
    torch_roles = [roles["learner"], roles["rollout"]]
    images = {services[n]["image"].split(":")[0] for n in torch_roles}
    assert images == {f"dapo-{profile}"}  # the CPU profile runs the CPU image
    build = {services[n]["build"]["dockerfile"] for n in torch_roles}
    assert build == {f"deploy/docker/Dockerfile.{profile}"}
    assert services[roles["controller"]]["image"].startswith("dapo-slim:")  # torch-free


def test_restarts_survive_a_reboot_and_a_finished_run_stays_finished(resolved) -> None:
    """A service stopped by a daemon or host restart exits 0, which `on-failure` leaves
    down: the long-running ones are `unless-stopped` and idle once the run is done (so
    they don't start it again); the learner is `on-failure`, which its exit code makes
    right (0: done; non-zero: stopped mid-run or crashed). The CPU demo exits at the end
    (make test-containers waits for that). The learner resumes from its volume."""
    profile, config = resolved
    services = config["services"]
    restart, when_done = ("unless-stopped", "idle") if profile == "gpu" else ("on-failure", "exit")
    for role in DAPO_HTTP:
        service = services[PROFILES[profile][1].get(role, role)]
        expected = "on-failure" if role == "learner" else restart
        assert service["restart"] == expected, role
        assert service["environment"]["DAPO_SHARED__WHEN_DONE"] == when_done, role
    for name in ("redis", "prometheus", "grafana"):
        assert services[name]["restart"] == "unless-stopped", name
    learner = services[PROFILES[profile][1]["learner"]]
    env = {k: str(v) for k, v in learner["environment"].items() if k.startswith("DAPO_")}
    run = load_config(mounts(learner)["/etc/dapo/run.yaml"], env=env)
    assert (
        run.learner.checkpoint.dir and mounts(learner)[run.learner.checkpoint.dir] == "checkpoints"
    )


def test_redis_is_durable_and_the_password_only_a_file(resolved, tmp_path: Path) -> None:
    """The password is a secret file: not in redis-server's argv (ps), not in a URL or any
    environment (docker inspect); the start script, run here for real with a stand-in
    redis-server, hands it over on stdin."""
    profile, config = resolved
    redis = config["services"]["redis"]
    assert mounts(redis)["/data"] == "redis-data" and "redis-data" in config["volumes"]
    secret = Path(config["secrets"]["redis-password"]["file"])
    # The demo's file is checked in; .env.example names one the user writes.
    password = secret.read_text().strip() if secret.exists() else "a-long-random-password"
    assert profile == "gpu" or secret.exists()
    assert "REDIS_PASSWORD" not in str(redis.get("environment", {}))
    for name, service in active(config, profile).items():
        if name.startswith(tuple(DAPO_HTTP)) or name == "redis":
            assert password not in yaml.safe_dump(service), name
            sources = [s if isinstance(s, str) else s["source"] for s in service["secrets"]]
            assert sources == ["redis-password"], name
    env = config["services"][PROFILES[profile][1]["controller"]]["environment"]
    assert env["DAPO_SHARED__REDIS_URL"] == "redis://redis:6379/0"
    assert env["DAPO_SECURITY__REDIS__PASSWORD_FILE"] == "/run/secrets/redis-password"
    # The start script with /run/secrets → tmp_path and a redis-server that reports.
    fake = tmp_path / "redis-server"
    fake.write_text('#!/bin/sh\necho "argv: $*"\necho "stdin: $(cat)"\n')
    fake.chmod(0o755)
    (tmp_path / "redis-password").write_text(password + "\n")
    script = redis["command"][-1].replace("/run/secrets", str(tmp_path)).replace("$$", "$")
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        timeout=30,
    )
    argv, stdin = done.stdout.splitlines()
    assert "--appendonly yes" in argv and password not in argv and argv.endswith(" -")
    assert stdin == f'stdin: requirepass "{password}"', done.stdout


def test_dapo_services_have_healthchecks_ports_and_ordering(resolved) -> None:
    profile, config = resolved
    services = config["services"]
    names = {role: PROFILES[profile][1].get(role, role) for role in DAPO_HTTP}
    for role, port in DAPO_HTTP.items():
        service = services[names[role]]
        assert service["command"][0] == role
        assert str(port) in service["command"]
        check = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{port}/" in check and ("/readyz" in check or "/healthz" in check)
        env = service["environment"]
        assert env["DAPO_HTTP_PORT"] == str(port)
        assert env[f"DAPO_{role.upper()}__SERVER__HOST"] == "0.0.0.0"
        assert "ports" not in service  # only the monitoring UIs are published
        assert service["depends_on"]  # nothing starts before Redis (or its producer)
    conditions = {
        (name, dep): spec["condition"]
        for name, service in services.items()
        for dep, spec in service.get("depends_on", {}).items()
    }
    assert conditions[(names["controller"], "reward")] == "service_healthy"
    assert conditions[(names["rollout"], names["learner"])] == "service_healthy"
    assert all(
        c in ("service_healthy", "service_completed_successfully") for c in conditions.values()
    )
    for name, service in services.items():
        if name != "gpu-slots-reset" and name != "init-model":
            assert "healthcheck" in service, name


def test_rollout_servers_are_found_by_prometheus_under_one_name(resolved) -> None:
    profile, config = resolved
    services = config["services"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    for role in DAPO_HTTP:
        job = jobs[f"dapo-{role}"]
        hosts = [t.split(":")[0] for c in job.get("static_configs", []) for t in c["targets"]]
        hosts += [n for c in job.get("dns_sd_configs", []) for n in c["names"]]
        assert hosts == [role]
        name = PROFILES[profile][1].get(role, role)
        aliases = services[name].get("networks", {}).get("default", {}) or {}
        assert name == role or role in aliases.get("aliases", []), (profile, role)


def test_monitoring_mounts_the_project_files(resolved) -> None:
    _, config = resolved
    found = mounts(config["services"]["prometheus"]) | mounts(config["services"]["grafana"])
    assert found["/etc/prometheus"] == str(DEPLOY / "prometheus")
    assert found["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")
    assert found["/var/lib/grafana/dashboards"] == str(DEPLOY / "grafana" / "dashboards")
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dapo.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_the_run_config_of_each_profile_loads(resolved) -> None:
    profile, config = resolved
    learner = config["services"][PROFILES[profile][1]["learner"]]
    source = mounts(learner)["/etc/dapo/run.yaml"]
    env = {k: str(v) for k, v in learner["environment"].items() if k.startswith("DAPO_")}
    run = load_config(source, env=env)
    assert run.shared.redis_url == "redis://redis:6379/0"  # no password in the URL
    assert run.security.redis.password_file == "/run/secrets/redis-password"
    assert run.learner.server.host == "0.0.0.0"
    assert run.learner.publication.socket_port == 50054  # fixed, as on Kubernetes (docs/deploy.md)
    if profile == "cpu":
        assert run.model_path == "/models/tiny" and run.rollout.engine.kind == "torch"
        init = config["services"]["init-model"]
        assert "--out /models/tiny --preset tiny" in " ".join(init["entrypoint"])
    else:
        assert run.model_path == "/models/policy" and run.rollout.engine.kind == "vllm"


def test_every_role_that_reads_the_model_mounts_it(resolved) -> None:
    """The controller renders the prompts with the model's tokenizer, the learner and the
    rollout servers load its weights: each mounts the directory `shared.model_path`
    names, and in the CPU profile starts after init-model has built it."""
    profile, config = resolved
    services = config["services"]
    learner = services[PROFILES[profile][1]["learner"]]
    env = {k: str(v) for k, v in learner["environment"].items() if k.startswith("DAPO_")}
    model = Path(load_config(mounts(learner)["/etc/dapo/run.yaml"], env=env).model_path or "")
    for role, name in PROFILES[profile][1].items():
        service = services[name]
        assert str(service["environment"]["DAPO_SHARED__MODEL_PATH"]) == str(model), name
        assert any(model.is_relative_to(target) for target in mounts(service)), (name, model)
        if profile == "cpu" and role != "rollout":  # rollout-cpu waits for learner-cpu
            assert service["depends_on"]["init-model"]["condition"] == (
                "service_completed_successfully"
            ), name


def test_env_example_names_every_variable_the_compose_file_uses() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{([A-Z_]+)", text))
    example = {
        line.split("=")[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert used - {"DAPO_MODEL_PATH"} <= example, used - example


# ---------------------------------------------------------------- Dockerfiles
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(ins)
    return found


def image_extras(path: Path) -> list[list[str]]:
    """The extras each `python requirements.py EXTRA...` of a Dockerfile names."""
    runs = " ".join(a for w, a in instructions(path) if w == "RUN")
    return [m.split() for m in re.findall(r"python requirements\.py ([\w -]+?) *>", runs)]


def requirements(*extras: str) -> list[str]:
    """What deploy/docker/requirements.py prints for EXTRAS (what an image installs)."""
    script = DEPLOY / "docker" / "requirements.py"
    done = subprocess.run(
        [sys.executable, str(script), *extras], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.splitlines()


def dockerignored(relative: str) -> bool:
    patterns = [
        p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")
    ]
    return any(fnmatch.fnmatch(relative, p) or relative.startswith(p + "/") for p in patterns)


@pytest.mark.parametrize("name", ["Dockerfile.slim", "Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfile_is_pinned_multistage_nonroot_and_healthchecked(name: str) -> None:
    path = DEPLOY / "docker" / name
    args = dict(a.split("=", 1) for w, a in instructions(path) if w == "ARG" and "=" in a)
    built = stages(path)
    assert len(built) >= 2, "multi-stage"
    names = [stage[0][1].split()[-1] for stage in built if " AS " in stage[0][1].upper()]
    for stage in built:
        image = stage[0][1].split()[0]
        if image in names:  # built on an earlier stage of this file
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), image
    final = dict(built[-1])
    user = final["USER"].split(":")[0]
    assert user not in ("root", "0") and int(user) >= 1000
    assert "/healthz" in final["HEALTHCHECK"] and final["ENTRYPOINT"]
    copies = [a for stage in built for w, a in stage if w == "COPY" and "--from" not in a]
    for copy in copies:
        sources = [s for s in copy.split()[:-1] if not s.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not dockerignored(source.rstrip("/")), f"{source} is in .dockerignore"


def test_slim_image_stays_torch_free() -> None:
    path = DEPLOY / "docker" / "Dockerfile.slim"
    installs = " ".join(a for w, a in instructions(path) if w == "RUN" and "pip install" in a)
    assert image_extras(path) == [["reward"]]
    heavy = [r for r in requirements("reward") if re.match(r"(torch|vllm|deepspeed)\b", r)]
    assert not heavy
    assert not re.search(r"\b(torch|vllm|deepspeed)\b(?!\|)", installs.split("&& !")[0])
    gpu = " ".join(a for w, a in instructions(DEPLOY / "docker" / "Dockerfile.gpu") if w == "RUN")
    assert "vllm==" in gpu and "deepspeed==" in gpu and '".[rollout,learner,reward]"' in gpu


def _entrypoint(tmp_path: Path, hostname: str, slots: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dapo").write_text('#!/bin/sh\necho "dapo $* gpu=${CUDA_VISIBLE_DEVICES:-none}"\n')
    (bin_dir / "hostname").write_text(f"#!/bin/sh\necho {hostname}\n")
    for tool in ("dapo", "hostname"):
        (bin_dir / tool).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "DAPO_GPU_SLOTS": slots,
        "DAPO_GPU_LOCK_DIR": str(tmp_path / "locks"),
    }
    (tmp_path / "locks").mkdir(exist_ok=True)
    script = DEPLOY / "docker" / "entrypoint.sh"
    return subprocess.run(
        ["sh", str(script), "rollout", "--config", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )


def test_entrypoint_frees_an_exited_replicas_gpu(tmp_path: Path) -> None:
    """A claim lives as long as its replica's process (an flock): one that exited leaves
    its GPU free. Running replicas on distinct GPUs: tests/test_gpu_slots.py."""
    first = _entrypoint(tmp_path, "replica-a", "0,1")
    second = _entrypoint(tmp_path, "replica-b", "0,1")
    assert first.stdout.strip() == "dapo rollout --config x gpu=0"
    assert second.stdout.strip() == "dapo rollout --config x gpu=0"


def test_the_learner_checkpoints_within_its_stop_grace_period(resolved, tmp_path: Path) -> None:
    """`docker compose stop` SIGTERMs, then SIGKILLs after stop_grace_period: the learner
    gives its ranks learner.launch.shutdown_timeout_s to checkpoint, which must fit."""
    profile, config = resolved
    learner = config["services"][PROFILES[profile][1]["learner"]]
    env = {k: str(v) for k, v in learner["environment"].items() if k.startswith("DAPO_")}
    run = load_config(mounts(learner)["/etc/dapo/run.yaml"], env=env)
    grace = duration_s(learner["stop_grace_period"])
    assert grace >= run.learner.launch.shutdown_timeout_s + 20, (grace, profile)


def test_a_large_model_load_does_not_abort_compose_up(resolved) -> None:
    """Rollouts start once the learner is healthy; a learner still loading a 32B model
    (~30 min) must not be judged unhealthy meanwhile."""
    profile, config = resolved
    for role in ("learner", "rollout"):
        check = config["services"][PROFILES[profile][1][role]]["healthcheck"]
        assert duration_s(check["start_period"]) >= 1800, (profile, role)


def test_prometheus_listens_on_this_host_only_without_the_lifecycle_api(resolved) -> None:
    """Prometheus has no authentication: published on 127.0.0.1 only, and without
    --web.enable-lifecycle (anyone reaching it could shut it down or reload it)."""
    _, config = resolved
    prometheus = config["services"]["prometheus"]
    assert "--web.enable-lifecycle" not in prometheus["command"]
    for port in prometheus["ports"]:
        published = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}"
        assert published.startswith("127.0.0.1:"), port


def duration_s(value: str | int | float) -> float:
    """A compose duration ('1m30s', '150s') or seconds in seconds."""
    if isinstance(value, int | float):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms|us)", value)
    assert parts, value
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)
