"""The deploy tests' real tools are installed and run (deploy_tools.require_tool)."""

from __future__ import annotations

import pytest
from deploy_tools import require_tool, run_tool


@pytest.mark.parametrize(
    ("binary", "package", "words"),
    [
        ("promtool", "prometheus", "promtool"),
        ("prometheus", "prometheus", "prometheus"),
        ("docker-compose", "docker-compose", "docker-compose"),
    ],
)
def test_tool_is_installed_and_runs(binary: str, package: str, words: str) -> None:
    done = run_tool(require_tool(binary, package), "--version")
    assert done.returncode == 0, done.stderr
    assert words in (done.stdout + done.stderr).lower()
