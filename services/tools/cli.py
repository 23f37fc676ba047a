"""The `dapo` command line: one subcommand per role plus tools.

Heavy imports (torch, transformers, grpc servers) happen inside the subcommands, so
`dapo --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.common import arg_types as types
from services.common.entry import Parser, add_config_args, add_redis_arg, flag_overrides
from services.tools import cli_args

ROLES: dict[str, str] = {
    # role → its entry module (`python -m <module>` is the same command)
    "controller": "services.controller.__main__",
    "buffer": "services.buffer.__main__",
    "rollout": "rollout.__main__",
    "reward": "reward.__main__",
    "learner": "learner.__main__",
}


# `dapo` as this interpreter runs it: the head of every command line of a child `dapo`.
DAPO_ARGV = (sys.executable, "-m", "services.tools.cli")


def up_argv(run_dir: str | Path, model: str | Path, preset: str = "tiny") -> list[str]:
    """`dapo up` as a user starts it on `model`: the head of the command line for the
    tests and benchmarks that run it whole."""
    cli = [*DAPO_ARGV, "up", "--preset", preset]
    return [*cli, "--run-dir", str(run_dir), "--set", f"shared.model_path={model}"]


def resolve_config(args: argparse.Namespace) -> Any:
    """The whole run's DapoConfig from preset, file, env and this invocation's flags."""
    from services.tools.config import load_config

    return load_config(args.config, preset=args.preset, overrides=flag_overrides(args, None))


def cmd_config(args: argparse.Namespace) -> int:
    from services.tools import checks
    from services.tools.config import dump_config

    config = resolve_config(args)
    print(dump_config(config, args.format), end="")
    checks.report(checks.check_run(config), "config")
    if args.check_data:
        checks.report_data(config, "config", sys.stderr)
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from learner.init_model import PRESETS, init_model
    from services.common.errors import DapoError

    if args.preset not in PRESETS:
        raise DapoError(
            f"unknown model preset {args.preset!r}; choose one of: {', '.join(PRESETS)}"
        )
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise DapoError(f"{out} is not empty: pass --force to overwrite the model in it")
    init_model(out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.tools.config import load_config
    from services.tools.launcher import launch
    from services.tools.liveness import StallWatch
    from services.tools.resume import Mode

    overrides = flag_overrides(args, None)
    if args.eval_every is not None:
        overrides.append(f"controller.eval.every_steps={args.eval_every}")
    if args.learner_ranks is not None:
        overrides.append(f"learner.launch.ranks={args.learner_ranks}")
    config = load_config(args.config, preset=args.preset, overrides=overrides)
    cli_args.preflight_up(config, args.run_dir)
    watch = StallWatch(args.stall_after, args.stall_timeout, token=config.security.auth.secret())
    mode: Mode = "resume" if args.resume else "fresh" if args.fresh else "new"
    return launch(
        config,
        run_dir=args.run_dir,
        steps=args.steps,
        rollouts=args.rollouts,
        watch=watch,
        mode=mode,
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
        args.preset,
        args.seeds,
        name=args.name,
        rungs=rungs,
        steps=args.steps,
        eval_every=args.eval_every,
        overrides=args.overrides,
        root=args.out_root,
        leave_one_out=args.leave_one_out,
    )
    return run_ablation(plan)


def cmd_ledger(args: argparse.Namespace) -> int:
    from services.tools.ledger import print_ledger

    if args.run is None:
        return print_ledger(resolve_config(args), as_json=args.json)
    from services.tools.run_dir import run_redis

    with run_redis(Path(args.run)) as config:
        return print_ledger(config, as_json=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from services.tools.bench import list_benchmarks, run_benchmark

    if args.name is None:
        print(
            "usage: dapo bench [--repeats N] [--load-below L] NAME [ARGS...]; "
            "benchmarks (benchmarks/NAME.py):"
        )
        for name in list_benchmarks():
            print(f"  {name}")
        return 2
    return run_benchmark(args.name, args.args, args.repeats, args.load_below)


def cmd_eval(args: argparse.Namespace) -> int:
    from services.tools.evaluate import run_eval

    cli_args.preflight_eval(args)
    return run_eval(args)


def add_ablate_parser(sub: Any) -> None:
    p = sub.add_parser("ablate", help="the paper's ablation ladder, one real run per rung")
    p.add_argument(
        "--preset",
        default="tiny_runmax",
        help="ablation preset: tiny_runmax (the default: the ladder on the config preset of "
        "that name, `dapo up --preset tiny_runmax`), tiny_mixed (the earlier ladder on the "
        "tiny preset with the max3+copy2 task) or demo (`dapo up --preset tiny` as `make "
        "demo` runs it, 150 steps; e.g. --rungs dynamic_sampling,no_clip_higher)",
    )
    p.add_argument("--seeds", type=types.seed_count, default=5, help="runs per rung (seeds 0..N-1)")
    p.add_argument("--name", help="output name: runs/ablate-<name> (default: the preset)")
    p.add_argument(
        "--rungs",
        help="comma-separated rungs (default: the whole ladder); leave-one-out "
        "rungs are no_<technique>, e.g. no_clip_higher",
    )
    p.add_argument(
        "--leave-one-out",
        action="store_true",
        help="after the ladder's rungs, full DAPO with each technique off in turn",
    )
    p.add_argument("--steps", type=types.positive, help="training steps per run")
    p.add_argument("--eval-every", type=types.positive, help="held-out evaluation every K steps")
    p.add_argument(
        "--out-root",
        type=cli_args.output_dir,
        default="runs",
        help="outputs go to OUT_ROOT/ablate-<name>",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a value of the base config (repeatable)",
    )
    p.add_argument(
        "--rerender",
        type=cli_args.existing_dir,
        metavar="DIR",
        help="rewrite DIR/table.json and table.md from the runs in DIR/table.json (no runs)",
    )
    p.set_defaults(func=cmd_ablate)


def add_liveness_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stall-after",
        type=types.seconds(allow_zero=False),
        default=30.0,
        metavar="S",
        help="after S seconds without a training step, show why (each service's latest "
        "error) (default: %(default)s)",
    )
    p.add_argument(
        "--stall-timeout",
        type=types.seconds(allow_zero=True),
        default=0.0,
        metavar="S",
        help="stop the run (exit 1) after S seconds without a training step; 0 = never "
        "(default: %(default)s)",
    )


def add_run_life_args(p: argparse.ArgumentParser) -> None:
    """`dapo up` on a directory that holds a run (docs/runs.md, "The life of a run")."""
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its latest checkpoint (its ledger, data "
        "position and eval curve go on; safe setting changes are applied, run-changing ones "
        "refused); starts a new run when the directory holds none",
    )
    which.add_argument(
        "--fresh",
        action="store_true",
        help="move the run in --run-dir aside to DIR.old-<time> (nothing is deleted) and "
        "start a new run",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dapo", description="DAPO reinforcement learning as a set of services.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for role in ROLES:
        sub.add_parser(role, help=f"run the {role} service (`dapo {role} --help`)", add_help=False)

    p = sub.add_parser("up", help="start Redis and every service locally and train")
    add_config_args(p)
    add_redis_arg(p)  # the services' ports are picked free by `dapo up` (printed in logs)
    p.add_argument(
        "--run-dir",
        type=cli_args.output_dir,
        help="where logs, report and plots go (default runs/<run_name>)",
    )
    p.add_argument(
        "--steps", type=types.positive, help="training steps (overrides learner.total_steps)"
    )
    p.add_argument("--rollouts", type=types.processes, default=1, help="rollout servers to start")
    p.add_argument(
        "--learner-ranks",
        type=types.processes,
        metavar="N",
        help="run the learner as N data-parallel ranks under torchrun (learner.launch.ranks; "
        "DeepSpeed, any ZeRO stage)",
    )
    p.add_argument(
        "--eval-every",
        type=types.non_negative,
        metavar="N",
        help="held-out eval every N steps on the run's rollout servers: the eval curve "
        "(controller.eval.every_steps; 0 = off)",
    )
    add_liveness_args(p)
    add_run_life_args(p)
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
    p.add_argument("--out", type=cli_args.output_dir, required=True, metavar="DIR")
    p.add_argument(
        "--preset",
        default="tiny",
        help=f"model preset: {', '.join(cli_args.MODEL_PRESETS)} [tiny]",
    )
    p.add_argument("--seed", type=types.seed_value, default=0, help="[0]")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("ledger", help="account for every group of a run")
    p.add_argument(
        "--run",
        metavar="DIR",
        help="a `dapo up` run directory (runs/NAME), running or finished: its Redis is "
        "started again from the directory when the run is over",
    )
    add_config_args(p)
    p.add_argument("--redis-url", type=types.redis_url, help="Redis URL of the run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ledger)

    from services.tools.eval_args import add_eval_parser

    add_eval_parser(sub).set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="run benchmarks/NAME.py (no NAME: list them)")
    p.add_argument(
        "--repeats",
        type=types.bounded_int(1, 100),
        default=None,
        help="run it N times (default: the benchmark's REPEATS, else 3); a check passes "
        "only if it held in all N (give it before NAME)",
    )
    p.add_argument(
        "--load-below",
        type=types.load_average,
        default=None,
        help="start each run once the 1-minute load average is below L (at most 90 s)",
    )
    p.add_argument("name", nargs="?")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark's main()")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLES:  # one path for `dapo <role>` and `python -m <role>`
        return int(importlib.import_module(ROLES[argv[0]]).main(argv[1:]))
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # named against the subcommand, not the top-level parser
        print(
            f"dapo {args.command}: error: unrecognized arguments: {' '.join(extra)} "
            f"(see `dapo {args.command} --help`)",
            file=sys.stderr,
        )
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    from services.common.errors import one_line

    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a user's mistake is exit 2; a bug, exit 1: both one line
        message = cli_args.user_error(exc)
        if message is not None:
            print(f"dapo {args.command}: error: {one_line(message)}", file=sys.stderr)
            return 2
        if os.environ.get("DAPO_DEBUG"):
            raise
        print(
            f"dapo {args.command}: error: {type(exc).__name__}: {one_line(str(exc))} "
            "(DAPO_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
