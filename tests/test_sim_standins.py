"""The simulated cluster credits only what production does: its engine stand-in takes
its concurrency from the production engine it stands for (vLLM), through the same
config and the same rule, and declares none of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks._sim_cluster import Mode, Shape, sim_config
from benchmarks._sim_standins import SimCosts, SimEngine
from rollout.config import VllmEngineConfig
from rollout.vllm_engine import VllmEngine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("calls", [1, 3, 64])
def test_the_engine_stand_in_takes_the_vllm_engines_concurrency(tokenizer, calls: int) -> None:
    config = VllmEngineConfig(max_concurrent_calls=calls)
    engine = SimEngine(tokenizer, SimCosts(), False, config)
    assert engine.max_concurrent_calls == VllmEngine.concurrency(config) == calls


def test_the_simulated_run_configures_the_engine_it_stands_for(tiny_model: Path, tokenizer):
    config = sim_config(Mode("async_partial", 4, True), tiny_model, "redis://x:1", Shape())
    assert isinstance(config.rollout.engine, VllmEngineConfig)
    engine = SimEngine(tokenizer, SimCosts(), config.partial_rollouts(), config.rollout.engine)
    assert engine.max_concurrent_calls == VllmEngineConfig().max_concurrent_calls


def declared_literals(source: str) -> list[str]:
    """`max_concurrent_calls = <number>` or a `max_concurrent_calls` that returns a number."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [ast.unparse(t).rsplit(".", 1)[-1] for t in targets]
            if "max_concurrent_calls" in names and isinstance(node.value, ast.Constant):
                found.append(ast.unparse(node))
        if isinstance(node, ast.FunctionDef) and node.name == "max_concurrent_calls":
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
            if any(isinstance(r.value, ast.Constant) for r in returns):
                found.append(f"def {node.name}: returns a literal")
    return found


def test_no_benchmark_declares_a_concurrency_of_its_own() -> None:
    planted = "class E:\n    max_concurrent_calls = 64\n"
    assert declared_literals(planted) and declared_literals(
        "class E:\n    @property\n    def max_concurrent_calls(self):\n        return 64\n"
    )
    found = {
        path.name: hits
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        if (hits := declared_literals(path.read_text()))
    }
    assert not found, found
