"""The killable worker pool with real worker processes (forkserver, math-verify preloaded).

math-verify's own timeout is off here (soft_timeout_s=0), so the GIL-holding power tower
can only be stopped by the pool killing its worker: that is the path under test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from reward.jobs import MAX_CHUNK_ITEMS, Task, chunk_size
from reward.pool import VerifierPool
from reward.worker import Progress

HARD_TIMEOUT_S = 1.5
TOWER = "$9^{9^{9^{9^9}}}$"
RESTART_REASONS: list[str] = []  # what the pool reported through on_restart


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    pool = VerifierPool(
        2, timeout_s=HARD_TIMEOUT_S, soft_timeout_s=0, on_restart=RESTART_REASONS.append
    ).start()
    assert pool.wait_ready(60), "verifier workers did not start"
    yield pool
    pool.close()


def test_results_come_back_in_order(pool: VerifierPool) -> None:
    tasks = [Task("cascade", f"Answer: {n}", str(n if n % 3 else n + 1)) for n in range(40)]
    outcomes = pool.run_all(tasks)
    assert [o.verdict.correct for o in outcomes] == [n % 3 != 0 for n in range(40)]
    assert all(o.verdict.error == "" and o.seconds >= 0 for o in outcomes)


def test_stuck_item_kills_only_its_worker(pool: VerifierPool) -> None:
    before_pids, before_restarts = set(pool.worker_pids()), pool.restarts
    start = time.monotonic()
    stuck = pool.submit(Task("math_verify", TOWER, "5"))
    time.sleep(0.2)  # let the tower occupy one worker
    normal = pool.run_all(
        [Task("cascade", f"Answer: \\frac{{{2 * n}}}{{2}}", str(n)) for n in range(20)]
    )
    assert all(o.verdict.correct for o in normal), normal
    outcome = stuck.result(timeout=HARD_TIMEOUT_S + 5)
    elapsed = time.monotonic() - start
    assert outcome.timed_out and not outcome.verdict.correct
    assert "timeout_s=1.5" in outcome.verdict.error
    assert HARD_TIMEOUT_S <= elapsed < HARD_TIMEOUT_S + 2.0
    after = set(pool.worker_pids())
    assert len(before_pids & after) == 1 and len(after) == 2  # one replaced, one untouched
    assert pool.restarts == before_restarts + 1
    assert RESTART_REASONS[-1] == "timeout"
    assert pool.wait_ready(30)
    assert pool.run_all([Task("dapo", "Answer: 3", "3")])[0].verdict.correct


def test_two_stuck_items_run_in_parallel_workers(pool: VerifierPool) -> None:
    start = time.monotonic()
    outcomes = pool.run_all(
        [Task("math_verify", TOWER, "5"), Task("cascade", f"Answer: {TOWER}", "1")]
    )
    assert all(o.timed_out for o in outcomes)
    assert time.monotonic() - start < HARD_TIMEOUT_S + 2.0  # not 2 x the timeout
    assert pool.wait_ready(30)


def test_worker_killed_from_outside_is_replaced(pool: VerifierPool) -> None:
    assert pool.wait_ready(30)
    victim, before = pool.worker_pids()[0], pool.restarts
    os.kill(victim, signal.SIGKILL)
    outcomes = pool.run_all([Task("dapo", f"Answer: {n}", str(n)) for n in range(10)])
    assert all(o.verdict.correct for o in outcomes)  # a dead idle worker loses no task
    deadline = time.monotonic() + 10
    while victim in pool.worker_pids() and time.monotonic() < deadline:
        pool.run_all([Task("dapo", "Answer: 1", "1")])
    assert victim not in pool.worker_pids()
    assert pool.restarts == before + 1 and RESTART_REASONS[-1] == "died"


def test_closed_pool_answers_with_an_error() -> None:
    pool = VerifierPool(1, timeout_s=1.0, soft_timeout_s=0)  # never started: no processes
    pool.close()
    outcome = pool.submit(Task("dapo", "Answer: 1", "1")).result(timeout=1)
    assert not outcome.verdict.correct and "shut down" in outcome.verdict.error


def test_math_verify_own_timeout_answers_without_a_kill() -> None:
    """With soft_timeout_s set, SIGALRM in the worker's main thread ends the tower first."""
    pool = VerifierPool(1, timeout_s=20.0, soft_timeout_s=1).start()
    try:
        assert pool.wait_ready(60)
        pid = pool.worker_pids()
        outcome = pool.run_all([Task("math_verify", TOWER, "5")])[0]
        assert not outcome.timed_out and outcome.seconds < 10
        assert outcome.verdict.error.startswith("math_verify timeout")
        assert pool.worker_pids() == pid and pool.restarts == 0
    finally:
        pool.close()


