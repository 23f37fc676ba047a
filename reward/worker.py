"""The verifier worker process and what it shares with the pool's dispatcher.

A worker verifies a chunk of items one by one in its main thread and sends the verdicts
back in few messages (at the chunk's end, and whenever FLUSH_S has passed); before each
item it writes (item index, start time) into the shared `Progress` word, so the
dispatcher keeps a deadline per item without a message. The JSON wire format and why:
docs/reward.md, "How the pool spends (little) time on each item".
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from reward.verifiers import Verdict, run_verifier

FLUSH_S = 0.05  # send finished verdicts at least this often while a chunk runs
MAX_CHUNK_ITEMS = 4096  # the item index must fit the low bits of the progress word
_US = 1_000_000


class Progress:
    """(index of the item being verified, when it started), in shared memory.

    `array` is a one-element `RawArray("q")` shared by the dispatcher and one worker.
    Times are time.monotonic(), the same clock in every process of the machine."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def mark(self, index: int) -> float:
        """Worker: item `index` of the current chunk starts now; returns now."""
        now = time.monotonic()
        self.array[0] = int(now * _US) * MAX_CHUNK_ITEMS + index
        return now

    def read(self) -> tuple[int, float]:
        """Dispatcher: the last (index, start time) a worker marked; (0, 0.0) before any."""
        started_us, index = divmod(self.array[0], MAX_CHUNK_ITEMS)
        return index, started_us / _US


def encode_task(verifier: str, response: str, ground_truth: str) -> bytes:
    """One chunk element, encoded once and reused if the item is dispatched again."""
    return json.dumps([verifier, response, ground_truth]).encode()


def encode_chunk(payloads: Sequence[bytes]) -> bytes:
    """A chunk message from encoded elements (a single join, no re-encoding)."""
    return b"[" + b",".join(payloads) + b"]"


def decode_reply(data: bytes) -> int | list[tuple[Verdict, float]]:
    """A worker's message: its pid when it is ready, else verdicts with their seconds."""
    message = json.loads(data)
    if isinstance(message, dict):
        return int(message["ready"])
    return [(Verdict(bool(c), p, v, e), float(s)) for c, p, v, e, s in message]


def worker_main(conn: Connection, progress_array: Any, soft_timeout_s: int) -> None:
    """A worker's loop: read a chunk, verify it item by item, send verdicts, repeat."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    from reward.preload import warm_up  # a no-op after the forkserver preload; else pay now

    warm_up()
    progress = Progress(progress_array)
    conn.send_bytes(json.dumps({"ready": os.getpid()}).encode())
    while True:
        try:
            chunk = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        run_chunk(conn, progress, chunk, soft_timeout_s)


def run_chunk(conn: Connection, progress: Progress, chunk: list, soft_timeout_s: int) -> None:
    """Verify each item; send what is done every FLUSH_S and at the end."""
    done: list[list[object]] = []
    sent = time.monotonic()
    for index, (verifier, response, ground_truth) in enumerate(chunk):
        start = progress.mark(index)
        verdict = run_verifier(verifier, response, ground_truth, soft_timeout_s)
        now = time.monotonic()
        done.append([verdict.correct, verdict.pred, verdict.verifier, verdict.error, now - start])
        if now - sent >= FLUSH_S or index == len(chunk) - 1:
            conn.send_bytes(json.dumps(done).encode())
            done, sent = [], now
