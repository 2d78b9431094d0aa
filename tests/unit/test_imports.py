"""The package's import graph has no cycle: every import of one convt3d module by another (at
module level or inside a function) is read from the source with ``ast``, and the graph is
searched for a cycle. A cycle is what made the dispatcher, the autograd wrappers and the backward
import each other; the layering is call/params/validate -> engines -> dispatch -> functional."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import requires_interpreter

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "convt3d"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                # ``from pkg import sub`` imports the submodule; ``from mod import attr`` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    # A package imports its submodules; a submodule importing its package back is the cycle this
    # test exists for, so the package node is kept.
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph,cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
], ids=["chain", "two-cycle", "three-cycle", "diamond"])
def test_the_cycle_finder(graph, cyclic):
    assert (find_cycle(graph) is not None) is cyclic


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # patch imports Triton's warm-up on first use only (inside the function).
    assert "convt3d.engines.triton.warm_up" in graph["convt3d.nn"]


# ---- the trip of one call through the package -------------------------------------------------------
def _entries(fn, modules: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """How often control enters each named group of modules from outside the group while ``fn``
    runs (a call event whose callee is in the group and whose caller is not)."""
    import sys

    files = {name: {sys.modules[m].__file__ for m in group} for name, group in modules.items()}
    counts = {name: 0 for name in modules}

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else None
        for name, fs in files.items():
            if callee in fs and caller not in fs:
                counts[name] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


@pytest.mark.parametrize("backend", ["auto", "torch", pytest.param("triton", marks=requires_interpreter)])
def test_a_steady_call_enters_the_dispatcher_once_and_its_engine_once(backend, auto_state):
    import torch

    import convt3d
    import convt3d.dispatch.select
    import convt3d.engines.triton.engine

    layer = convt3d.ConvTranspose3d(2, 1, 2, stride=2)
    layer.backend = backend
    x = torch.randn(1, 2, 2, 2, 2)
    layer(x)  # the first call decides
    import convt3d.engines.triton.head

    # The Triton engine is its launcher and the output-head launcher it hands head tiles to.
    groups = {"dispatcher": ("convt3d.dispatch.select",),
              "engines": ("convt3d.engines.base", "convt3d.engines.torch.peer", "convt3d.engines.triton.peer"),
              "triton engine": ("convt3d.engines.triton.engine", "convt3d.engines.triton.head")}
    counts = _entries(lambda: layer(x), groups)
    assert counts == {"dispatcher": 1, "engines": 1, "triton engine": 1 if backend == "triton" else 0}, counts


def test_every_memo_is_named_in_one_registry_that_forgets_them_all():
    import convt3d  # noqa: F401 -- imports every module that makes a memo
    from convt3d.core import memo
    from convt3d.dispatch import select as dispatch
    from convt3d.engines.triton import engine

    names = set(memo._memos)
    assert {"dispatch.select.settled", "engines.triton.engine.plans", "core.validate.valid"} <= names
    dispatch._settled["probe"] = "decision"
    engine._plans["probe"] = "plan"
    memo.clear_all()
    assert "probe" not in dispatch._settled and "probe" not in engine._plans
