"""Calibration windows: ``n`` token windows drawn with a fixed seed from a local corpus.

As in GPTQ/QuaRot/TORQ, each window starts at a uniformly random token offset of the
tokenized corpus (method-notes §3: 128 × 2048 tokens by default; the paper uses WikiText-2
train, which is not available here, so the default is the validation split).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torq.errors import TorqError
from torq.eval.data import resolve_data_dir

CORPORA: dict[str, Path] = {
    "wikitext2-valid": Path("wikitext-2") / "wiki.valid.tokens",
    "wikipedia-en": Path("wikipedia-en") / "bigbench_paragraph_segmentation.txt",
}


@dataclass(frozen=True)
class CalibrationConfig:
    """Which calibration tokens to use; recorded with every result."""

    corpus: str = "wikitext2-valid"
    n_samples: int = 128
    seqlen: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA and not Path(self.corpus).suffix:
            raise ValueError(
                f"unknown calibration corpus '{self.corpus}'; "
                f"known: {', '.join(CORPORA)} or a file path"
            )
        if self.n_samples < 1 or self.seqlen < 2:
            raise ValueError("calibration needs n_samples >= 1 and seqlen >= 2")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def corpus_path(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file behind a corpus name (or the corpus itself when it is a path)."""
    if corpus not in CORPORA:
        path = Path(corpus).expanduser()
        if not path.is_file():
            raise TorqError(f"calibration corpus file not found: {path}")
        return path
    root = resolve_data_dir(data_dir)
    if root is None:
        raise TorqError(
            f"calibration corpus '{corpus}' needs a data directory (--data-dir or $TORQ_DATA_DIR)"
        )
    path = root / CORPORA[corpus]
    if not path.is_file():
        raise TorqError(f"calibration corpus file not found: expected {path}")
    return path


def calibration_windows(
    tokenizer: Any, config: CalibrationConfig, data_dir: str | os.PathLike[str] | None = None
) -> torch.Tensor:
    """``[n_samples, seqlen]`` token windows at seeded random offsets of the corpus."""
    text = corpus_path(config.corpus, data_dir).read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() <= config.seqlen:
        raise TorqError(
            f"calibration corpus has {ids.numel()} tokens, too few for windows of {config.seqlen}"
        )
    g = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, ids.numel() - config.seqlen, (config.n_samples,), generator=g)
    return torch.stack([ids[s : s + config.seqlen] for s in starts.tolist()])
