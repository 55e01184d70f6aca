"""The package's layout: stages above the services they stand on, the support code beside them (nothing of the
pipeline imports it), no import circle, no module a reader cannot hold.

Imports are read from the source (every `import` and `from ... import`, at the top, inside functions and under
TYPE_CHECKING alike), so what this checks is what a reader sees, not what one run happens to load.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "dflash_train"
MAX_MODULE_LINES = 600


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a.b import c` is a.b.c where that is a module, else a.b)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dflash_train"):
                targets = [owner(f"{node.module}.{alias.name}") for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names if alias.name.startswith("dflash_train")]
            else:
                continue
            graph[name] |= {t for t in targets if t and t != name}
    return graph


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "stages" else None


def is_refresh(module: str) -> bool:
    """dflash_train.refresh: the orchestrator above the stages, which runs their commands round after round as the
    demo runs them (through dflash_train.support.runs)."""
    return module.split(".")[:2] == ["dflash_train", "refresh"]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_services_never_import_a_stage():
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if stage_of(t) and not stage_of(m) and m not in ("dflash_train.cli", "dflash_train.stages")
                   and not is_refresh(m))
    assert not wrong, "a service imports a stage:\n" + "\n".join(wrong)


def test_a_stage_stands_on_services_not_on_another_stage():
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if stage_of(m) and stage_of(t) and stage_of(m) != stage_of(t))
    assert not wrong, "a stage imports another stage:\n" + "\n".join(wrong)


def test_no_stage_or_service_imports_the_support_code():
    """dflash_train.support (the scripts', tests', benchmarks' and probes' helpers) stands beside the pipeline: only
    its own modules import it, and refresh, which runs the stages' commands through it as the demo does."""
    def support(module: str) -> bool:
        return module == "dflash_train.support" or module.startswith("dflash_train.support.")

    graph = import_graph()
    assert any(support(m) for m in graph)
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if support(t) and not support(m) and not is_refresh(m))
    assert not wrong, "the pipeline imports dflash_train.support:\n" + "\n".join(wrong)


def test_the_speculators_stand_below_the_engine_and_the_stages():
    """dflash_train.spec_decode (the loop, prompt lookup, the suffix tree, the combined speculator's vLLM plugin) is
    what the engine and the stages run: it imports neither, so the dependency goes one way."""
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if m.startswith("dflash_train.spec_decode") and (t.startswith("dflash_train.engine") or stage_of(t)))
    assert not wrong, "a speculator imports the engine or a stage:\n" + "\n".join(wrong)


def test_no_import_circle_between_modules():
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_model_and_target_lean_one_way():
    graph = import_graph()
    model_to_target = sorted(m for m in graph if m.startswith("dflash_train.model") and "dflash_train.target" in graph[m])
    target_to_model = sorted(t for t in graph["dflash_train.target"] if t.startswith("dflash_train.model"))
    assert not (model_to_target and target_to_model), (model_to_target, target_to_model)
