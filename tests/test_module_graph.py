"""kvcore's folders draw its pipeline, and imports only point down it.

specs -> memory -> plugins (negotiation; distributed agreement) -> runtime ->
integrations (hf, transfer) -> apps (cli, model_files, testing). A module may
import its own stage or any stage below, never one above, including imports
inside functions. The distributions built on kvcore (kvcore_bench, the plugins)
import it; kvcore never imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvcore"

STAGES = [
    {"_validate", "errors", "_units", "_table", "settings"},
    {"specs"},
    {"memory"},
    {"plugins", "distributed"},
    {"runtime", "model_runner"},
    {"hf", "transfer"},
    {"cli", "model_files", "testing", "__init__", "__main__"},
]


def _stage(module: str) -> int:
    """Stage of ``kvcore.<part>...`` (the package root counts as the top)."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if not (ROOT / head).is_dir() and not (ROOT / f"{head}.py").exists():
        head = "__init__"  # ``from kvcore import Name``: the package root re-exports every stage
    for rank, names in enumerate(STAGES):
        if head in names:
            return rank
    raise AssertionError(f"module {module} is in no stage; add it to STAGES in this test")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts)


def _kvcore_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvcore"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvcore":
                found += [(node.lineno, f"kvcore.{a.name}") for a in node.names]
            elif node.module.startswith("kvcore."):
                found.append((node.lineno, node.module))
    return found


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_pipeline(path: Path) -> None:
    module = _module_of(path)
    rank = _stage(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    upward = [
        f"line {line}: {target} (stage {_stage(target)})"
        for line, target in _kvcore_imports(tree)
        if _stage(target) > rank
    ]
    assert not upward, f"{module} (stage {rank}) imports upward: {upward}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_never_imports_a_distribution_built_on_it(path: Path) -> None:
    """kvcore_bench, kvcore_torch, kvcore_triton, ...: they find kvcore through entry points."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    upward = [f"line {line}: {name}" for line, name in found if name.startswith("kvcore_")]
    assert not upward, f"{_module_of(path)} imports a distribution built on kvcore: {upward}"


def test_every_kvcore_folder_and_module_has_a_stage() -> None:
    heads = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.iterdir()
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    staged = set().union(*STAGES)
    assert heads <= staged, f"not in any stage: {sorted(heads - staged)}"
