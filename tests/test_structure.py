"""The package's shape: imports flow one way (no cycles) and the package holds the library only."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "celery_zklock"


def _module(path: pathlib.Path) -> str:
    """``engine/lock.py`` -> ``engine.lock``; ``task.py`` -> ``task``; a package's __init__ -> its name."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _modules() -> list[pathlib.Path]:
    return [p for p in PACKAGE.rglob("*.py") if "contrib" not in p.relative_to(PACKAGE).parts]


def _imports() -> dict[str, set[str]]:
    """Module (dotted, below the package) -> the package modules it imports, at any depth
    (deferred imports included); ``from . import a`` names the modules a."""
    names = {_module(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        name = _module(path)
        package = name.rsplit(".", 1)[0] if path.stem != "__init__" and "." in name else ("" if path.stem != "__init__" else name)
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
                if node.module:
                    deps.add(target)
                for alias in node.names:
                    if (f"{target}.{alias.name}" if target else alias.name) in names:
                        deps.add(f"{target}.{alias.name}" if target else alias.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_zklock."):
                target = node.module.split(".", 1)[1]
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("celery_zklock."))
        deps &= names
        deps.discard(name)
    for pkg in ("__init__", "engine", "worker"):
        graph.pop(pkg, None)  # lazy re-exports / empty packages
    for deps in graph.values():
        deps -= {"__init__", "engine", "worker"}
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
    assert {"task", "engine.lock", "engine.internals", "engine.driver", "engine.session", "worker.worker_hooks",
            "worker.agent"} <= set(graph)
    assert _cycle(graph) is None


#: The layers, lowest first; a module may import its own layer and those below, never above.
#: * base: errors, settings and what every layer shares;
#: * engine: the lock protocol on ZooKeeper (no Celery): znodes, sessions, the blocking API;
#: * worker: what runs in a worker's main process, its lock agent and a pool process's link;
#: * glue: the Celery task class, publishing, the CLI, the elected beat (beat.*) and the test plugin.
BASE = {"errors", "config", "security", "states", "signals", "keys", "options", "metrics", "logs", "process_records",
        "internals_used", "lock_waiting"}
GLUE = {"task", "held", "decision", "enqueue", "cli", "by_config", "redelivery",
        "testing", "testing_servers", "testing_tls", "testing_probes"}


def _layer(module: str) -> int:
    if module in BASE:
        return 0
    if module.startswith("engine."):
        return 1
    if module.startswith("worker."):
        return 2
    assert module in GLUE or module == "beat" or module.startswith("beat."), f"{module}: put it in a layer (tests/test_structure.py)"
    return 3


def test_every_module_has_a_layer_and_imports_flow_down():
    """glue -> worker -> engine -> base: the engine never reaches into the worker or the
    Celery glue, the worker never into the glue.  (config's path check borrows the engine's
    znode rules: a deferred import of engine.znodes, the one way up from base.)"""
    graph = _imports()
    up = [(m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)]
    assert up == [("config", "engine.znodes")], up


def test_the_layers_are_subpackages():
    assert {m for m in _imports() if _layer(m) == 1} >= {"engine.lock", "engine.internals", "engine.client"}
    assert {m for m in _imports() if _layer(m) == 2} >= {"worker.agent", "worker.cohort", "worker.wait_outside_pool"}


def test_imports_flow_from_task_to_client():
    """task -> key -> path -> lock -> client: the engine never reaches up into Celery glue."""
    graph = _imports()
    for engine in [m for m in graph if m.startswith("engine.")] + ["keys"]:
        assert not {d for d in graph[engine] if _layer(d) >= 2}, (engine, graph[engine])


def test_package_ships_no_test_or_dev_tools():
    for path in _modules():  # contrib/pytest_celery is the opt-in vendor of pytest-celery
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        if path.stem != "testing":  # the opt-in pytest plugin for users' own tests
            assert not imported & {"pytest", "redis"}, path.name


#: The task options and settings tables stay in the README (issue 36: a newcomer needs them first).
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


#: An accident catcher, not a design rule (issue 38): a module this long was pasted, generated
#: or grew unnoticed.  When to split is decided by cohesion (docs/architecture.md, "When to
#: split a module"), never to get under this number.
MAX_MODULE_LINES = 800

#: Modules longer by decision, each with its own ceiling (still an accident catcher).
#: engine/attempt.py: the attempt's protocol reads top to bottom in one place, with its fault
#: branches as collaborators after it (issue 63).
LONGER = {"engine/attempt.py": 1200}


def _too_big(source: str, name: str) -> list[str]:
    lines = source.count("\n")
    return [f"{name}: {lines} lines"] if lines > LONGER.get(name, MAX_MODULE_LINES) else []


def test_size_check_itself():
    assert _too_big("x = 1\n" * (MAX_MODULE_LINES + 1), "m") == [f"m: {MAX_MODULE_LINES + 1} lines"]
    assert _too_big("class C:\n" + "    x = 1\n" * 500, "m") == []
    assert _too_big("x = 1\n" * (MAX_MODULE_LINES + 1), "engine/attempt.py") == []
    assert _too_big("x = 1\n" * 1201, "engine/attempt.py") == ["engine/attempt.py: 1201 lines"]


def test_no_module_over_800_lines():
    found = [f for p in PACKAGE.rglob("*.py") for f in _too_big(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert found == []


#: The Architecture page (moved out of the README by issue 36).
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def test_architecture_tree_names_every_module():
    """The tree in docs/architecture.md is how a reader finds a room: a module missing from it
    (or a name left behind by a move) is a wrong map."""
    import re

    text = ARCHITECTURE.read_text()
    section = text[text.index("# Architecture"):]
    tree = section[section.index("```text"):section.index("```", section.index("```text") + 7)]
    named = set(re.findall(r"([a-z_]+\.py)", tree))
    modules = {p.name for p in _modules() if p.name != "__init__.py"}
    assert modules - named == set(), "modules missing from docs/architecture.md's tree"
    assert named - modules == set(), "docs/architecture.md's tree names modules that do not exist"


def _raw_links(source: str, name: str) -> list[str]:
    """Calls of ``.rawlink(...)`` in ``source``: kazoo re-runs earlier callbacks when one is
    added to a ready result, so every link goes through ``kazoo_compat.on_ready``."""
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rawlink"]


def test_raw_link_check_itself():
    assert _raw_links("r.rawlink(cb)\nx = 1\nclient.get_async(p).rawlink(\n  cb)\n", "m") == ["m:1", "m:3"]
    assert _raw_links("kazoo_compat.on_ready(r, cb)\n", "m") == []


def test_every_callback_on_a_kazoo_result_runs_once():
    """Only ``kazoo_compat.on_ready`` may call kazoo's ``rawlink`` (see its docstring)."""
    found = [f for p in PACKAGE.rglob("*.py") if p.name != "kazoo_compat.py"
             for f in _raw_links(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert found == []


#: The test suite: what a test module shares (fixtures, helpers) lives in a conftest.py or in a
#: helper module named for what it holds, never in another test module.
TESTS = PACKAGE.parent / "tests"


def _test_module_imports(source: str, name: str) -> list[str]:
    """Imports of a test module (``test_*``) in ``source``: ``tests.x.test_y``, ``.test_y``,
    ``from tests.x import test_y`` or ``import tests.test_y``, at any depth."""

    def is_test(module: str) -> bool:
        return module.rsplit(".", 1)[-1].startswith("test_")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            local = node.level > 0 or module == "tests" or module.startswith("tests.")
            if local and (is_test(module) or any(is_test(a.name) for a in node.names)):
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Import) and any(a.name.startswith("tests.") and is_test(a.name) for a in node.names):
            found.append(f"{name}:{node.lineno}")
    return found


def test_test_module_import_check_itself():
    bad = ("from tests.worker.test_cohort import Host\n", "from .test_cohort import Host\n",
           "from tests.worker import test_cohort\n", "import tests.test_cli as t\n",
           "def f():\n    from tests.test_examples import run\n")
    assert [_test_module_imports(src, "m") for src in bad] == [["m:1"], ["m:1"], ["m:1"], ["m:1"], ["m:2"]]
    good = "from tests.lockutil import children\nfrom tests.polling import wait_until\nimport pytest\n"
    assert _test_module_imports(good, "m") == []


def test_no_test_module_imports_another():
    """A test module reads as the specification of one behaviour: what it needs from elsewhere
    comes from a conftest.py (fixtures) or a helper module, so no test module leans on another's
    private helpers, and moving or deleting a test module breaks no other."""
    found = [f for p in sorted(TESTS.rglob("*.py"))
             for f in _test_module_imports(p.read_text(), str(p.relative_to(TESTS.parent)))]
    assert found == []
