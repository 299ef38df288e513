"""No script folder may hold a module named like a library: running ``python
benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``, so a ``benchmarks/kernels.py``
is what ``import kernels`` finds, for transformers too (it imports the ``kernels``
distribution when it loads)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _library_names() -> set[str]:
    """The top-level names Python can import here besides the repository's own: the
    standard library's and those of every installed distribution."""
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    names |= set(importlib.metadata.packages_distributions())
    return names - {"torq"}


def _script_folders(root: Path) -> list[Path]:
    """The folders a run puts first on ``sys.path``: the repository's root (pytest puts
    the folder above the test package there) and each folder under ``benchmarks/`` and
    ``tests/`` that holds a script and is not itself a package (a package's modules are
    imported by their dotted names)."""
    tops = [root / "benchmarks", root / "tests"]
    folders = {p.parent for top in tops for p in top.rglob("*.py")}
    return [root, *sorted(f for f in folders if not (f / "__init__.py").is_file())]


def shadowing_modules(root: Path) -> list[str]:
    """The modules and packages under ``root``'s script folders that take the name of an
    importable library, as paths relative to ``root``."""
    libraries = _library_names()
    found = []
    for folder in _script_folders(root):
        for entry in sorted(folder.iterdir()):
            name = entry.stem if entry.suffix == ".py" else entry.name
            is_module = entry.suffix == ".py" or (entry.is_dir() and any(entry.glob("*.py")))
            if is_module and name in libraries:
                found.append(str(entry.relative_to(root)))
    return found


def test_no_script_module_takes_a_library_name() -> None:
    assert shadowing_modules(ROOT) == []


def test_a_planted_library_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "peers").mkdir(parents=True)
    (tmp_path / "tests" / "json").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("")  # tests/ not a package: a script folder
    (tmp_path / "benchmarks" / "kernels.py").write_text("")
    (tmp_path / "benchmarks" / "peers" / "numpy.py").write_text("")
    (tmp_path / "benchmarks" / "speed.py").write_text("")
    (tmp_path / "tests" / "json" / "test_x.py").write_text("")
    found = shadowing_modules(tmp_path)
    assert "benchmarks/peers/numpy.py" in found and "tests/json" in found
    assert "benchmarks/speed.py" not in found
    if "kernels" in importlib.metadata.packages_distributions():
        assert "benchmarks/kernels.py" in found


def test_the_benchmarks_run_as_modules_of_a_package() -> None:
    """torq's own benchmarks are the ``benchmarks`` package, run as ``python -m
    benchmarks.NAME``; no script (the peers' included, which import their checkouts through
    ``import_from_checkout``) puts a folder on the import path."""
    scripts = list((ROOT / "benchmarks").rglob("*.py"))
    assert (ROOT / "benchmarks" / "__init__.py").is_file()
    assert [str(p.relative_to(ROOT)) for p in scripts if "sys.path" in p.read_text()] == []


def test_the_benchmarks_import_torq_and_torq_experimental_only() -> None:
    """The scripts read torq through its public API (``torq``) and the one module of research
    building blocks (:mod:`torq.experimental`), never a module of the package's own
    layout, so that the layout can change without them."""
    import ast

    stray = []
    for path in (ROOT / "benchmarks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("torq.") and name != "torq.experimental":
                    stray.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert stray == []
