"""The background checkpoint writer's parts: the host copy, one write at a time, errors
reported to the training thread, and `latest` replaced atomically."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from learner.async_checkpoint import (
    BackgroundWriter,
    PendingWrite,
    snapshot,
    tensor_bytes,
    torch_save,
    write_latest,
)

pytestmark = pytest.mark.unit


def test_snapshot_is_a_copy_that_training_does_not_change() -> None:
    weight = torch.ones(4)
    state = {"module": OrderedDict(w=weight), "opt": [{"step": 3, "m": weight * 2}], "x": "y"}
    copied = snapshot(state)
    weight.add_(5)  # the next step's update, in place
    assert isinstance(copied, dict) and isinstance(copied["module"], OrderedDict)
    assert torch.equal(copied["module"]["w"], torch.ones(4))
    assert copied["opt"][0]["step"] == 3 and copied["x"] == "y"
    assert tensor_bytes(copied) == 2 * 4 * 4


def test_a_write_runs_beside_the_caller_and_reports_its_size(tmp_path: Path) -> None:
    release = threading.Event()

    def slow_save(state: object, path: Path) -> None:
        release.wait(10)
        torch_save(state, path)

    writer = BackgroundWriter()
    writer.start("step2", [PendingWrite(tmp_path / "step2" / "a.pt", torch.zeros(8), slow_save)])
    assert writer.busy and writer.tag == "step2"
    with pytest.raises(AssertionError, match="one checkpoint write at a time"):
        writer.start("step4", [])
    release.set()
    result = writer.collect()
    assert (result.tag, result.nbytes, result.error) == ("step2", 32, None)
    assert torch.equal(torch.load(tmp_path / "step2" / "a.pt"), torch.zeros(8))
    assert writer.tag is None and not writer.busy


def test_a_failed_write_is_reported_and_leaves_no_whole_file(tmp_path: Path) -> None:
    def disk_full(state: object, path: Path) -> None:
        path.with_name(path.name + ".tmp").write_bytes(b"part")
        raise OSError(28, "No space left on device")

    writer = BackgroundWriter()
    writer.start("step4", [PendingWrite(tmp_path / "step4" / "a.pt", torch.zeros(2), disk_full)])
    writer.wait()
    assert writer.failed
    result = writer.collect()
    assert isinstance(result.error, OSError)
    assert not (tmp_path / "step4" / "a.pt").exists()


def test_latest_is_replaced_whole(tmp_path: Path) -> None:
    write_latest(tmp_path, "step2")
    write_latest(tmp_path, "step4")
    assert (tmp_path / "latest").read_text() == "step4"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
