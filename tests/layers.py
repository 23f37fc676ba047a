"""The suite's three layers, as markers, and the check that each test stays in its layer.

- `unit` (`make test-fast`): in-process checks; no subprocess, server or Redis.
- `integration` (`make test-integration`): real components (redis-server, gRPC servers,
  DeepSpeed on gloo, tiny models on disk) started by the test itself, in or out of process.
- `system` (`make test-system`): roles started the way users start them: `dapo` and the
  role entry points, the launcher behind `dapo up`, torchrun, containers.

A module's layer is declared here by name (a module not listed is `integration`). While a
test runs, an audit hook sees every process it starts: a unit test that starts any, or an
integration test that starts a role as users do, fails with the module to move.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

UNIT_MODULES = frozenset(
    {
        "test_ablation_results.py",
        "test_algorithm.py",
        "test_async_checkpoint.py",
        "test_batcher_calls.py",
        "test_batching.py",
        "test_bench_results.py",
        "test_buffer_filters.py",
        "test_cli_args.py",
        "test_config.py",
        "test_controller_parts.py",
        "test_correction.py",
        "test_deploy_grafana.py",
        "test_deploy_stack_checks.py",
        "test_devices.py",
        "test_docs_reward.py",
        "test_engine_base.py",
        "test_frame_reader.py",
        "test_no_probes.py",
        "test_no_unsafe_deserialization.py",
        "test_old_logprobs.py",
        "test_packing.py",
        "test_recycled.py",
        "test_report.py",
        "test_reward_shaping.py",
        "test_reward_verifiers.py",
        "test_run_identity.py",
        "test_staleness.py",
        "test_weight_pull.py",
    }
)

SYSTEM_MODULES = frozenset(
    {
        "test_ablation.py",
        "test_architecture.py",
        "test_cli.py",
        "test_cli_fuzz.py",
        "test_config_checks.py",
        "test_dapo_math.py",
        "test_data_validation.py",
        "test_dead_rollout.py",
        "test_deploy_compose.py",
        "test_deploy_images.py",
        "test_gpu_check.py",
        "test_deploy_k8s_commands.py",
        "test_deploy_scrape.py",
        "test_eval.py",
        "test_eval_curve.py",
        "test_eval_vllm.py",
        "test_faults.py",
        "test_generation_budget.py",
        "test_learner_restart.py",
        "test_learner_service.py",
        "test_learner_torchrun.py",
        "test_liveness.py",
        "test_messy_data.py",
        "test_pipeline.py",
        "test_pipeline_secured.py",
        "test_reasoning_task.py",
        "test_readme.py",
        "test_redis_tls.py",
        "test_reliability.py",
        "test_reward_service.py",
        "test_rollout_cores.py",
        "test_rollout_drain.py",
        "test_run_dir.py",
        "test_run_life.py",
        "test_vllm_faults.py",
        "test_vllm_pipeline.py",
        "test_when_done_idle.py",
    }
)

# A process started the way users start a role: a `-m` role module, the CLI, torchrun, a
# container engine.
ROLE_COMMAND = re.compile(
    r"(^| )-m (services\.tools\.cli|services\.(controller|buffer)|rollout|reward|learner)( |$)"
    r"|services\.tools\.cli|(^|[ /])(dapo|torchrun|docker|podman)( |$)"
)


def layer_of(module: str) -> str:
    if module in UNIT_MODULES:
        return "unit"
    return "system" if module in SYSTEM_MODULES else "integration"


def starts_a_role(argv: list[str]) -> bool:
    return bool(ROLE_COMMAND.search(" ".join(argv)))


class ProcessWatch:
    """What the running test has started, from the interpreter's `subprocess.Popen` audit
    events (every thread of this process; the hook can't be removed, so it stays off
    between tests)."""

    def __init__(self) -> None:
        self.started: list[list[str]] | None = None
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[object, ...]) -> None:
        if self.started is None:
            return
        if event == "subprocess.Popen":
            executable, argv = args[0], args[1]
            words = argv.split() if isinstance(argv, str) else [os.fsdecode(a) for a in argv]
            self.started.append(words or [str(executable)])
        elif event in ("os.fork", "os.posix_spawn"):
            self.started.append([event])

    def start(self) -> None:
        self.started = []

    def stop(self) -> list[list[str]]:
        started, self.started = self.started or [], None
        return started


def misplaced(layer: str, started: list[list[str]]) -> str | None:
    """Why a test of `layer` that started these processes belongs elsewhere, and where it
    belongs; None where it stayed in its layer."""
    roles = [argv for argv in started if starts_a_role(argv)]
    if roles and layer != "system":
        return (
            f"this {layer} test started a role as users do ({' '.join(roles[0])[:200]}): "
            "its module belongs in SYSTEM_MODULES"
        )
    if started and layer == "unit":
        return (
            f"this unit test started a process ({' '.join(started[0])[:200]}): "
            "its module belongs in the integration layer"
        )
    return None


_WATCH = ProcessWatch()


def ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under exactly `-m unit` import only the unit modules: importing the rest to deselect
    them would cost ~10 s of a fast run."""
    is_test_module = collection_path.name.startswith("test_") and collection_path.suffix == ".py"
    if config.getoption("markexpr") == "unit" and is_test_module:
        return collection_path.name not in UNIT_MODULES
    return None


MARKS = {
    "unit": pytest.mark.unit,
    "integration": pytest.mark.integration,
    "system": pytest.mark.system,
}


def mark_layers(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(MARKS[layer_of(item.path.name)])


def watch_test() -> None:
    """At a test's setup: from now on, record what it starts."""
    _WATCH.start()


def layer_breach(item: pytest.Item) -> str | None:
    """At a test's teardown report: why it left its layer (None: it did not)."""
    reason = misplaced(layer_of(item.path.name), _WATCH.stop())
    return None if reason is None else f"{item.path.name}: {reason} (tests/layers.py)"
