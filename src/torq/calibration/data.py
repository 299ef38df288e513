"""Calibration windows: ``n`` token windows drawn with a fixed seed from the calibration
data (:mod:`torq.calibration.sources`: a corpus, a text file, records of text or chats).

As in GPTQ/QuaRot/TORQ, a window of a text starts at a uniformly random token offset of the
tokenized text (method-notes §3: 128 × 2048 tokens by default; the paper uses WikiText-2
train, which is not available here, so the default is the validation split).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torq.calibration.sources import (
    CORPORA,
    PYTHON_STDLIB,
    corpus_path,
    corpus_text,
    describe_sources,
    parse_sources,
    python_stdlib_files,
    source_windows,
    window_counts,
)
from torq.knobs import knob, nonnegative_int, positive_int

__all__ = [
    "CORPORA",
    "PYTHON_STDLIB",
    "CalibrationConfig",
    "CaptureSettings",
    "calibration_data",
    "calibration_windows",
    "corpus_path",
    "corpus_text",
    "python_stdlib_files",
]


@dataclass(frozen=True)
class CalibrationConfig:
    """Which calibration tokens to use; recorded with every result."""

    # the calibration data (:mod:`torq.calibration.sources`); named ``corpus`` as when it
    # could only be one, so that kept settings keys still match
    corpus: str = knob(
        "wikitext2-valid",
        flag="--calib-data",
        aliases=("--calib-corpus",),
        metavar="DATA",
        group="recipe",
        commands=("run", "eval", "quantize"),
        help="the calibration data: wikitext2-valid (default), wikipedia-en, python-stdlib "
        "(a code corpus), a text file, a .jsonl/.parquet file or dataset folder of 'text' or "
        "chat 'messages' (PATH#COLUMN for another column); several mixed as "
        "SOURCE:WINDOWS,SOURCE:WINDOWS (docs/usage.md)",
    )
    n_samples: int = knob(
        128,
        flag="--calib-samples",
        type=positive_int,
        metavar="N",
        group="recipe",
        commands=("run", "eval", "quantize"),
        help="calibration windows (default 128, the paper's)",
    )
    seqlen: int = knob(
        2048,
        flag="--calib-seqlen",
        type=positive_int,
        commands=("run", "eval", "quantize"),
        help="calibration window length (default 2048)",
    )
    seed: int = knob(
        0,
        flag="--calib-seed",
        type=nonnegative_int,
        commands=("run", "eval", "quantize"),
        help="seed of the calibration windows, each group's token sample and the solver's "
        "subsample (the same for every method, whatever else runs)",
    )

    def __post_init__(self) -> None:
        parse_sources(self.corpus)
        if self.n_samples < 1 or self.seqlen < 2:
            raise ValueError("calibration needs n_samples >= 1 and seqlen >= 2")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the calibration's arithmetic: "exact" keeps float32 forwards (TF32 off) and float64
# statistics; "tf32" lets a CUDA GPU take TF32 products in the capture's forwards and the
# statistics (each batch's products then summed in float64), and on a CPU takes the
# statistics' products in float32
ARITHMETICS: tuple[str, ...] = ("exact", "tf32")


@dataclass(frozen=True)
class CaptureSettings:
    """What every calibrating method of a run reads alike: the calibration windows, how
    many tokens of each block's inputs are kept as samples (``reservoir_tokens``), and
    whether each layer is calibrated on the quantized layers' outputs before it
    (``sequential``) or on the float model's. A run holds one; a method's own settings are
    its :class:`torq.methods.registry.MethodSpec`'s."""

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sequential: bool = knob(
        False,
        flag="--sequential",
        action=argparse.BooleanOptionalAction,
        help="calibrate each layer on the outputs of the already quantized layers",
    )
    reservoir_tokens: int = knob(
        1024,
        flag="--reservoir",
        type=positive_int,
        help="token vectors sampled per input group for the intra-block solver",
    )
    # the capture's arithmetic (:func:`torq.calibration.capture.calibration_arithmetic`):
    # "exact" (float32 forwards, float64 products) or "tf32" (TF32 products on a CUDA GPU)
    arithmetic: str = knob(
        "exact",
        flag="--calib-arithmetic",
        choices=ARITHMETICS,
        commands=("run", "eval", "quantize"),
        help="the calibration's products: exact (float32 forwards, float64 statistics) or "
        "tf32 (TF32 on a CUDA GPU for the capture's forwards and statistics, each batch "
        "summed in float64; on a CPU, float32 statistics; see docs/large-models.md)",
    )
    # GPTAQ's float-model states on the first N calibration windows only: its cross term
    # E[(x_float − x) xᵀ] estimated on those, the Hessian on all of them
    reference_windows: int = knob(
        0,
        flag="--gptaq-windows",
        type=nonnegative_int,
        metavar="N",
        help="GPTAQ and Qronos: carry the float model's states on the first N calibration "
        "windows only and estimate their cross term on those (0: all); fewer float "
        "forwards, statistics and states held",
    )

    def __post_init__(self) -> None:
        if self.reservoir_tokens < 1:
            raise ValueError(f"reservoir_tokens must be positive: {self.reservoir_tokens}")
        if self.arithmetic not in ARITHMETICS:
            raise ValueError(
                f"calibration arithmetic must be one of {', '.join(ARITHMETICS)}, "
                f"got {self.arithmetic!r}"
            )


def calibration_windows(
    tokenizer: Any, config: CalibrationConfig, data_dir: str | os.PathLike[str] | None = None
) -> torch.Tensor:
    """``[n_samples, seqlen]`` token windows of the calibration data: each source's share
    (:func:`torq.calibration.sources.window_counts`), source ``i`` drawn with seed
    ``seed + i``."""
    sources = parse_sources(config.corpus)
    counts = window_counts(sources, config.n_samples)
    return torch.cat(
        [
            source_windows(tokenizer, source, n, config.seqlen, config.seed + i, data_dir)
            for i, (source, n) in enumerate(zip(sources, counts, strict=True))
        ]
    )


def calibration_data(
    config: CalibrationConfig, data_dir: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """What a record keeps of the calibration data: each source's path, size, sha256, how
    it was read and its windows (:func:`torq.calibration.sources.describe_sources`)."""
    return describe_sources(config.corpus, config.n_samples, data_dir)