def test_big_item_behind_a_stuck_one_does_not_block_the_deadline() -> None:
    """A 1 MB item must not be piped ahead to a stuck worker: the dispatcher would block on
    the full pipe and never enforce the deadline."""
    pool = VerifierPool(1, timeout_s=HARD_TIMEOUT_S, soft_timeout_s=0).start()
    try:
        assert pool.wait_ready(60)
        start = time.monotonic()
        stuck = pool.submit(Task("math_verify", TOWER, "5"))
        time.sleep(0.1)
        big = pool.submit(Task("dapo", "x" * 1_000_000 + "\nAnswer: 4", "4"))
        assert stuck.result(timeout=HARD_TIMEOUT_S + 10).timed_out
        assert big.result(timeout=10).verdict.correct
        assert time.monotonic() - start < HARD_TIMEOUT_S + 3.0
    finally:
        pool.close()


# -- chunked dispatch ---------------------------------------------------------------------


def normal_tasks(n: int, offset: int = 0) -> list[Task]:
    """Items that need math-verify (the rule says wrong), all correct."""
    return [Task("cascade", f"Answer: \\frac{{{2 * k}}}{{2}}", str(k)) for k in range(offset, n)]


def test_chunk_sizes_shrink_towards_the_end_of_the_queue() -> None:
    assert chunk_size(1000, 2) == MAX_CHUNK_ITEMS
    assert chunk_size(40, 2) == 10
    assert [chunk_size(n, 2) for n in (5, 4, 1, 0)] == [2, 1, 1, 1]


def test_progress_word_round_trips_index_and_time() -> None:
    import multiprocessing as mp

    progress = Progress(mp.get_context("forkserver").RawArray("q", 1))
    assert progress.read() == (0, 0.0)
    started = progress.mark(17)
    index, read_back = progress.read()
    assert index == 17 and abs(read_back - started) < 2e-6


def test_a_batch_goes_out_in_chunks(pool: VerifierPool) -> None:
    before = pool.chunks_sent
    outcomes = pool.run_all(normal_tasks(40))
    assert all(o.verdict.correct for o in outcomes)
    assert 2 <= pool.chunks_sent - before < 20  # per-item dispatch would take 40


def test_timeout_in_the_middle_of_a_chunk_loses_nothing() -> None:
    """One worker, so the tower sits inside a chunk: it alone times out; the items before
    it (done, maybe not yet sent) and after it (not started) are all answered."""
    pool = VerifierPool(1, timeout_s=HARD_TIMEOUT_S, soft_timeout_s=0).start()
    try:
        assert pool.wait_ready(60)
        tasks = [*normal_tasks(4), Task("math_verify", TOWER, "5"), *normal_tasks(12, 4)]
        assert chunk_size(len(tasks), 1) > 5  # the first chunk holds the tower and more
        outcomes = pool.run_all(tasks)
        assert [o.timed_out for o in outcomes] == [k == 4 for k in range(len(tasks))]
        assert "timeout_s=1.5" in outcomes[4].verdict.error
        assert all(o.verdict.correct and not o.verdict.error for o in outcomes[:4] + outcomes[5:])
        assert pool.restarts == 1
    finally:
        pool.close()


