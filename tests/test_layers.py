"""The layers hold: the library core imports nothing from the example job, the commands, Lightning, the benchmarks or
the tests, and needs only torch, numpy and zstandard; benchmarks and tests share the harness through a package module
(``fgdiloco.testing``), never each other. A small AST scan of every import statement."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the library core: what ``pip install fgdiloco`` is for
CORE = ("fgdiloco/__init__.py", "fgdiloco/config.py", "fgdiloco/runtime.py", "fgdiloco/mesh.py",
        "fgdiloco/testing.py", "fgdiloco/factor", "fgdiloco/gossip", "fgdiloco/outer", "fgdiloco/elastic",
        "fgdiloco/pipeline")
#: third-party packages the core may import (its install requirements) and the standard library
CORE_THIRD_PARTY = {"torch", "numpy", "zstandard"}
#: the applications on top of the core: the example job and the console commands
APP = ("fgdiloco/pretrain", "fgdiloco/cli.py", "fgdiloco/simulate.py", "fgdiloco/__main__.py")


def _files(prefixes: tuple[str, ...]) -> list[Path]:
    out = []
    for prefix in prefixes:
        p = ROOT / prefix
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement of ``path`` names (relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return out


def _violations(prefixes: tuple[str, ...], allowed: callable) -> list[str]:
    bad = []
    for path in _files(prefixes):
        for line, mod in _imports(path):
            if not allowed(mod):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def _in(mod: str, prefixes: tuple[str, ...]) -> bool:
    names = [p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in prefixes]
    return any(mod == n or mod.startswith(n + ".") for n in names)


def _stdlib(mod: str) -> bool:
    return mod.split(".")[0] in sys.stdlib_module_names or mod == "__future__"


def test_the_core_imports_only_the_core_and_its_requirements():
    def allowed(mod: str) -> bool:
        top = mod.split(".")[0]
        return _stdlib(mod) or top in CORE_THIRD_PARTY or _in(mod, CORE)

    assert _violations(CORE, allowed) == []


def test_lightning_integration_imports_only_the_core():
    def allowed(mod: str) -> bool:
        top = mod.split(".")[0]
        return (_stdlib(mod) or top in CORE_THIRD_PARTY | {"pytorch_lightning", "lightning", "packaging"}
                or _in(mod, CORE) or mod.startswith("lightning_callbacks"))

    assert _violations(("lightning_callbacks",), allowed) == []


def test_the_applications_import_no_benchmark_test_or_lightning_code():
    def allowed(mod: str) -> bool:
        return mod.split(".")[0] not in ("benchmarks", "tests", "lightning_callbacks")

    assert _violations(APP, allowed) == []


def test_benchmarks_and_tests_never_import_each_other():
    assert _violations(("benchmarks",), lambda mod: mod.split(".")[0] != "tests") == []
    assert _violations(("tests",), lambda mod: mod.split(".")[0] != "benchmarks") == []


@pytest.mark.slow
def test_the_core_imports_and_runs_without_the_extras():
    """``import fgdiloco`` and one round of the wrapper work with Lightning, tokenizers, matplotlib, rich and
    torchft unimportable (the extras of ``pip install fgdiloco[...]``)."""
    code = (
        "import sys\n"
        "for name in ('pytorch_lightning', 'lightning', 'tokenizers', 'matplotlib', 'rich', 'torchft'):\n"
        "    sys.modules[name] = None\n"
        "import torch, fgdiloco\n"
        "model = torch.nn.Linear(3, 2)\n"
        "opt = fgdiloco.FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1)\n"
        "model(torch.ones(4, 3)).sum().backward(); opt.step()\n"
        "assert opt.round == 1\n"
        "opt.close(); print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_every_thread_starts_in_the_runtime():
    """``fgdiloco.runtime`` owns the threads (``Background``, ``Service``): no other module of the package or the
    Lightning integration builds a ``threading.Thread``."""
    bad = []
    for path in _files(("fgdiloco", "lightning_callbacks")):
        if path.relative_to(ROOT).as_posix() == "fgdiloco/runtime.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "Thread":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def test_the_example_job_has_no_import_cycle():
    """``fgdiloco.pretrain``'s modules import each other without a cycle (imports inside functions included)."""
    mods = {_module_of(p): p for p in _files(("fgdiloco/pretrain",))}
    graph = {m: {i for _, i in _imports(p) if i in mods and i != m and i != "fgdiloco.pretrain"}
             for m, p in mods.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_no_function_of_the_package_is_longer_than_80_lines():
    """The size limit beside ruff's complexity limit (C901, max 15): a function of ``fgdiloco/`` or
    ``lightning_callbacks/`` (docstring included) fits in 80 lines."""
    long = []
    for path in _files(("fgdiloco", "lightning_callbacks")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
