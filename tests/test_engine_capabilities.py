"""Engine capabilities are declared in `RolloutEngine`, never probed: no `getattr` /
`hasattr` on an engine object comes back into the code that serves, benchmarks or
evaluates engines (a probe with a default hid that the vLLM engine ran one call at a
time, and that no engine reported KV-cache use)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rollout.engine import RolloutEngine

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("rollout", "services", "benchmarks", "learner", "reward")
CAPABILITIES = {"max_concurrent_calls", "kv_cache_usage", "close"}


def probes(source: str) -> list[str]:
    """`getattr(...)` / `hasattr(...)` calls on an engine (an expression naming one) or
    for an engine capability, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        target, name = ast.unparse(node.args[0]), node.args[1]
        wanted = isinstance(name, ast.Constant) and name.value in CAPABILITIES - {"close"}
        if "engine" in target.lower() or wanted:
            found.append(ast.unparse(node))
    return found


def test_the_probe_finder_finds_planted_probes() -> None:
    planted = (
        "calls = getattr(engine, 'max_concurrent_calls', 1)\n"
        "usage = getattr(self.engine, 'kv_cache_usage', None)\n"
        "if hasattr(server.engine, 'close'): pass\n"
        "n = getattr(thing, 'kv_cache_usage')\n"
        "ok = getattr(items, 'close', None)\n"  # not an engine: not a probe
    )
    assert len(probes(planted)) == 4


def test_no_engine_is_probed() -> None:
    found = {
        str(path.relative_to(ROOT)): hits
        for package in SCANNED
        for path in sorted((ROOT / package).rglob("*.py"))
        if (hits := probes(path.read_text()))
    }
    assert not found, found


@pytest.mark.parametrize("member", sorted(CAPABILITIES))
def test_the_protocol_declares_each_capability(member: str) -> None:
    assert member in RolloutEngine.__dict__ or member in RolloutEngine.__annotations__


def test_the_torch_engine_declares_one_call_and_no_kv_pool(tiny_model: Path) -> None:
    from rollout.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model, device="cpu")
    assert isinstance(engine, RolloutEngine)
    assert engine.max_concurrent_calls == 1 and engine.kv_cache_usage() is None
    engine.close()
