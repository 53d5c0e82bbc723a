"""Print the exact floors of the package's declared dependencies, one ``name==version`` a
line: those of ``[project] dependencies`` and of the extras named as arguments, read from
``pyproject.toml``. ``make test-floors`` installs them, so the floors it tests are the
ones declared. Every such requirement must be ``name>=version``: one with no floor (or
any other form) is refused, as its oldest release would be a guess."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.]*)$")


def floors(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"floors: no extra {', '.join(unknown)} in {pyproject}")
    pins, refused = [], []
    for requirement in [*project["dependencies"], *(r for extra in extras for r in optional[extra])]:
        if requirement.startswith(f"{name}["):  # an extra naming others: those are listed themselves
            continue
        match = FLOOR.match(requirement.strip())
        if match is None:
            refused.append(requirement)
        else:
            pins.append(f"{match[1]}=={match[2]}")
    if refused:
        raise SystemExit(f"floors: not of the form name>=version: {', '.join(refused)}")
    return pins


if __name__ == "__main__":
    extras = [e for arg in sys.argv[1:] for e in arg.split(",") if e]
    print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml", extras)))
