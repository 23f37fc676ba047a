"""Cutting a stream of named items into runs of bounded size (weight buckets)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def runs_by_size(
    named: Iterable[tuple[str, T]], size: Callable[[T], int], limit: int
) -> Iterator[list[tuple[str, T]]]:
    """Consecutive runs of items whose sizes add up to at most `limit`, in order; an item
    larger than `limit` goes alone. Lazy: a run is yielded before the next item is read,
    so a caller that gathers or serialises per run never holds more than one."""
    run: list[tuple[str, T]] = []
    total = 0
    for name, item in named:
        nbytes = size(item)
        if run and total + nbytes > limit:
            yield run
            run, total = [], 0
        run.append((name, item))
        total += nbytes
    if run:
        yield run
