"""The package's import graph keeps its layering (docs/design.md, "Layout"): every import of
``aligner`` goes downwards or sideways within a package, never up; the two roles stand side by
side and never import each other; no package's modules import each other in a circle; no module
takes another module's private names; the wire contract never imports torch. Function-level
imports count as much as top-level ones.

Layers, lowest first:

0. the base: ``aligner.rl`` (the RL maths), ``aligner.wire`` (the contract between the roles and
   the client; it imports nothing of aligner outside itself) and the top-level utilities
   (checkpoint files, distributed set-up and collectives, tokenizers, metrics, config checks,
   fault points, the built-in tasks);
1. ``aligner.models``: Megatron GPT builders, forwards, layouts, HF conversion;
2. ``aligner.precision``: mixed-precision training of those models;
3. ``aligner.generation``: the engines;
4. ``aligner.actor`` and ``aligner.critic`` (the server), side by side: each reaches the other
   only through ``aligner.wire``;
5. ``aligner.gpu_check``: the GPU check, which composes both roles in one process,
   ``aligner.node``: both roles' processes on one node (``aligner-launch``), and
   ``aligner.rollout``: the rollout worker role, made of the actor's generation parts.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "aligner"

LAYERS = {
    "aligner.models": 1,
    "aligner.precision": 2,
    "aligner.generation": 3,
    "aligner.actor": 4,
    "aligner.critic": 4,
    "aligner.gpu_check": 5,
    "aligner.node": 5,
    "aligner.rollout": 5,
}
ROLES = ("aligner.actor", "aligner.critic")
WIRE = "aligner.wire"


def layer(module: str) -> int:
    for prefix, n in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return n
    return 0


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module an import names: ``aligner.x.y`` itself, or the module ``y`` is taken from."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every absolute import in ``path``
    (any package); ``from aligner.x import y`` with ``y`` a module counts as importing ``y``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{node.module}.{n}" in MODULES]
            out += [(f"{node.module}.{n}", [], node.lineno) for n in submodules]
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                out.append((node.module, rest, node.lineno))
    return out


def aligner_imports(path: Path) -> list[tuple[str, list[str], int]]:
    return [(resolve(m), names, line) for m, names, line in imports(path) if m.split(".")[0] == "aligner"]


def classify(importer: str, imported: str) -> str | None:
    """What is wrong with module ``importer`` importing module ``imported``, or None."""
    if package(imported) == package(importer):
        return None
    if package(importer) == WIRE:
        return "out of the wire contract"
    if layer(imported) > layer(importer):
        return "upwards"
    if package(importer) in ROLES and package(imported) in ROLES:
        return "between the two roles' packages"
    return None


def violations() -> list[str]:
    found = []
    for me, path in MODULES.items():
        for mod, names, line in aligner_imports(path):
            where = f"{path.relative_to(ROOT.parent)}:{line}: {me} imports {mod}"
            wrong = classify(me, mod)
            if wrong is not None:
                found.append(
                    f"{where}: {wrong}"
                    + (f" (layer {layer(me)} -> {layer(mod)})" if wrong == "upwards" else "")
                )
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and mod != me:
                found.append(f"{where}: private names {private}")
    return found


def test_no_import_runs_against_the_layering():
    bad = violations()
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def module_graph() -> dict[str, set[str]]:
    """Each module's imports of other modules of its own package (a package's ``__init__`` is left
    out: it only lists its modules)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for me, path in MODULES.items():
        if me == package(me):
            continue
        for mod, _, _ in aligner_imports(path):
            if mod != me and package(mod) == package(me) and mod != package(me):
                edges[me].add(mod)
    return edges


def test_no_package_has_modules_that_import_each_other_in_a_circle():
    found = circles(module_graph())
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_the_packages_import_each_other_without_circles():
    edges: dict[str, set[str]] = defaultdict(set)
    for me, path in MODULES.items():
        for mod, _, _ in aligner_imports(path):
            if package(mod) != package(me):
                edges[package(me)].add(package(mod))
    assert not circles(edges)


def test_the_wire_contract_never_imports_torch():
    """Neither in its source (at any level) nor through what it imports: a client process, a
    readiness probe, the recipes' wait need no torch."""
    wire = [(me, p) for me, p in MODULES.items() if package(me) == WIRE]
    direct = [
        f"{me}:{line}: {mod}" for me, p in wire for mod, _, line in imports(p) if mod.split(".")[0] == "torch"
    ]
    assert not direct, direct
    probe = "; ".join(f"import {me}" for me, _ in wire) + "; import sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize(
    "importer, imported, expected",
    [
        ("aligner.models.fused", "aligner.generation.decoder", "upwards"),
        ("aligner.rl.losses", "aligner.models.gpt", "upwards"),
        ("aligner.checkpoint", "aligner.precision", "upwards"),
        ("aligner.critic.service", "aligner.actor.trainer", "between the two roles' packages"),
        ("aligner.actor.trainer", "aligner.critic.service", "between the two roles' packages"),
        ("aligner.actor.trainer", "aligner.critic.errors", "between the two roles' packages"),
        ("aligner.actor.trainer", "aligner.wire.protocol", None),
        ("aligner.critic.service", "aligner.wire.protocol", None),
        ("aligner.wire.client", "aligner.critic.launch", "out of the wire contract"),
        ("aligner.wire.client", "aligner.distributed", "out of the wire contract"),
        ("aligner.generation.native", "aligner.models.gpt", None),
        ("aligner.models.fused", "aligner.models.gpt", None),
        ("aligner.critic.service", "aligner.rl", None),
    ],
)
def test_the_rules_catch_what_they_should(importer, imported, expected):
    assert classify(importer, imported) == expected


def test_the_circle_finder_finds_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(edges) == [["a", "b", "c"]]
