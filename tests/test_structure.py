"""The package's shape: imports flow one way (no cycles) and the package holds the library only."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "celery_zklock"


def _imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth, deferred imports included)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        name = path.stem
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_zklock."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("celery_zklock."))
    graph.pop("__init__", None)  # lazy re-exports of everything, imported by nothing inside
    for deps in graph.values():
        deps.discard("__init__")
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_itself():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles_in_the_package():
    graph = _imports()
    assert {"task", "lock", "internals", "driver", "session", "worker_loss"} <= set(graph)
    assert _cycle(graph) is None


def test_imports_flow_from_task_to_client():
    """task -> key -> path -> lock -> client: the engine never reaches up into Celery glue."""
    graph = _imports()
    glue = {"task", "worker_loss", "cli", "options", "signals", "redelivery", "interrupts"}
    for engine in ("lock", "internals", "driver", "session", "znodes", "kazoo_compat", "identity", "keys"):
        assert not graph.get(engine, set()) & glue, (engine, graph.get(engine))


def test_package_ships_no_test_or_dev_tools():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        if path.stem != "testing":  # the opt-in pytest plugin for users' own tests
            assert not imported & {"pytest", "redis"}, path.name


README = PACKAGE.parent / "README.md"


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in the README, as cell texts."""
    text = README.read_text()
    section = text[text.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # without the header


def test_readme_settings_table_matches_the_declarations():
    import ast as literal

    from celery_zklock.config import SETTINGS

    rows = _table("## Settings")
    names = [r[0].strip("`") for r in rows]
    assert names == list(SETTINGS), "README settings table drifted from celery_zklock.config.SETTINGS"
    for row in rows:
        name, default = row[0].strip("`"), row[1].strip("`")
        assert literal.literal_eval(default) == SETTINGS[name].default, (name, default)


def test_readme_task_options_table_matches_the_declarations():
    import re

    from celery_zklock.config import SETTINGS, TASK_OPTIONS
    from celery_zklock.options import LOCK_OPTIONS

    rows = _table("## Task options")
    documented = [n for r in rows for n in re.findall(r"`(\w+)`", r[0])]
    assert sorted(documented) == sorted(LOCK_OPTIONS), "README task options table drifted from LOCK_OPTIONS"
    for row in rows:
        option = re.findall(r"`(\w+)`", row[0])[0]
        if option in TASK_OPTIONS and row[1] != "settings":
            assert row[1].strip("`") == TASK_OPTIONS[option] in SETTINGS, row
