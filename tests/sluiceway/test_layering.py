"""The dependency direction: no package imports a higher one, by import statement or by string.

``gateway -> producers <- worker -> engine -> sluiceway_kernels``; ``bench`` may use all of them and
``sluiceway`` (the command) names them all, but none of them names ``bench`` or
``sluiceway``, the engine names neither the worker nor the producers, the producers
never name the worker, and the gateway names neither the worker nor the engine.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "sluiceway_kernels": {"engine", "worker", "producers", "gateway", "bench", "sluiceway"},
    "engine": {"worker", "producers", "gateway", "bench", "sluiceway"},
    "producers": {"worker", "gateway", "bench", "sluiceway"},
    "worker": {"gateway", "bench", "sluiceway"},
    "gateway": {"worker", "engine", "bench", "sluiceway"},
}
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_]*)?")


def is_module(dotted: str) -> bool:
    """``dotted`` (``pkg.mod`` or ``pkg.mod:attr``) names a module of this repository."""
    path = ROOT.joinpath(*dotted.partition(":")[0].split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_references(path: Path, forbidden: set[str]) -> list[str]:
    """``line: what`` for each import of, or module path string into, a forbidden package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            names = [node.value] if is_module(node.value) else []
        found += [f"{node.lineno}: {name}" for name in names if name.split(".")[0].split(":")[0] in forbidden]
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_names_a_higher_one(package):
    bad = {str(path.relative_to(ROOT)): refs for path in sorted((ROOT / package).rglob("*.py"))
           if (refs := upward_references(path, FORBIDDEN[package]))}
    assert not bad, f"{package} reaches up to {sorted(FORBIDDEN[package])}: {bad}"


def test_the_check_sees_an_import_hidden_in_a_string(tmp_path):
    source = tmp_path / "cli.py"
    source.write_text('import json\nCOMMANDS = {"worker": ("worker.cli", "worker_command")}\n'
                      'event = "worker.started"\nfrom bench.run import StepLog\n')
    assert sorted(upward_references(source, {"worker", "bench"})) == ["2: worker.cli", "4: bench.run"]


def test_the_packages_import_without_the_bench_and_the_bench_imports_them_all():
    code = (
        "import importlib, pkgutil, sys\n"
        "import engine, engine.llm, engine.llm_engine, engine.observer, kernels, producers, producers.cli,"
        " producers.client, producers.bulk, worker, worker.cli, worker.demo, worker.loop, gateway, gateway.app,"
        " gateway.cli\n"
        "above = sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'sluiceway'))\n"
        "assert not above, above\n"
        "for package in ('bench', 'sluiceway'):\n"
        "    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + '.'):\n"
        "        importlib.import_module(module.name)\n"
        "import bench, engine, worker, producers, sluiceway\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
