"""The house's shape, checked: no import cycles, every role starts the same way, and the
torch-free roles start without torch (the layer contract itself is `lint-imports`)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grimp
import pytest

from services.common.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dapo", "services", "learner", "rollout", "reward")
ROLE_MODULES = {
    "controller": "services.controller",
    "buffer": "services.buffer",
    "rollout": "rollout",
    "reward": "reward",
    "learner": "learner",
}


def cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every direct import a -> b that b leads back to: the chain a -> b -> ... -> a."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.append((importer, *back))
    return found


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "b", "c", "d"):
        graph.add_module(name)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert cycles(graph) == [("a", "b", "c", "a"), ("b", "c", "a", "b"), ("c", "a", "b", "c")]


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES)
    assert cycles(graph) == []


def package_imports_of_test_helpers(source: str) -> list[str]:
    """`tests.X` imports: the test helpers (learner_fixtures, pki, ...) are imported by module
    name only, so one module is never loaded twice under two names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            found.append(str(node.module))
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("tests.")]
    return found


def test_test_helpers_are_imported_by_module_name_only() -> None:
    assert package_imports_of_test_helpers("from tests.pki import make_pki\nimport tests.fuzzing")
    offenders = {
        path.name: found
        for path in sorted((ROOT / "tests").glob("*.py"))
        if (found := package_imports_of_test_helpers(path.read_text()))
    }
    assert offenders == {}


SERVER_SIGNS = ("subprocess", "Popen", "redis_server", "start_redis", "tiny_model: ", "grpc.server")


def test_the_layers_list_existing_modules_and_units_start_no_server() -> None:
    """`make test-fast` runs UNIT_MODULES, `make test-system` SYSTEM_MODULES: a renamed
    module would silently drop out, and one that starts a server (not seen by the process
    audit: gRPC servers run in-process) does not belong to the fast layer."""
    from layers import SYSTEM_MODULES, UNIT_MODULES

    listed = UNIT_MODULES | SYSTEM_MODULES
    missing = sorted(name for name in listed if not (ROOT / "tests" / name).is_file())
    assert missing == []
    assert UNIT_MODULES & SYSTEM_MODULES == set()
    heavy = {
        name: signs
        for name in sorted(UNIT_MODULES)
        if (signs := [s for s in SERVER_SIGNS if s in (ROOT / "tests" / name).read_text()])
    }
    assert heavy == {}


@pytest.mark.parametrize("role", ROLE_MODULES)
def test_every_role_prints_its_usage(role: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", ROLE_MODULES[role], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: dapo {role}")
    for flag in ("--config", "--preset", "--set", "--redis-url", "--grpc-port", "--http-port"):
        assert flag in done.stdout


def test_a_bad_config_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.buffer", "--set", "buffer.read_count=-1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("dapo buffer: error: invalid config: buffer.read_count")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("role", ["controller", "buffer", "reward"])
def test_torch_free_roles_start_without_torch(
    role: str, redis_server: RedisServer, tiny_model: Path
) -> None:
    """Started for real (`-X importtime` logs every import to stderr) until it announces
    it is ready, then stopped with SIGTERM. The controller renders prompts with the model's
    tokenizer (transformers' tokenizers, never its torch models)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            ROLE_MODULES[role],
            "--preset",
            "tiny",
            "--redis-url",
            redis_server.url,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--set",
            "reward.num_workers=1",
            "--set",
            f"shared.model_path={tiny_model}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # the watchdog kills the role and its verifier workers
    )
    # The import log goes to stderr as it happens: read it while we wait for "ready", or a
    # log larger than the pipe's buffer blocks the process before it can say it.
    log: list[str] = []
    drain = threading.Thread(target=lambda: log.append(proc.stderr.read() if proc.stderr else ""))
    drain.start()
    watchdog = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))  # a hung start
    watchdog.start()
    try:
        ready = proc.stdout.readline() if proc.stdout else ""
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        drain.join(timeout=60)
    imports = "".join(log)
    assert ready.startswith(f"dapo {role} ready"), (ready, imports[-3000:])
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports.splitlines() if "|" in line}
    assert {"redis", "fastapi"} <= imported  # the log holds the whole start-up
    assert not {"torch", "deepspeed"} & imported
    assert role == "controller" or "transformers" not in imported
