"""Synthetic reasoning tasks: variable-length digit lists, a scratchpad, the paper's answer line.

The digit tasks of `data.py` answer in one token, so length never matters; here the
reference response works through the list one step per digit and ends with the DAPO
paper's `Answer:` line, scored by the `dapo` verifier:

    runmax   3,7,1,4=  ->  3,7,7,7\\nAnswer: 7      (running maximum)
    runsum   3,5,2=    ->  3,8,10\\nAnswer: 10      (running total)

Why and how they are drawn and split: docs/tasks.md, "Why a reasoning-length task".
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

ANSWER_PREFIX = "Answer: "
PROMPT_SEP = ","
STEP_SEP = ","
HELD_OUT_FRACTION = 0.2


Draw = Callable[[random.Random, int], tuple[int, ...]]


def uniform_digits(rng: random.Random, length: int) -> tuple[int, ...]:
    """`length` independent uniform digits."""
    return tuple(rng.randrange(10) for _ in range(length))


def balanced_max(rng: random.Random, length: int) -> tuple[int, ...]:
    """Digits whose maximum is uniform over 0-9 (uniform digits make it 9 in 41% of
    5-digit lists, and a policy that always answers 9 sits in that optimum)."""
    top = rng.randrange(10)
    digits = [rng.randrange(top + 1) for _ in range(length)]
    digits[rng.randrange(length)] = top
    return tuple(digits)


@dataclass(frozen=True)
class ReasoningTask:
    """Digit lists of `min_len`..`max_len` digits; `steps` maps a list to its scratchpad.

    The last step is the answer. Each length longer than two digits gets `per_length`
    draws of `draw` (duplicates collapse, so rare lists may give fewer prompts).
    """

    steps: Callable[[tuple[int, ...]], list[str]]
    draw: Draw = uniform_digits
    min_len: int = 2
    max_len: int = 6
    per_length: int = 300


def running(op: Callable[[int, int], int]) -> Callable[[tuple[int, ...]], list[str]]:
    """The running fold of `op` over the digits, one step per digit."""

    def steps(digits: tuple[int, ...]) -> list[str]:
        return [str(v) for v in itertools.accumulate(digits, op)]

    return steps


REASONING_TASKS: dict[str, ReasoningTask] = {
    "runmax": ReasoningTask(running(max), balanced_max),
    "runsum": ReasoningTask(running(lambda a, b: a + b)),
}


def reasoning_prompt(digits: tuple[int, ...]) -> str:
    """The prompt of a digit list: `3,7,1,4=`."""
    return PROMPT_SEP.join(map(str, digits)) + "="


def gold_response(task: str, digits: tuple[int, ...]) -> str:
    """The reference response: the scratchpad, a newline, `Answer: <last step>`."""
    steps = REASONING_TASKS[task].steps(digits)
    return f"{STEP_SEP.join(steps)}\n{ANSWER_PREFIX}{steps[-1]}"


def answer(task: str, digits: tuple[int, ...]) -> str:
    """The gold answer (the ground truth the verifier compares with)."""
    return REASONING_TASKS[task].steps(digits)[-1]


def parse_prompt(prompt: str) -> tuple[int, ...]:
    """The digit list of a prompt (inverse of `reasoning_prompt`)."""
    return tuple(int(d) for d in prompt.rstrip("=").split(PROMPT_SEP))


def prompt_pool(task: str) -> list[tuple[int, ...]]:
    """Every prompt of `task`, in a fixed order: per length all lists or a fixed draw."""
    spec = REASONING_TASKS[task]
    pool: list[tuple[int, ...]] = []
    for length in range(spec.min_len, spec.max_len + 1):
        if 10**length <= spec.per_length:
            pool.extend(itertools.product(range(10), repeat=length))
            continue
        rng = random.Random(f"dapo-reasoning-{task}-{length}")
        pool.extend(sorted({spec.draw(rng, length) for _ in range(spec.per_length)}))
    return pool


def split_pool(task: str, split: str) -> list[tuple[int, tuple[int, ...]]]:
    """(pool index, digits) of one split: a fixed shuffle of the pool, the first 20% held out."""
    pool = prompt_pool(task)
    order = list(range(len(pool)))
    random.Random(f"dapo-synthetic-{task}").shuffle(order)
    n_test = round(len(pool) * HELD_OUT_FRACTION)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [(i, pool[i]) for i in sorted(chosen)]
