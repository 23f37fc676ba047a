"""docs/reward.md's worked example agrees with the shaping function and the defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reward.shaping import overlong_penalty
from services.tools.config import load_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "reward.md"


def json_blocks(text: str) -> list[dict]:
    """Every ```json block of the document, parsed."""
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]


def test_reward_doc_example_numbers_match_the_shaping_function() -> None:
    request, response = json_blocks(DOC.read_text())[:2]
    shared = load_config(env={}).shared  # the doc's numbers are the paper's defaults
    for item, result in zip(request["items"], response["results"], strict=True):
        penalty = overlong_penalty(
            item["response_length"],
            shared.max_response_length,
            shared.overlong_buffer_length,
            shared.overlong_penalty_factor,
        )
        assert result["overlong_penalty"] == pytest.approx(penalty, abs=5e-5)
        base = 1.0 if result["correct"] else -1.0
        assert result["reward"] == pytest.approx(base + penalty, abs=5e-5)


def test_reward_doc_formula_names_the_paper_values() -> None:
    shared = load_config(env={}).shared
    text = DOC.read_text()
    values = f"{shared.max_response_length}, {shared.overlong_buffer_length}, 1.0"
    assert f"(paper: {values})" in text


def test_readme_names_the_http_body_shape() -> None:
    """README said "a JSON list of items"; the API wants an object with one `items` list."""
    from reward.http_api import JsonRequest

    readme = (DOC.parent.parent / "README.md").read_text()
    assert set(JsonRequest.model_fields) == {"items"}
    assert '`{"items": [...]}`' in readme and "JSON list of items" not in readme
