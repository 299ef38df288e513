"""Where the layer-streaming driver keeps the hidden states of every window between layers.

The driver moves the hidden states of all calibration (and evaluation) windows through one
layer at a time, so they are held whole: ``n · T · d`` values (128 windows of 2048 tokens
of an 8B model: 4.3 GB in float32, twice while a layer turns its inputs into its outputs).
:class:`HiddenStates` holds them one of three ways:

* ``"memory"``: float32 tensors, as the layers compute (the default: exact);
* ``"bfloat16"``: stored in bf16, turned back to float32 one batch at a time as a layer
  reads it (half the memory; rounds the states between layers, so the numbers move);
* ``"disk"``: float32 in files of a temporary folder, memory-mapped and read back one
  batch at a time (exact, the memory of one batch; the page cache does the rest).

Each is a sequence of batches: ``store[i]`` and iteration give float32 tensors on the
store's device, :meth:`append` takes a layer's output batch, and :meth:`empty_like` gives
the store for the next layer's states.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

HIDDEN_MODES = ("memory", "bfloat16", "disk")
_NAMES = itertools.count()  # file names unique within the process


class HiddenStates:
    """The hidden states of a set of windows, one tensor per batch (module doc)."""

    def __init__(self, mode: str = "memory", folder: Path | None = None) -> None:
        if mode not in HIDDEN_MODES:
            raise ValueError(f"hidden states are kept in {', '.join(HIDDEN_MODES)}, not {mode!r}")
        self.mode = mode
        self._items: list[torch.Tensor] = []
        self._own_folder = False
        self.folder = folder
        if mode == "disk" and folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="torq-hidden-"))
            self._own_folder = True
        self._files: list[Path] = []
        self._devices: list[torch.device] = []

    def append(self, batch: torch.Tensor) -> None:
        if self.mode == "memory":
            self._items.append(batch)
        elif self.mode == "bfloat16":
            self._items.append(batch.to(torch.bfloat16))
        else:
            assert self.folder is not None
            file = self.folder / f"{next(_NAMES)}.pt"
            torch.save(batch.detach().to("cpu", torch.float32).contiguous(), file)
            self._files.append(file)
            self._devices.append(batch.device)

    def __len__(self) -> int:
        return len(self._files) if self.mode == "disk" else len(self._items)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.mode == "memory":
            return self._items[index]
        if self.mode == "bfloat16":
            return self._items[index].to(torch.float32)
        t = torch.load(self._files[index], mmap=True, weights_only=True)
        return t.to(self._devices[index])

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self[i]

    def batches(self) -> list[torch.Tensor]:
        """The batches as stored (``"bfloat16"``: in bf16; ``"disk"``: memory-mapped
        float32), for copying them elsewhere without a float32 copy of all at once;
        :meth:`append` takes them back exactly."""
        if self.mode == "disk":
            return [torch.load(f, mmap=True, weights_only=True) for f in self._files]
        return list(self._items)

    def empty_like(self) -> HiddenStates:
        """An empty store of the same kind (the disk store writes in the same folder)."""
        return HiddenStates(self.mode, self.folder)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (``"disk"``: none; the files are on disk)."""
        return sum(t.numel() * t.element_size() for t in self._items)

    @property
    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self._files if f.exists())

    def release(self) -> None:
        """Free the batches (and their files)."""
        self._items = []
        for f in self._files:
            f.unlink(missing_ok=True)
        self._files, self._devices = [], []

    def close(self) -> None:
        """:meth:`release`, and remove the folder this store made."""
        self.release()
        if self._own_folder and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
