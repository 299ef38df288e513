"""``benchmarks/common.py``: what every benchmark script shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_benchmark_log_shows_no_library_noise() -> None:
    """A script that imports ``common`` is as quiet as the ``torq`` command: torchao's note
    that its GPU extensions do not load and torch's advice to library authors (printed
    when torchao is imported, which a benchmark does while it runs) stay out of its log,
    while the libraries' errors still show."""
    code = (
        "import logging\nimport benchmarks.common\nimport torchao\n"
        "assert logging.getLogger('torchao').getEffectiveLevel() == logging.ERROR\n"
        "assert logging.getLogger('torch.utils._pytree').getEffectiveLevel() == logging.ERROR\n"
        "print('imported')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported"
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr
