"""The package's import graph keeps its layering (docs/design.md, "Layout"): every import of
``aligner`` goes downwards or sideways within a package, never up, and no module takes another
module's private names. Function-level imports count as much as top-level ones.

Layers, lowest first:

0. the base: ``aligner.rl`` (the RL maths) and the top-level utilities (checkpoint files,
   distributed set-up and collectives, tokenizers, metrics, the built-in tasks);
1. ``aligner.models``: Megatron GPT builders, layouts, HF conversion;
2. ``aligner.precision``: mixed-precision training of those models;
3. ``aligner.generation``: the engines;
4. ``aligner.ppo`` (the actor) and ``aligner.critic`` (the server), side by side: the actor
   reaches the server only through the wire protocol and the critic-handle protocol, and the
   server imports nothing of the actor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "aligner"

LAYERS = {
    "aligner.models": 1,
    "aligner.precision": 2,
    "aligner.generation": 3,
    "aligner.ppo": 4,
    "aligner.critic": 4,
}
# What the actor may import of the server's package: the contracts, never the implementation.
ACTOR_MAY_IMPORT_FROM_CRITIC = ("aligner.critic.protocol", "aligner.critic.handle")


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


def aligner_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import of aligner in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "aligner"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "aligner":
                continue
            names = [a.name for a in node.names]
            if node.module == "aligner":  # `from aligner import rl`: each name is a module
                out += [(f"aligner.{n}", [], node.lineno) for n in names]
            else:
                out.append((node.module, names, node.lineno))
    return out


def classify(importer: str, imported: str) -> str | None:
    """What is wrong with module ``importer`` importing module ``imported``, or None."""
    if package(imported) == package(importer):
        return None
    if layer(imported) > layer(importer):
        return "upwards"
    if layer(imported) == layer(importer) == 4:
        actor_to_contract = importer.startswith("aligner.ppo") and imported.startswith(
            ACTOR_MAY_IMPORT_FROM_CRITIC
        )
        if not actor_to_contract:
            return "between"
    return None


def violations() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        for mod, names, line in aligner_imports(path):
            where = f"{path.relative_to(ROOT.parent)}:{line}: {me} imports {mod}"
            wrong = classify(me, mod)
            if wrong == "upwards":
                found.append(f"{where}: upwards (layer {layer(me)} -> {layer(mod)})")
            elif wrong == "between":
                found.append(f"{where}: between the two roles' packages")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and mod != me:
                found.append(f"{where}: private names {private}")
    return found


def test_no_import_runs_against_the_layering():
    bad = violations()
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    "importer, imported, expected",
    [
        ("aligner.models.fused", "aligner.generation.lean", "upwards"),
        ("aligner.rl.losses", "aligner.models.gpt", "upwards"),
        ("aligner.checkpoint", "aligner.precision", "upwards"),
        ("aligner.critic.service", "aligner.ppo.trainer", "between"),
        ("aligner.ppo.trainer", "aligner.critic.service", "between"),
        ("aligner.ppo.trainer", "aligner.critic.protocol", None),
        ("aligner.ppo.trainer", "aligner.critic.handle", None),
        ("aligner.generation.native", "aligner.models.gpt", None),
        ("aligner.models.fused", "aligner.models.gpt", None),
        ("aligner.critic.service", "aligner.rl", None),
    ],
)
def test_the_rules_catch_what_they_should(importer, imported, expected):
    assert classify(importer, imported) == expected
