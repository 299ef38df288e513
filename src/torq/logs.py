"""What torq lets other libraries print: their errors, not their notes.

Used by the ``torq`` command and by the benchmark scripts (``benchmarks/common.py``), so
that a run's log holds torq's lines and real problems only."""

from __future__ import annotations

import logging

# libraries' messages that are not the user's business: torchao's optional GPU extensions
# that a CPU machine cannot load, torch's notes to library authors (both printed by every
# run, in a fresh process, once torchao is imported)
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_libraries() -> None:
    """Show only errors from the loggers of :data:`QUIET_LOGGERS`. Call it before the
    libraries are imported: their notes come at import time."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
