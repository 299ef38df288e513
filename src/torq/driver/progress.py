"""Where a streamed run keeps its progress between layers (:class:`LayerProgress`): a run
stopped after layer ``l`` continues from layer ``l + 1`` with the same numbers bit for bit,
since a 70B model's calibration takes hours and a stop should not cost them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from torq.errors import TorqError

# how often a streamed run's progress is written (seconds; each write is every window's
# hidden states, so not after every layer of a small model)
PROGRESS_EVERY_S = 60.0


class LayerProgress:
    """Where a streamed run keeps its progress between layers (module doc): one file in
    ``folder``, ``layers-<identity>.pt``, named after everything that makes the run's
    numbers (the plan's settings, the windows' tokens, the layer count, how the states are
    held), so a state is only ever taken up by the same run. Written at most every
    ``every`` seconds (after the layer that passes it) and after the last layer, each time
    to a new file that replaces the old one whole (a stop while writing leaves the previous
    state); removed when the run is done. It holds the hidden states of every window, in
    float32 (the 8B shape with 8 calibration and 2 evaluation windows: 0.34 GB)."""

    def __init__(self, folder: str | Path, every: float | None = None) -> None:
        self.folder = Path(folder)
        self.every = PROGRESS_EVERY_S if every is None else every
        self.file: Path | None = None
        self._last = -float("inf")

    def bind(self, identity: dict[str, Any]) -> None:
        """Name the state file after the run's ``identity`` (JSON-able)."""
        text = json.dumps(identity, sort_keys=True, default=str)
        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        self.file = self.folder / f"layers-{digest}.pt"
        self._last = time.perf_counter()

    def load(self) -> dict[str, Any] | None:
        """The state a stopped run left (``None``: none; start from layer 0)."""
        assert self.file is not None, "bind the progress to a run first"
        if not self.file.is_file():
            return None
        try:
            return torch.load(self.file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a file we cannot read is not a state to continue from
            raise TorqError(
                f"{self.file}: cannot read the saved layer progress ({exc}); remove it to "
                "start again from the first layer"
            ) from None

    def due(self, last_layer: bool) -> bool:
        return last_layer or time.perf_counter() - self._last >= self.every

    def save(self, state: dict[str, Any]) -> None:
        assert self.file is not None, "bind the progress to a run first"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_name(self.file.name + ".partial")
        torch.save(state, tmp)
        os.replace(tmp, self.file)
        self._last = time.perf_counter()

    def clear(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
