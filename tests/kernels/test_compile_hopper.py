"""The kernels compile for Hopper (sm_90) on a machine without a GPU: Triton's interpreter
runs the kernels' Python, not its compiler, so a kernel can pass every interpreted test and
still not compile. Each pre-pass kernel, with the OCP and the nearest scale rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_the_prepass_kernels_compile_for_hopper(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_hopper"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(lines) == 12, done.stdout + done.stderr[-2000:]
    failed = [line for line in lines if not line.endswith(" ok")]
    assert not failed, failed
