"""Print the requirements of pyproject.toml's project plus those of the extras named as
arguments, one per line. The images install these in a layer of their own, before the
source is copied in, so a source edit rebuilds only the project's wheel (Dockerfile.slim,
Dockerfile.cpu).

    python requirements.py reward > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any


def requirements(project: dict[str, Any], extras: list[str]) -> list[str]:
    """The base dependencies and those of EXTRAS, a self-reference (`dapo[a,b]`) expanded."""
    own = re.compile(rf"^{re.escape(project['name'])}\[([\w,\s-]+)\]$")
    found = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in project["optional-dependencies"][extra]:
            match = own.match(requirement)
            if match:
                todo += [e.strip() for e in match.group(1).split(",")]
            elif requirement not in found:
                found.append(requirement)
    return found


if __name__ == "__main__":
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    print("\n".join(requirements(pyproject["project"], sys.argv[1:])))
