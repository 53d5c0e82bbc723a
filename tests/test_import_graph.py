"""The package's modules import each other without a circle (type-only imports included):
each side of IntervalTask (tasks/publish.py, tasks/gate.py) types against tasks/task_api.py, never tasks/task.py."""

from __future__ import annotations

import ast
from pathlib import Path

import siq_celery

PACKAGE = Path(siq_celery.__file__).resolve().parent


def imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from . import x`` resolved to ``x``;
    the package itself left out: it only re-exports)."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:  # `from . import model` names a module
                if f"{target}.{alias.name}" in modules:
                    edges.add(f"{target}.{alias.name}")
            if target in modules and target != "siq_celery":
                edges.add(target)
        graph[name] = edges - {name}
    return graph


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph = imports()
    circles = []
    for module, edges in graph.items():
        seen, todo = set(), list(edges)
        while todo:
            nxt = todo.pop()
            if nxt == module:
                circles.append(module)
                break
            if nxt not in seen:
                seen.add(nxt)
                todo.extend(graph.get(nxt, ()))
    task_importers = sorted(m for m, edges in graph.items() if "siq_celery.tasks.task" in edges)
    print(f"\nmodules in an import circle: {sorted(circles)}; importing tasks/task.py: {task_importers}")
    assert circles == []