def test_worker_dying_twice_on_one_item_in_a_chunk_blames_only_that_item() -> None:
    """The tower never ends (no timeouts that matter here); we kill its worker twice. The
    progress word names the tower as the culprit: it gets the error, the rest of its
    chunk is verified by the replacements."""
    pool = VerifierPool(1, timeout_s=60.0, soft_timeout_s=0).start()
    try:
        assert pool.wait_ready(60)
        tasks = [*normal_tasks(3), Task("math_verify", TOWER, "5"), *normal_tasks(10, 3)]
        assert chunk_size(len(tasks), 1) > 4  # the first chunk holds the tower and more
        futures = pool.submit_all(tasks)
        for _ in range(2):
            time.sleep(0.5)  # the worker is past the quick items, inside the tower
            assert pool.wait_ready(30)
            os.kill(pool.worker_pids()[0], signal.SIGKILL)
        outcomes = [f.result(timeout=30) for f in futures]
        assert "died" in outcomes[3].verdict.error and not outcomes[3].timed_out
        assert all(o.verdict.correct and not o.verdict.error for o in outcomes[:3] + outcomes[4:])
        assert pool.restarts == 2
    finally:
        pool.close()


@pytest.mark.slow
def test_spawned_workers_share_the_progress_word() -> None:
    """start_method=spawn passes the shared progress word differently (no forkserver);
    a timeout mid-chunk must still name the stuck item."""
    pool = VerifierPool(1, timeout_s=HARD_TIMEOUT_S, soft_timeout_s=0, start_method="spawn")
    try:
        assert pool.start().wait_ready(120)
        tasks = [*normal_tasks(2), Task("math_verify", TOWER, "5"), *normal_tasks(8, 2)]
        outcomes = pool.run_all(tasks)
        assert [o.timed_out for o in outcomes] == [k == 2 for k in range(len(tasks))]
        assert all(o.verdict.correct for o in outcomes[:2] + outcomes[3:])
    finally:
        pool.close()


def inline_cases() -> list[tuple[str, str, str]]:
    """(verifier, response, ground truth) for the rules checked in the request's thread:
    right, wrong, unparsable, and over the inline bounds (those go to the pool)."""
    from reward.inline import MAX_INLINE_GROUND_TRUTH_CHARS, MAX_INLINE_RESPONSE_CHARS

    cases = [("first_integer", f"{n}+{n}", str(n if n % 3 else n + 1)) for n in range(20)]
    cases += [("dapo", f"so... Answer: {n}", str(n if n % 4 else -n)) for n in range(20)]
    cases += [("dapo", "no answer line", "3"), ("first_integer", "none", "3")]
    cases += [("dapo", "Answer: 1", "1" * (MAX_INLINE_GROUND_TRUTH_CHARS + 1))]
    cases += [("first_integer", "7" + "+" * MAX_INLINE_RESPONSE_CHARS, "7")]
    return cases


def test_bounded_rules_on_short_text_skip_the_pool_with_its_verdicts(pool: VerifierPool) -> None:
    """The dapo and first_integer rules on short text are verified inline, give exactly
    the workers' verdicts, and only the items over the bounds (or cascade) reach a worker."""
    from reward.inline import runs_inline
    from reward.scoring import Limits, ScoreInput, Scorer
    from reward.shaping import OverlongShaping

    limits, shaping = Limits(1000, 1_000_000, 10_000), OverlongShaping(100, 20, 1.0)
    cases = inline_cases()
    items = [ScoreInput(r, g, verifier=v) for v, r, g in cases]
    by_pool = Scorer(pool, limits, shaping, "cascade", inline_rules=False).score(items)
    before = pool.chunks_sent
    inline = Scorer(pool, limits, shaping, "cascade").score(items[:-2])
    assert pool.chunks_sent == before  # nothing went to a worker
    mixed = Scorer(pool, limits, shaping, "cascade").score(
        items[-2:] + [ScoreInput("Answer: 2", "2")]
    )
    assert pool.chunks_sent > before  # the long ones and the cascade item did
    assert [(o.correct, o.pred, o.verifier, o.reward) for o in inline + mixed[:2]] == [
        (o.correct, o.pred, o.verifier, o.reward) for o in by_pool
    ]
    assert sum(o.correct for o in inline) == 13 + 16 and mixed[2].correct  # -0 is "0"
    assert [runs_inline(Task(v, r, g)) for v, r, g in cases[-2:]] == [False, False]
