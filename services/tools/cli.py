"""The `dapo` command line: one subcommand per role plus tools.

Heavy imports (torch, transformers, grpc servers) happen inside the subcommands, so
`dapo --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.common.entry import add_config_args, add_service_args, flag_overrides

ROLES: dict[str, str] = {
    # role → its entry module (`python -m <module>` is the same command)
    "controller": "services.controller.__main__",
    "buffer": "services.buffer.__main__",
    "rollout": "rollout.__main__",
    "reward": "reward.__main__",
    "learner": "learner.__main__",
}


def resolve_config(args: argparse.Namespace) -> Any:
    """The whole run's DapoConfig from preset, file, env and this invocation's flags."""
    from services.tools.config import load_config

    return load_config(args.config, preset=args.preset, overrides=flag_overrides(args, None))


def cmd_config(args: argparse.Namespace) -> int:
    from services.tools.config import dump_config

    config = resolve_config(args)
    print(dump_config(config, args.format), end="")
    if args.check_data:
        from services.tools.liveness import check_training_data

        print(check_training_data(config).describe(), file=sys.stderr)
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from learner.init_model import init_model

    out = init_model(Path(args.out), preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.tools.config import load_config
    from services.tools.launcher import launch
    from services.tools.liveness import StallWatch

    overrides = flag_overrides(args, None)
    if args.eval_every is not None:
        overrides.append(f"controller.eval.every_steps={args.eval_every}")
    config = load_config(args.config, preset=args.preset, overrides=overrides)
    watch = StallWatch(args.stall_after, args.stall_timeout, token=config.security.auth.secret())
    return launch(
        config, run_dir=args.run_dir, steps=args.steps, rollouts=args.rollouts, watch=watch
    )


def cmd_ablate(args: argparse.Namespace) -> int:
    from services.tools.ablate import run_ablation
    from services.tools.ablation_plan import make_plan
    from services.tools.ablation_table import rerender

    if args.rerender:
        for path in rerender(Path(args.rerender)):
            print(f"wrote {path}")
        return 0
    rungs = args.rungs.split(",") if args.rungs else None
    plan = make_plan(
        args.preset, args.seeds, name=args.name, rungs=rungs, steps=args.steps,
        eval_every=args.eval_every, overrides=args.overrides, root=args.out_root,
        leave_one_out=args.leave_one_out,
    )  # fmt: skip
    return run_ablation(plan)


def cmd_ledger(args: argparse.Namespace) -> int:
    from services.tools.ledger import print_ledger

    return print_ledger(resolve_config(args), as_json=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from services.tools.bench import run_benchmark

    return run_benchmark(args.name, args.args)


def cmd_eval(args: argparse.Namespace) -> int:
    from services.tools.evaluate import run_eval

    return run_eval(args)


def add_ablate_parser(sub: Any) -> None:
    p = sub.add_parser("ablate", help="the paper's ablation ladder, one real run per rung")
    p.add_argument(
        "--preset",
        default="tiny",
        help="ablation preset: tiny (runmax, the default) or tiny_mixed (the earlier "
        "max3+copy2 ladder)",
    )
    p.add_argument("--seeds", type=int, default=5, help="runs per rung (seeds 0..N-1)")
    p.add_argument("--name", help="output name: runs/ablate-<name> (default: the preset)")
    p.add_argument(
        "--rungs", help="comma-separated rungs (default: the whole ladder); leave-one-out "
        "rungs are no_<technique>, e.g. no_clip_higher",
    )  # fmt: skip
    p.add_argument(
        "--leave-one-out", action="store_true",
        help="after the ladder's rungs, full DAPO with each technique off in turn",
    )  # fmt: skip
    p.add_argument("--steps", type=int, help="training steps per run")
    p.add_argument("--eval-every", type=int, help="held-out evaluation every K steps")
    p.add_argument("--out-root", default="runs", help="outputs go to OUT_ROOT/ablate-<name>")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override a value of the base config (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--rerender", metavar="DIR",
        help="rewrite DIR/table.json and table.md from the runs in DIR/table.json (no runs)",
    )  # fmt: skip
    p.set_defaults(func=cmd_ablate)


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="avg@K / pass@K of a model on a dataset")
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--data", required=True, metavar="F", help="parquet/jsonl, or synthetic:TASK")
    p.add_argument("--n", type=int, default=32, help="samples per prompt (K)")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--verifier", default="cascade")
    p.add_argument("--limit", type=int, help="evaluate only the first N prompts")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", metavar="F", help="write the JSON result here")
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="rollout engine that samples (vllm needs dapo[vllm])",
    )
    p.add_argument(
        "--engine-option",
        action="append",
        metavar="KEY=VALUE",
        help="engine setting, e.g. kv_cache_memory_bytes=67108864 (repeatable)",
    )
    p.set_defaults(func=cmd_eval)


def add_liveness_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stall-after",
        type=float,
        default=30.0,
        metavar="S",
        help="after S seconds without a training step, show why (each service's latest "
        "error) (default: %(default)s)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="stop the run (exit 1) after S seconds without a training step; 0 = never "
        "(default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo", description="DAPO reinforcement learning as a set of services."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for role in ROLES:
        sub.add_parser(role, help=f"run the {role} service (`dapo {role} --help`)", add_help=False)

    p = sub.add_parser("up", help="start Redis and every service locally and train")
    add_service_args(p)
    p.add_argument("--run-dir", help="where logs, report and plots go (default runs/<run_name>)")
    p.add_argument("--steps", type=int, help="training steps (overrides learner.total_steps)")
    p.add_argument("--rollouts", type=int, default=1, help="rollout servers to start")
    p.add_argument(
        "--eval-every", type=int, metavar="N",
        help="held-out eval every N steps on the run's rollout servers: the eval curve "
        "(controller.eval.every_steps; 0 = off)",
    )  # fmt: skip
    add_liveness_args(p)
    p.set_defaults(func=cmd_up)

    add_ablate_parser(sub)

    p = sub.add_parser("config", help="print the resolved config (`dapo config show`)")
    p.add_argument("action", choices=["show"])
    add_config_args(p)
    p.add_argument("--format", choices=["yaml", "json"], default="yaml")
    p.add_argument(
        "--check-data",
        action="store_true",
        help="also load and screen the training data as `dapo up` will (errors name the "
        "file, row and column; the summary goes to stderr)",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("init-model", help="build a tiny random model + local tokenizer")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("ledger", help="account for every group of a run")
    add_config_args(p)
    p.add_argument("--redis-url", help="Redis URL of the run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ledger)

    add_eval_parser(sub)

    p = sub.add_parser("bench", help="run benchmarks/NAME.py")
    p.add_argument("name")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark's main()")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLES:  # one path for `dapo <role>` and `python -m <role>`
        return int(importlib.import_module(ROLES[argv[0]]).main(argv[1:]))
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    from services.common.errors import DapoError

    try:
        return func(args)
    except DapoError as exc:
        print(f"dapo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
