"""`dapo eval`: avg@K and pass@K of a model with the rollout engine and the reward verifiers.

Runs in one process: a rollout engine samples K responses per prompt (`n = K`; eval
sampling: temperature 1.0, top-p 0.7 by default, as the paper's avg@32), and the reward
service's worker pool verifies them with a hard per-item time limit. The engine is the
torch engine by default, or vLLM (`--engine vllm`, `controller.eval.engine: vllm`): the
same `RolloutEngine` contract, so the numbers mean the same, vLLM only samples faster.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.data import PromptRecord
from services.common.errors import DapoError
from services.common.eval_stats import summarise
from services.common.tokenizer import PromptTokenizer

if TYPE_CHECKING:
    from reward.scoring import Scorer
    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine, SamplingParams
    from services.tools.config import DapoConfig


def load_eval_data(spec: str, limit: int | None) -> list[PromptRecord]:
    """A parquet/jsonl path, or `synthetic:TASK` (its held-out split); one row per problem."""
    from services.controller.dataset import load_eval_records

    return load_eval_records(spec, limit)


def prompt_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """One user turn's ids, rendered as the controller renders a prompt."""
    return PromptTokenizer(tokenizer, "the evaluated model", chat).ids(
        [{"role": "user", "content": text}]
    )


def sample_texts(
    engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, chat: bool
) -> list[list[str]]:
    """`params.n` decoded responses per record, sampled in one batched call."""
    tokenizer = PromptTokenizer(engine.tokenizer, "the evaluated model", chat)
    prompts = [tokenizer.ids(r.messages) for r in records]
    outputs = engine.generate(prompts, params)
    decode = engine.tokenizer.decode
    return [[str(decode(o.token_ids, skip_special_tokens=True)) for o in row] for row in outputs]


def score_correct(
    scorer: Scorer, records: list[PromptRecord], texts: list[list[str]], verifier: str
) -> list[list[bool]]:
    """Correctness per response, verified in the reward service's worker pool."""
    from reward.scoring import ScoreInput

    items = [
        ScoreInput(t, r.ground_truth, verifier=verifier)
        for r, row in zip(records, texts, strict=True)
        for t in row
    ]
    verdicts = iter(scorer.score(items))
    return [[next(verdicts).correct for _ in row] for row in texts]


def eval_scorer(num_workers: int | None = None) -> Scorer:
    """A reward scorer for evaluations: correctness only (no overlong shaping)."""
    from reward.server import create_scorer
    from services.tools.config import load_config

    overrides = ["reward.overlong_punishment=false"]
    if num_workers is not None:
        overrides.append(f"reward.num_workers={num_workers}")
    return create_scorer(load_config(env={}, overrides=overrides))


def evaluate_engine(
    engine: RolloutEngine,
    records: list[PromptRecord],
    params: SamplingParams,
    verifier: str,
    chat: bool,
) -> dict[str, Any]:
    """Sample with `engine`, verify in the reward pool, return summary + per-prompt rows."""
    started = time.monotonic()
    texts = sample_texts(engine, records, params, chat)
    scorer = eval_scorer()
    try:
        correct = score_correct(scorer, records, texts, verifier)
    finally:
        scorer.pool.close()
    n = params.n
    return {
        **summarise(correct, n),
        "version": engine.version,
        "verifier": verifier,
        "seconds": round(time.monotonic() - started, 2),
        "per_prompt": [
            {"prompt_id": r.prompt_id, "accuracy": sum(c) / n, "example": row[0][:200]}
            for r, c, row in zip(records, correct, texts, strict=True)
        ],
    }


def engine_config(kind: str, options: Sequence[str] = ()) -> EngineConfig:
    """The engine `--engine KIND --engine-option KEY=VALUE ...` asks for, validated."""
    from pydantic import TypeAdapter, ValidationError

    from rollout.config import EngineConfig

    values: dict[str, str] = {"kind": kind}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise DapoError(f"--engine-option wants KEY=VALUE, got {option!r}")
        values[key] = value
    try:
        return TypeAdapter(EngineConfig).validate_python(values)
    except ValidationError as exc:
        raise DapoError(f"invalid engine options: {exc}") from None


def build_engine(model: str | Path, config: EngineConfig | None) -> RolloutEngine:
    """The engine that samples an evaluation: torch (the default) or vLLM."""
    if config is not None and config.kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise DapoError("vllm is not installed (pip install 'dapo[vllm]')")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the result
        from rollout.vllm_engine import VllmEngine

        return VllmEngine.from_config(model, config)
    from rollout.torch_engine import TorchEngine

    return TorchEngine(model) if config is None else TorchEngine.from_config(model, config)


