"""Calibration windows: ``n`` token windows drawn with a fixed seed from a local corpus.

As in GPTQ/QuaRot/TORQ, each window starts at a uniformly random token offset of the
tokenized corpus (method-notes §3: 128 × 2048 tokens by default; the paper uses WikiText-2
train, which is not available here, so the default is the validation split).
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torq.data import WIKIPEDIA_EN, data_file
from torq.errors import TorqError
from torq.knobs import knob, nonnegative_int, positive_int

CORPORA: dict[str, Path] = {
    "wikitext2-valid": Path("wikitext-2") / "wiki.valid.tokens",
    "wikipedia-en": WIKIPEDIA_EN,
}
# A code corpus every machine has (the paper's Table 5 calibrates on code too): the
# ``.py`` sources of the running Python's standard library, its test suites left out.
PYTHON_STDLIB = "python-stdlib"
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class CalibrationConfig:
    """Which calibration tokens to use; recorded with every result."""

    corpus: str = knob(
        "wikitext2-valid",
        flag="--calib-corpus",
        metavar="TEXT",
        group="recipe",
        commands=("run", "eval", "quantize"),
        help="the calibration text: wikitext2-valid (default), wikipedia-en, python-stdlib "
        "(this Python's standard library sources, a code corpus) or a text file",
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
        if (
            self.corpus not in CORPORA
            and self.corpus != PYTHON_STDLIB
            and not Path(self.corpus).suffix
        ):
            raise ValueError(
                f"unknown calibration corpus '{self.corpus}'; "
                f"known: {', '.join(CORPORA)}, {PYTHON_STDLIB} or a file path"
            )
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

    def __post_init__(self) -> None:
        if self.reservoir_tokens < 1:
            raise ValueError(f"reservoir_tokens must be positive: {self.reservoir_tokens}")
        if self.arithmetic not in ARITHMETICS:
            raise ValueError(
                f"calibration arithmetic must be one of {', '.join(ARITHMETICS)}, "
                f"got {self.arithmetic!r}"
            )


def python_stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (``sysconfig``'s ``stdlib``), sorted by their
    path under it, test suites and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP.intersection(p.relative_to(root).parts) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_text(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """The calibration corpus as one string: a file's text, or for ``python-stdlib`` the
    standard library's sources one after another (each preceded by its path as a comment)."""
    if corpus == PYTHON_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        parts = []
        for path in python_stdlib_files():
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(f"# {path.relative_to(root).as_posix()}\n{text}")
        return "\n\n".join(parts)
    return corpus_path(corpus, data_dir).read_text(encoding="utf-8")


def corpus_path(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file behind a corpus name (or the corpus itself when it is a path); for
    ``python-stdlib``, the standard library's folder (checked to hold sources)."""
    if corpus == PYTHON_STDLIB:
        if not python_stdlib_files():
            raise TorqError("calibration corpus python-stdlib: no standard library sources")
        return Path(sysconfig.get_paths()["stdlib"])
    return data_file(corpus, CORPORA, data_dir, "calibration corpus", (PYTHON_STDLIB,))


def calibration_windows(
    tokenizer: Any, config: CalibrationConfig, data_dir: str | os.PathLike[str] | None = None
) -> torch.Tensor:
    """``[n_samples, seqlen]`` token windows at seeded random offsets of the corpus."""
    text = corpus_text(config.corpus, data_dir)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() <= config.seqlen:
        raise TorqError(
            f"calibration corpus has {ids.numel()} tokens, too few for windows of {config.seqlen}"
        )
    g = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, ids.numel() - config.seqlen, (config.n_samples,), generator=g)
    return torch.stack([ids[s : s + config.seqlen] for s in starts.tolist()])
