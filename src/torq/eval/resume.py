"""Evaluations that survive being stopped: what a long evaluation has measured is kept on
disk as it goes, and the same call again measures only the rest.

A resume directory belongs to one (quantized) model. Its identity is a *logits
fingerprint*: the model's last-position logits on a fixed input, at 64 fixed vocabulary
entries. Thread counts and float rounding move them by far less than
:data:`FINGERPRINT_TOL`; another method, setting or calibration moves them by far more, and
such a directory is refused instead of mixing two models' numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from torq.errors import TorqError

FINGERPRINT_TOL = 0.05


@torch.no_grad()
def logits_fingerprint(model: torch.nn.Module, input_ids: torch.Tensor) -> list[float]:
    """64 evenly spaced entries of the last-position logits of ``input_ids`` ([1, T])."""
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), use_cache=False).logits[0, -1]
    logits = logits.float().cpu()
    picks = torch.linspace(0, logits.numel() - 1, 64).long()
    return [float(v) for v in logits[picks]]


def check_fingerprint(stored: list[float], current: list[float], where: Path) -> None:
    """Raise unless ``current`` is the model that wrote ``stored`` (within the tolerance)."""
    if len(stored) != len(current):
        raise TorqError(f"{where} was written by another kind of model; remove it")
    diff = max(abs(a - b) for a, b in zip(stored, current, strict=True))
    if diff > FINGERPRINT_TOL:
        raise TorqError(
            f"{where} holds another model's results (its logits differ by {diff:.3g}); "
            "remove it or choose another resume directory"
        )


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON so that a reader (or a stop) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
