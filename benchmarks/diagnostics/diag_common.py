"""What the diagnostics share: threads, SmolLM2-135M, evaluation and calibration windows.

Environment: ``T`` threads, ``NW`` evaluation windows (default 4), ``NC`` calibration
windows, ``TORQ_DATA_DIR`` (default ``../shared/data``).
"""

from __future__ import annotations

import os

import torch

from torq.experimental import (
    CalibrationConfig,
    LoadedModel,
    calibration_windows,
    load,
    load_wikitext2_test,
    windows_from_text,
)


def data_dir() -> str:
    return os.environ.get("TORQ_DATA_DIR", "../shared/data")


def setup(default_threads: int) -> LoadedModel:
    """Set the thread count (``T``) and load the embedded SmolLM2-135M."""
    torch.set_num_threads(int(os.environ.get("T", str(default_threads))))
    return load("smollm2-135m")


def eval_windows(lm: LoadedModel) -> torch.Tensor:
    """The first ``NW`` WikiText-2 test windows of 2048 tokens."""
    text = load_wikitext2_test(data_dir())
    return windows_from_text(text, lm.tokenizer, 2048, int(os.environ.get("NW", "4")))


def calib_windows(lm: LoadedModel, default: int) -> torch.Tensor:
    """``NC`` calibration windows of ``wiki.valid.tokens`` (torq's defaults otherwise)."""
    config = CalibrationConfig(n_samples=int(os.environ.get("NC", str(default))))
    return calibration_windows(lm.tokenizer, config, data_dir())
