"""The README's examples run as written: every command of its `bash` blocks that needs
no GPU, Docker or cluster (each `dapo` line) runs in order, in one empty directory, and
exits 0; every other command is one the test names with the reason it is not run here."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from dapo_cli import DAPO

README = Path(__file__).resolve().parents[1] / "README.md"
# First words of README commands not run here, and why.
NOT_RUN = {
    "make": "the build itself (`make test` runs this test; `make demo` is the 100-step demo)",
    "cp": "the Docker Compose set-up (.env)",
    "docker": "needs Docker (make test-containers)",
    "kubectl": "needs a Kubernetes cluster",
}
COMMAND_TIMEOUT_S = 600  # the longest, the 4-step `dapo up`, takes ~35 s on a quiet CPU


def bash_commands(text: str) -> list[list[str]]:
    """Each command line of the ```bash blocks, split as the shell would (comments and
    line continuations removed)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    joined = "\n".join(blocks).replace("\\\n", " ")
    words = (shlex.split(line, comments=True) for line in joined.splitlines())
    return [w for w in words if w]


def test_bash_commands_are_split_as_the_shell_would() -> None:
    text = "x\n```bash\ndapo up --steps 4   # short\nkubectl a \\\n  b\n```\n```\ndapo no\n```\n"
    assert bash_commands(text) == [["dapo", "up", "--steps", "4"], ["kubectl", "a", "b"]]


def test_the_readme_examples_run_as_written(tmp_path: Path) -> None:
    commands = bash_commands(README.read_text())
    others = {argv[0] for argv in commands if argv[0] != "dapo"}
    assert others <= set(NOT_RUN), f"a README command the test neither runs nor skips: {others}"
    runnable = [argv for argv in commands if argv[0] == "dapo"]
    subcommands = {argv[1] for argv in runnable}
    assert {"init-model", "up", "eval", "ledger"} <= subcommands, subcommands
    for argv in runnable:
        result = subprocess.run(
            [*DAPO, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            cwd=tmp_path,
        )
        assert result.returncode == 0, f"{shlex.join(argv)}\n{result.stderr[-3000:]}"
    assert (tmp_path / "runs" / "try" / "report.json").is_file()