def evaluate(
    model: str | Path,
    records: list[PromptRecord],
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    verifier: str,
    chat: bool,
    engine_config: EngineConfig | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Evaluate the weights stored in a model directory (the same numbers for the same
    seed; None = a fresh draw each call)."""
    from rollout.engine import SamplingParams

    if not Path(model).is_dir():
        raise DapoError(f"model directory not found: {model}")
    try:
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed
        )
    except ValueError as exc:
        raise DapoError(f"invalid sampling: {exc}") from None
    engine = build_engine(model, engine_config)
    try:
        result = evaluate_engine(engine, records, params, verifier, chat)
    finally:
        engine.close()
    kind = "torch" if engine_config is None else engine_config.kind
    return {**result, "model": str(model), "engine": kind}


def check_max_tokens(model: str, max_tokens: int) -> None:
    """A response cannot be longer than the model has positions (a prompt needs some)."""
    from services.tools.checks import model_positions

    positions = model_positions(Path(model))
    if positions is not None and max_tokens >= positions:
        raise DapoError(
            f"--max-tokens {max_tokens} does not fit the {positions} positions of the model "
            f"in {model} (prompt included); lower it"
        )


def run_eval(args: argparse.Namespace) -> int:
    from services.tools.eval_args import resolve_eval_args

    a = resolve_eval_args(args)
    if a.source is not None:
        print(a.source.describe(Path(args.run)), file=sys.stderr)
    check_max_tokens(a.model, a.max_tokens)
    records = load_eval_data(a.data, a.limit)
    config = engine_config(a.engine, a.engine_options)
    result = evaluate(
        a.model,
        records,
        a.n,
        a.max_tokens,
        a.temperature,
        a.top_p,
        a.verifier,
        a.chat_template,
        config,
        seed=a.seed,
    )
    settings = {"data": a.data, "max_tokens": a.max_tokens, "temperature": a.temperature}
    result.update(settings, top_p=a.top_p, chat_template=a.chat_template, seed=a.seed)
    if a.source is not None:  # what the run's model is: its step and policy version
        result.update(checkpoint=a.source.checkpoint, step=a.source.step, version=a.source.version)
    summary = {k: v for k, v in result.items() if k != "per_prompt"}
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {a.out}")
    return 0


@dataclass(frozen=True)
class EvalPlan:
    """What `dapo up` evaluates before and after training."""

    records: list[PromptRecord]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    verifier: str
    chat: bool
    engine: EngineConfig | None = None  # None: the torch engine's defaults


def eval_engine_config(config: DapoConfig) -> EngineConfig | None:
    """`controller.eval.engine: vllm` uses `rollout.engine` when that is vLLM (the same
    settings as the run's rollout servers), else vLLM's defaults; torch: None."""
    from rollout.config import VllmEngineConfig

    if config.controller.eval.engine != "vllm":
        return None
    rollout_engine = config.rollout.engine
    return rollout_engine if rollout_engine.kind == "vllm" else VllmEngineConfig()


def eval_plan(config: DapoConfig) -> EvalPlan | None:
    """The held-out evaluation a run's config asks for (None when there is none)."""
    from services.controller.dataset import eval_data_spec

    cfg = config.controller.eval
    data = eval_data_spec(cfg, config.controller.dataset)
    if not cfg.enabled or data is None:
        return None
    verifier = config.shared.verifier
    return EvalPlan(
        records=load_eval_data(data, cfg.limit),
        n=cfg.n,
        max_tokens=config.shared.max_response_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        verifier=config.reward.default_verifier if verifier == "default" else verifier,
        chat=config.controller.apply_chat_template,
        engine=eval_engine_config(config),
    )


def registered_learners(config: DapoConfig) -> list[dict[str, Any]]:
    from services.common.keys import RunKeys
    from services.common.redis_server import connect_run
    from services.common.registry import discover

    return discover(connect_run(config), RunKeys(config.shared.run_name), "learner")


def final_version(config: DapoConfig) -> int:
    """The version the learner marked the run done at (its final export's)."""
    from services.common.keys import RunKeys
    from services.common.redis_server import connect_run

    done = connect_run(config).get(RunKeys(config.shared.run_name).done)
    return int(done) if done is not None else 0


def final_export(config: DapoConfig) -> Path:
    """The learner's final save_pretrained model (written before it marks the run done)."""
    from learner.trainer import export_dir

    out = export_dir(config)
    if out is None or not (out / "config.json").is_file():
        raise DapoError(
            "no learner registered and no final export: cannot evaluate the final weights "
            "(keep learner.linger_s > 0, or set learner.checkpoint.dir or .export_dir)"
        )
    return out


def fetch_latest_weights(config: DapoConfig, engine: RolloutEngine) -> None:
    """Load the learner's latest weights into `engine` through its WeightService."""
    from rollout.weights import WeightStub, fetch_update
    from services.common.grpc_server import channel as grpc_channel
    from services.weight_transport.torch_codec import to_torch

    learners = registered_learners(config)
    if not learners:
        raise DapoError("no learner registered: cannot fetch the final weights")
    channel = grpc_channel(
        learners[0]["address"], config.security, config.shared.rpc.max_message_bytes
    )
    try:
        _, (version, tensors) = fetch_update(WeightStub(channel), learners[0]["address"], config)
        engine.load_weights(((t.name, to_torch(t)) for t in tensors), version)
    finally:
        channel.close()


def run_eval_plan(plan: EvalPlan, config: DapoConfig, fetch_final: bool) -> dict[str, Any]:
    """Evaluate the initial model, or (fetch_final) the learner's latest weights: from the
    learner while it lingers, else from its final export (a learner with linger_s 0)."""
    from rollout.engine import SamplingParams

    if config.model_path is None:
        raise DapoError("no model to evaluate: set learner.model_path or shared.model_path")
    model: str | Path = config.model_path
    exported: int | None = None  # the run's final version, when read from the export
    if fetch_final and not registered_learners(config):
        model, fetch_final, exported = final_export(config), False, final_version(config)
    engine = build_engine(model, plan.engine)
    try:
        if fetch_final:
            fetch_latest_weights(config, engine)
        params = SamplingParams(  # seeded as `dapo eval --run` is: the same number
            n=plan.n,
            temperature=plan.temperature,
            top_p=plan.top_p,
            max_tokens=plan.max_tokens,
            seed=config.shared.seed,
        )
        result = evaluate_engine(engine, plan.records, params, plan.verifier, plan.chat)
    finally:
        engine.close()
    if exported is not None:
        result["version"] = exported
    return {k: v for k, v in result.items() if k != "per_prompt"}
