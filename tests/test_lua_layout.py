"""The Lua prelude's files and their order (backends/redis_replies.py: PRELUDE).

Every script is loaded after the prelude as one chunk, and a Lua ``local`` is seen only
below its definition: a call to a helper defined further down would call a global, nil,
and fail only when that line runs. So the order of the files is checked statically: each
``siq_*`` function and ``SIQ_*`` constant is defined once, and nothing uses one before it
is defined (the rules of a limit kind, ``siq_celery/rules/<kind>.lua``, call only their
own helpers and those of the store plumbing and of the kinds before them)."""

from __future__ import annotations

import re
from pathlib import Path

from siq_celery.backends.redis_replies import PRELUDE, SCRIPTS, load_script_source
from tests.test_json_only import lua_code_lines

PACKAGE = Path(__file__).resolve().parent.parent / "siq_celery"
LUA = PACKAGE / "backends" / "lua"
DEFINES = re.compile(r"^local (?:function (siq_\w+)|((?:SIQ_\w+, )*SIQ_\w+) =)", re.M)
USES = re.compile(r"\b(siq_\w+|SIQ_\w+)\b")


def code(path: str) -> str:
    return "\n".join(text for _, text in lua_code_lines((PACKAGE / path).read_text("utf-8")))


def definitions() -> dict[str, list[tuple[int, int]]]:
    """Name -> (file index in PRELUDE, offset in its code) of each of its definitions."""
    found: dict[str, list[tuple[int, int]]] = {}
    for index, path in enumerate(PRELUDE):
        for match in DEFINES.finditer(code(path)):
            for name in (match.group(1) or match.group(2)).split(", "):
                found.setdefault(name, []).append((index, match.start()))
    return found


def test_the_prelude_is_every_store_file_and_every_rules_file_in_its_order() -> None:
    assert all((PACKAGE / path).is_file() for path in PRELUDE), [p for p in PRELUDE if not (PACKAGE / p).is_file()]
    assert len(set(PRELUDE)) == len(PRELUDE)
    beside = {f"backends/lua/{p.name}" for p in LUA.glob("_*.lua")} | {
        f"rules/{p.name}" for p in (PACKAGE / "rules").glob("*.lua")
    }
    assert beside == set(PRELUDE), "a prelude file not in PRELUDE, or the other way round"
    assert {p.stem for p in LUA.glob("*.lua") if not p.name.startswith("_")} == set(SCRIPTS)
    assert all(len((PACKAGE / p).read_text().splitlines()) <= 500 for p in PRELUDE)


def test_each_function_and_constant_of_the_prelude_is_defined_once() -> None:
    found = definitions()
    twice = {name: [PRELUDE[i] for i, _ in where] for name, where in found.items() if len(where) > 1}
    assert not twice
    assert len(found) > 80  # the count when the prelude was split by limit kind: 93


def test_nothing_in_the_prelude_is_used_above_its_definition() -> None:
    """A call in a file earlier in PRELUDE than its definition, or above it in the same file
    (a function may call itself: ``local function f`` is in scope in its own body)."""
    found = {name: where[0] for name, where in definitions().items()}
    early, unknown = [], []
    for index, path in enumerate(PRELUDE):
        for match in USES.finditer(code(path)):
            name = match.group(1)
            if name not in found:
                unknown.append(f"{path}: {name}")
            elif found[name] > (index, match.start()):
                early.append(f"{path}: {name}, defined in {PRELUDE[found[name][0]]}")
    assert not early, "used before its definition:\n" + "\n".join(sorted(set(early)))
    assert not unknown, "used, never defined:\n" + "\n".join(sorted(set(unknown)))


def test_every_script_uses_only_what_the_prelude_defines() -> None:
    found = definitions()
    for name in SCRIPTS:
        source = load_script_source(name)
        assert source.startswith((PACKAGE / PRELUDE[0]).read_text()), name
        own = code(f"backends/lua/{name}.lua")
        assert set(USES.findall(own)) <= set(found), (name, set(USES.findall(own)) - set(found))


def test_each_limit_kind_is_a_python_module_with_its_lua_twin_beside_it() -> None:
    """siq_celery/rules/: one module per limit kind, its Redis twin beside it by name, and
    every twin in the prelude; no module of the package (Lua included) over 500 lines."""
    rules = PACKAGE / "rules"
    python = {p.stem for p in rules.glob("*.py") if p.stem != "__init__"}
    lua = {p.stem for p in rules.glob("*.lua")}
    print(f"\nrules: {sorted(python)}")
    assert python == lua and {"tickets", "spacing", "window", "concurrency", "fair", "declarations"} <= python
    assert {f"rules/{kind}.lua" for kind in lua} <= set(PRELUDE)
    for kind in lua:
        header = (rules / f"{kind}.lua").read_text("utf-8").split("\n\n", 1)[0]
        assert f"twin: siq_celery/rules/{kind}.py" in header, kind
    sizes = {
        str(p.relative_to(PACKAGE)): len(p.read_text("utf-8").splitlines())
        for p in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]
    }
    largest = max(sizes, key=lambda k: sizes[k])
    print(f"largest module: {largest} ({sizes[largest]} lines)")
    assert {k: n for k, n in sizes.items() if n > 500} == {}
