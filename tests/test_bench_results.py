"""benchmarks/_results.py: the one `checks` row shape and result writer every benchmark uses."""

from __future__ import annotations

import importlib
import json
import os
import platform
from pathlib import Path

import pytest

from benchmarks._results import at_least, at_most, check, machine, result_path, write_result
from services.tools.bench import list_benchmarks


def test_check_row_has_the_result_file_shape_and_rounds_floats_only() -> None:
    assert check("ratio", 1.23456, ">= 1", True) == {
        "name": "ratio",
        "value": 1.235,
        "target": ">= 1",
        "ok": True,
    }
    assert check("r", 0.123456, 0.1, 1, digits=4)["value"] == 0.1235
    assert check("count", 7, 0, False)["value"] == 7
    assert check("pair", [0.11111, 0.9], "x", True)["value"] == [0.11111, 0.9]
    assert check("missing", None, "<= 1.1", False)["value"] is None
    assert check("r", 1.0, 1.0, 1)["ok"] is True  # a truthy int becomes a JSON bool


def test_bounds_compare_the_unrounded_value() -> None:
    assert at_least("a", 0.9, 0.9)["ok"] and not at_least("a", 0.8999, 0.9)["ok"]
    assert at_least("a", 0.8999, 0.9)["value"] == 0.9  # shown rounded, judged exact
    assert at_most("b", 1.0, 1.0)["ok"] and not at_most("b", 1.0004, 1.0)["ok"]
    assert at_most("errors", 0, 0) == {"name": "errors", "value": 0, "target": 0, "ok": True}


def test_write_result_writes_what_dapo_bench_reads_and_returns_the_exit_code(
    tmp_path: Path,
) -> None:
    path = tmp_path / "deep" / "x.json"
    good = {"details": {"n": 3}, "checks": [at_least("a", 2.0, 1.0)]}
    assert write_result(path, good) == 0
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == good
    bad = {"checks": [at_least("a", 2.0, 1.0), at_most("b", 2.0, 1.0)]}
    assert write_result(path, bad) == 1
    assert json.loads(path.read_text())["checks"][1]["ok"] is False


def test_machine_rounds_the_start_load_and_reads_the_end_load_now() -> None:
    row = machine((1.23456, 0.0, 2.5))
    assert row["load_average_start"] == [1.23, 0.0, 2.5]
    assert len(row["load_average_end"]) == 3 and row["cpus"] == os.cpu_count()
    assert row["python"] == platform.python_version() and row["platform"]


def test_result_path_is_where_dapo_bench_reads() -> None:
    import services.tools.bench as bench

    assert result_path("pipeline") == bench.BENCH_DIR / "results" / "pipeline.json"


@pytest.mark.parametrize("name", list_benchmarks())
def test_every_benchmark_writes_its_result_through_the_shared_writer(name: str) -> None:
    """Each benchmark (what `dapo bench` lists) imports and writes where `dapo bench` reads."""
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.RESULTS == result_path(name)
    assert module.write_result is write_result


def test_repeats_hold_a_check_only_if_it_held_in_every_run() -> None:
    """`dapo bench --repeats N`: each row lists its N values, says in how many it held and
    their spread, and passes only N of N; a row missing from a run fails; the load before
    each run and the last run's details are kept."""
    from services.tools.bench import merge_repeats

    runs = [
        {"details": 1, "checks": [at_least("a", 2.0, 1.0), at_most("b", 0.5, 1.0)]},
        {"details": 2, "checks": [at_least("a", 0.5, 1.0), at_most("b", 0.7, 1.0)]},
        {"details": 3, "checks": [at_least("a", 3.0, 1.0)]},
    ]
    for run, load in zip(runs, (0.4, 1.2, 0.9), strict=True):
        run["load_before"] = load
    merged = merge_repeats(runs, 1.5)
    a, b = merged["checks"]
    assert a == {
        "name": "a",
        "value": [2.0, 0.5, 3.0],
        "target": 1.0,
        "ok": False,
        "held": "2 of 3",
        "spread": [0.5, 3.0],
    }
    assert b["held"] == "2 of 3" and not b["ok"]  # held where it ran, but ran in 2 of 3
    assert merged["details"] == 3 and "load_before" not in merged
    assert merged["repeats"]["load_before"] == [0.4, 1.2, 0.9]
    assert merged["repeats"]["load_below"] == 1.5 and merged["repeats"]["n"] == 3
    good = merge_repeats([{**runs[2], "load_before": 0.1}] * 2, None)["checks"][0]
    assert good["ok"] and good["held"] == "2 of 2"
    pair = merge_repeats([{"checks": [check("p", [0.1, 0.9], "x", True)], "load_before": 0}], None)
    assert "spread" not in pair["checks"][0]  # only numbers have a spread


def test_bench_options_are_checked_before_anything_runs() -> None:
    import argparse

    from services.common import arg_types

    assert arg_types.load_average("1.5") == 1.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            arg_types.load_average(bad)
    from services.common.errors import DapoError
    from services.tools.bench import run_benchmark

    with pytest.raises(DapoError, match="at least 1"):
        run_benchmark("pipeline_tiny", [], repeats=0)
