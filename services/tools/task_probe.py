"""How a model's responses on a reasoning task end: truncated or not, and how close to gold.

    python -m services.tools.task_probe --task runmax --max-tokens 20 [--model DIR]

Samples `n` responses per training prompt (temperature 1, top-p 1: the rollout's defaults)
and reports the share that hit `max_tokens` without `<eos>`, the share of those that were
*on a correct path* (their text starts with the first steps of the reference response, or
they already hold a correct `Answer:` line that the cut did not remove), the accuracy under
the `dapo` rule and the mean length. Without `--model` it builds the random tiny model of
`--seed`, i.e. the policy a run starts from (docs/tasks.md quotes the numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from reward.verifiers import verify_dapo
from services.common.data import synthetic_records
from services.common.reasoning import ANSWER_PREFIX, STEP_SEP, gold_response, parse_prompt

PATH_STEPS = 2  # a truncated response that starts with the first 2 reference steps


@dataclass
class Profile:
    """Length statistics of a set of responses to one task."""

    responses: int
    truncated: float  # share that ran into max_tokens
    truncated_on_path: float  # share of the truncated ones on a correct path
    correct: float  # share the `dapo` rule accepts (truncated ones included)
    mean_tokens: float
    gold_tokens: float  # mean length of the reference responses (with <eos>)


def on_correct_path(text: str, gold: str, answer: str) -> bool:
    """A cut-off response that was following the reference or had already answered right."""
    steps = gold.split("\n")[0].split(STEP_SEP)[:PATH_STEPS]
    if text.startswith(STEP_SEP.join(steps)):
        return True
    return f"{ANSWER_PREFIX}{answer}\n" in text


def profile(rows: list[dict[str, Any]]) -> Profile:
    """Rows of {text, tokens, truncated, gold, answer, gold_tokens} -> the shares above."""
    cut = [r for r in rows if r["truncated"]]
    on_path = [r for r in cut if on_correct_path(r["text"], r["gold"], r["answer"])]
    return Profile(
        responses=len(rows),
        truncated=len(cut) / len(rows),
        truncated_on_path=len(on_path) / len(cut) if cut else 0.0,
        correct=sum(verify_dapo(r["text"], r["answer"]).correct for r in rows) / len(rows),
        mean_tokens=statistics.fmean(r["tokens"] for r in rows),
        gold_tokens=statistics.fmean(r["gold_tokens"] for r in rows),
    )


def sample_rows(model: str, task: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    """Sample `n` responses per training prompt of `task` from the model in `model`."""
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine
    from services.tools.evaluate import prompt_ids

    engine = TorchEngine(model)
    tok = engine.tokenizer
    records = synthetic_records(task, split="train")
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    outputs = engine.generate([prompt_ids(tok, r.prompt, False) for r in records], params)
    rows = []
    for record, row in zip(records, outputs, strict=True):
        gold = gold_response(task, parse_prompt(record.prompt))
        gold_tokens = len(tok(gold)["input_ids"]) + 1
        for out in row:
            text = str(tok.decode(out.token_ids, skip_special_tokens=True))
            rows.append(
                {
                    "text": text,
                    "tokens": len(out.token_ids),
                    "gold": gold,
                    "truncated": out.finish_reason != "stop",
                    "answer": record.ground_truth,
                    "gold_tokens": gold_tokens,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="runmax")
    p.add_argument("--max-tokens", type=int, default=20, help="L_max")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--model", help="model directory (default: a fresh random tiny model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model = args.model
    if model is None:
        from learner.init_model import init_model

        model = str(init_model(tempfile.mkdtemp(prefix="probe-"), "tiny", args.seed))
    result = profile(sample_rows(model, args.task, args.n, args.max_tokens))
    print(json.dumps({"task": args.task, "max_tokens": args.max_tokens, **asdict(result)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
