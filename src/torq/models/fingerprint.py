"""A model's logits fingerprint: its last-position logits on a fixed input, at 64 fixed
vocabulary entries. Thread counts and float rounding move them by far less than
:data:`FINGERPRINT_TOL`; another method, setting or calibration moves them by far more, so
a folder that keeps a model's results (a saved checkpoint, kept answers) names the model
by it and refuses another one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torq.errors import TorqError

FINGERPRINT_TOL = 0.05
FINGERPRINT_TEXT = "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5."


@torch.no_grad()
def logits_fingerprint(model: torch.nn.Module, input_ids: torch.Tensor) -> list[float]:
    """64 evenly spaced entries of the last-position logits of ``input_ids`` ([1, T])."""
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), use_cache=False).logits[0, -1]
    return fingerprint_of_logits(logits)


def fingerprint_of_logits(logits: torch.Tensor) -> list[float]:
    """The fingerprint of one position's logits ``[V]``: 64 evenly spaced entries."""
    logits = logits.float().cpu()
    picks = torch.linspace(0, logits.numel() - 1, 64).long()
    return [float(v) for v in logits[picks]]


def fingerprint_distance(stored: list[float], current: list[float]) -> float:
    """Largest difference between two fingerprints; infinite for another kind of model."""
    if len(stored) != len(current):
        return float("inf")
    return max((abs(a - b) for a, b in zip(stored, current, strict=True)), default=0.0)


def check_fingerprint(stored: list[float], current: list[float], where: Path | str) -> None:
    """Raise unless ``current`` is the model that wrote ``stored`` (within the tolerance)."""
    if len(stored) != len(current):
        raise TorqError(f"{where} was written by another kind of model; remove it")
    diff = fingerprint_distance(stored, current)
    if diff > FINGERPRINT_TOL:
        raise TorqError(
            f"{where} holds another model's results (its logits differ by {diff:.3g}); "
            "remove it or choose another resume directory"
        )


def fingerprint_ids(tokenizer: Any) -> torch.Tensor:
    """The fixed input of every logits fingerprint, as ``[1, T]`` token ids."""
    return tokenizer(FINGERPRINT_TEXT, return_tensors="pt")["input_ids"]
