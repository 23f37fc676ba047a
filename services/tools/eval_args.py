"""`dapo eval`'s flags: each one's default is stated in `--help`, and `--run runs/NAME`
replaces the defaults by what that run trained and evaluated with (data, verifier,
lengths, sampling, engine, seed) and evaluates its latest checkpoint (`--checkpoint`:
eval_source.py). A flag given on the command line always wins."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import DapoError

if TYPE_CHECKING:
    from services.tools.config import DapoConfig
    from services.tools.eval_source import EvalSource

VERIFIERS = ("dapo", "math_verify", "cascade", "first_integer")

# Without --run: the paper's avg@32 sampling (temperature 1.0, top-p 0.7).
DEFAULTS: dict[str, Any] = {
    "n": 32,
    "max_tokens": 1024,
    "temperature": 1.0,
    "top_p": 0.7,
    "verifier": "cascade",
    "chat_template": True,
    "engine": "torch",
    "seed": 0,
    "limit": None,
}


@dataclass(frozen=True)
class EvalArgs:
    """What one `dapo eval` runs, every default resolved."""

    model: str
    data: str
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    verifier: str
    chat_template: bool
    engine: str
    seed: int
    limit: int | None
    engine_options: tuple[str, ...]
    out: str | None
    source: EvalSource | None = None  # with --run: which of its models, named


def add_eval_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="avg@K / pass@K of a model on a dataset",
        description="Sample K responses per prompt and verify them. Defaults in brackets; "
        "with --run they come from that run's config instead (its final model, eval data, "
        "verifier, response length, eval sampling and seed).",
    )
    p.add_argument("--run", metavar="DIR", help="take the defaults from a run (runs/NAME)")
    p.add_argument(
        "--model", metavar="DIR", help="model directory [--run: the model --checkpoint names]"
    )
    p.add_argument(
        "--checkpoint",
        metavar="WHICH",
        help="with --run: latest (its latest checkpoint, or its final export when it finished "
        "there), final, base (its initial model) or stepN [latest]",
    )
    p.add_argument(
        "--data", metavar="F", help="parquet/jsonl, or synthetic:TASK [--run: its eval data]"
    )
    p.add_argument("--n", type=int, help=f"samples per prompt (K) [{DEFAULTS['n']}]")
    p.add_argument(
        "--max-tokens", type=int, help=f"response length limit [{DEFAULTS['max_tokens']}]"
    )
    p.add_argument("--temperature", type=float, help=f"[{DEFAULTS['temperature']}]")
    p.add_argument("--top-p", type=float, help=f"[{DEFAULTS['top_p']}]")
    p.add_argument("--verifier", choices=VERIFIERS, help=f"[{DEFAULTS['verifier']}]")
    p.add_argument("--limit", type=int, help="evaluate only the first N prompts [all]")
    p.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        help=f"render prompts as a chat turn [{DEFAULTS['chat_template']}]",
    )
    p.add_argument("--seed", type=int, help=f"sampling seed [{DEFAULTS['seed']}]")
    p.add_argument("--out", metavar="F", help="also write the JSON result (per prompt) here")
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        help=f"rollout engine that samples (vllm needs dapo[vllm]) [{DEFAULTS['engine']}]",
    )
    p.add_argument(
        "--engine-option",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="engine setting, e.g. kv_cache_memory_bytes=67108864 (repeatable)",
    )
    parser: argparse.ArgumentParser = p
    return parser


def run_defaults(config: DapoConfig) -> dict[str, Any]:
    """What a run trained and evaluated with, as `dapo eval` defaults (the model aside)."""
    from services.controller.dataset import eval_data_spec

    cfg = config.controller.eval
    verifier = config.shared.verifier
    return {
        "data": eval_data_spec(cfg, config.controller.dataset),
        "n": cfg.n,
        "max_tokens": config.shared.max_response_length,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "limit": cfg.limit,
        "verifier": config.reward.default_verifier if verifier == "default" else verifier,
        "chat_template": config.controller.apply_chat_template,
        "engine": cfg.engine,
        "seed": config.shared.seed,
    }


def resolve_eval_args(args: argparse.Namespace) -> EvalArgs:
    """Flags over the run's values (with --run) over DEFAULTS."""
    base = dict(DEFAULTS)
    source = None
    if args.run is not None:
        from services.tools.eval_source import resolve_source
        from services.tools.run_dir import load_run

        config = load_run(Path(args.run))
        base.update(run_defaults(config))
        if args.model is None:
            source = resolve_source(Path(args.run), config, args.checkpoint)
            base["model"] = source.model
    elif args.checkpoint is not None:
        raise DapoError("--checkpoint names a model of a run: give --run DIR too")
    given = {k: v for k, v in vars(args).items() if v is not None and k != "checkpoint"}
    values = {**base, **given}
    for name in ("model", "data"):
        if values.get(name) is None:
            raise DapoError(f"--{name} is required (or --run DIR of a run that has one)")
    for name in ("limit", "max_tokens"):
        if values.get(name) is not None and values[name] < 1:
            raise DapoError(f"--{name.replace('_', '-')} must be >= 1, got {values[name]}")
    return EvalArgs(
        model=str(values["model"]),
        data=str(values["data"]),
        n=values["n"],
        max_tokens=values["max_tokens"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        verifier=values["verifier"],
        chat_template=values["chat_template"],
        engine=values["engine"],
        seed=values["seed"],
        limit=values["limit"],
        engine_options=tuple(args.engine_option),
        out=args.out,
        source=source,
    )
