"""The ablation's numbers as artefacts: the 95% bootstrap interval of a rung's mean, and
the committed result files (docs/results/ablation-*/table.json) agree with their
table.md and with the tables of every page under docs/ that cites them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.tools.ablation_table import bootstrap_ci, rendered, table_md

ROOT = Path(__file__).resolve().parent.parent
RESULTS = sorted((ROOT / "docs" / "results").glob("ablation-*/table.json"))
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_bootstrap_interval_on_hand_values() -> None:
    assert bootstrap_ci([0.4, 0.4, 0.4]) == pytest.approx((0.4, 0.4))  # no spread
    # Two seeds: resampled means are 0, 0.5, 1 with p = 1/4, 1/2, 1/4; both tails are
    # 1/4 > 2.5%, so the 95% interval is the whole range.
    assert bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    five = [0.2, 0.4, 0.6, 0.8, 1.0]
    lo, hi = bootstrap_ci(five)
    assert 0.2 <= lo < 0.6 < hi <= 1.0
    narrow = bootstrap_ci(five, level=0.5)
    assert lo < narrow[0] < narrow[1] < hi
    assert bootstrap_ci(five) == (lo, hi)  # seeded: a re-rendered table is the same table
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_results_are_committed() -> None:
    assert RESULTS, "no docs/results/ablation-*/table.json: the docs' numbers have no file"


@pytest.mark.parametrize("path", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_matches_its_runs_and_the_doc(path: Path) -> None:
    data = rendered(json.loads(path.read_text()))
    md = table_md(data["plan"], data["summary"], data["meta"])
    assert (path.parent / "table.md").read_text() == md, "table.md is stale: --rerender"
    cite = f"docs/results/{path.parent.name}/"
    citing = [d for d in DOCS if cite in d.read_text()]
    assert citing, f"no page under docs/ cites {cite}"
    for doc in citing:
        missing = [line for line in table_lines(md) if line not in doc.read_text()]
        assert not missing, f"{doc.name} differs from {cite}table.md: {missing}"
