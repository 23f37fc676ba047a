"""Checkpoints written in the background while the next steps train.

A checkpoint's state is copied to host memory on the training thread (`snapshot`: a
GPU→CPU copy, a clone on CPU, far faster than storage), then one writer thread per rank
writes the copy. `latest` names a checkpoint only once every rank's files are on disk
(`write_latest`, atomic), so a learner killed mid-write resumes from the previous one.
At most one write is in flight: the next checkpoint waits for it. docs/reliability.md,
"Checkpoints in the background".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

Saver = Callable[[object, Path], None]  # writes a state (a nested structure) to a path


def snapshot(state: object) -> object:
    """`state` with every tensor copied to host memory (containers rebuilt, other values
    shared: they are not changed by training)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        copied = {k: snapshot(v) for k, v in state.items()}
        return OrderedDict(copied) if isinstance(state, OrderedDict) else copied
    if isinstance(state, list | tuple):
        return type(state)(snapshot(v) for v in state)
    return state


def tensor_bytes(state: object) -> int:
    """Bytes of the tensors in a nested state (what a write of it moves)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def torch_save(state: object, path: Path) -> None:
    """torch.save to a temporary name, on disk (fsync: `latest` never names a file the
    page cache still holds), then renamed: a file is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


@dataclass(frozen=True)
class PendingWrite:
    """One file (or directory) of a checkpoint: a copied state and how to write it."""

    path: Path
    state: object
    save: Saver = torch_save


def write_latest(directory: str | Path, tag: str) -> None:
    """Point `latest` at `tag` atomically (a reader sees the old or the new tag)."""
    root = Path(directory)
    tmp = root / f"latest.tmp{os.getpid()}"
    tmp.write_text(tag)
    tmp.replace(root / "latest")


def yield_cpu() -> None:
    """Lowest CPU priority for the calling thread (Linux: a thread is a task of its own),
    so the write takes only the CPU time training leaves."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class WriteResult:
    tag: str
    nbytes: int
    seconds: float
    error: BaseException | None = None


class BackgroundWriter:
    """One write in flight at a time, on a daemon thread; `done`/`result` report it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: WriteResult | None = None
        self.tag: str | None = None  # the write started and not yet collected

    def start(self, tag: str, writes: list[PendingWrite]) -> None:
        assert self.tag is None, "one checkpoint write at a time: collect the last first"
        self.tag, self._result = tag, None
        self._thread = threading.Thread(
            target=self._write, args=(tag, writes), name=f"checkpoint-{tag}", daemon=True
        )
        self._thread.start()

    def _write(self, tag: str, writes: list[PendingWrite]) -> None:
        started, nbytes = time.monotonic(), sum(tensor_bytes(w.state) for w in writes)
        yield_cpu()
        try:
            for w in writes:
                w.path.parent.mkdir(parents=True, exist_ok=True)
                w.save(w.state, w.path)
            self._result = WriteResult(tag, nbytes, time.monotonic() - started)
        except BaseException as e:  # reported on the training thread by `collect`
            self._result = WriteResult(tag, nbytes, time.monotonic() - started, e)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """Whether the finished write raised (the checkpoint is incomplete)."""
        return self._result is not None and self._result.error is not None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def collect(self) -> WriteResult:
        """The finished write's result (call once it is not `busy`); frees the slot."""
        self.wait()
        assert self._result is not None
        result, self._result, self.tag, self._thread = self._result, None, None, None
        return result
