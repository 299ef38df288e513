"""Random draws that depend only on what they draw, never on what ran before.

A method's result must not depend on the other methods of a run (their order, or whether
they ran at all). Every random draw in torq therefore comes from its own
``torch.Generator``, seeded from a seed of the run and a stable identity of the draw:

* calibration windows: ``--calib-seed`` (:func:`torq.calibration.data.calibration_windows`);
  every method with the same calibration settings sees the same windows;
* the token reservoir of each input group: ``--calib-seed``, the layer and the group
  (:class:`torq.calibration.capture.BlockStatistics`);
* the intra-block solver's row subsample (``--intra-samples``): ``--calib-seed``;
* QuaRot's random Hadamard signs: ``--seed`` (:func:`torq.surgery.fusion.random_hadamard`);
* the seeded subsets of an evaluation (zero-shot questions, GSM8K problems, perplexity
  windows): their own seed (:func:`seeded_subset_ids`).

As a second line of defence, :func:`method_rng` gives each method's run its own global
random state, derived from ``--seed`` and the method's settings key, so a draw that
reaches the global generator (in torq or a library it calls) is reproducible as well.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch


def derive_seed(seed: int, identity: str) -> int:
    """A 63-bit seed from a run's ``seed`` and the ``identity`` of what is drawn."""
    digest = hashlib.sha256(f"{int(seed)}\x00{identity}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_subset_ids(total: int, n: int, seed: int) -> list[int]:
    """``n`` of the indices ``0..total-1`` drawn with ``seed``, sorted (all of them when
    ``n ≥ total``): the first ``n`` of ``torch.randperm(total, seed)``. The same draw for
    every method, so two rows on one subset compare item by item."""
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    return sorted(order[:n].tolist())


@contextlib.contextmanager
def method_rng(seed: int, identity: str) -> Iterator[None]:
    """Run the block with the global (CPU and CUDA) random state seeded from ``seed`` and
    ``identity``, and restore the state it found afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(seed, identity))
        yield
