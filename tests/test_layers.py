"""The package's layers (``[tool.importlinter]`` in ``pyproject.toml``), as ``make lint``
checks them: kept by the source as it is, broken by a planted cycle or an upward import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the copy of the package under ``root/src``."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "src" / "torq", root / "src" / "torq")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _plant(root: Path, module: str, line: str) -> None:
    path = root / "src" / Path(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_source_keeps_every_contract(tmp_path: Path) -> None:
    done = _lint(_copy(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout


def test_a_planted_cycle_breaks_the_contracts(tmp_path: Path) -> None:
    """``runs.config`` importing ``runs.checks`` (which imports it) is a cycle between
    siblings; ``formats`` importing the driver climbs the layers."""
    root = _copy(tmp_path)
    _plant(root, "torq.runs.config", "from torq.runs import checks  # noqa")
    done = _lint(root)
    assert done.returncode != 0
    assert "no import cycles between sibling modules at any depth BROKEN" in done.stdout
    assert "- .config -> .checks (1 import)" in done.stdout

    root = _copy(tmp_path / "up")
    _plant(root, "torq.formats.config", "import torq.driver  # noqa")
    done = _lint(root)
    assert done.returncode != 0
    assert "from the formats at the bottom to the command line at the top BROKEN" in done.stdout
    assert "torq.formats.config -> torq.driver" in done.stdout
