"""What a run keeps in a method's resume folder beside its measurements: the settings key
whose hash names the folder, and the quantized model itself.

A resume folder belongs to one (quantized) model, named by its logits fingerprint
(:mod:`torq.models.fingerprint`). It can also keep the quantized model itself
(:func:`keep_model`), so that a restart skips the calibration (TORQ's rotations and GPTQ
take minutes to an hour here). It is a private cache, pickled whole with
``torch.save``: it holds torq's quantized modules, which no checkpoint format of
transformers describes, and is read back only from the
directory that this code wrote.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torq.errors import TorqError
from torq.models.fingerprint import FINGERPRINT_TOL, fingerprint_distance, logits_fingerprint
from torq.paths import write_json_atomic

MODEL_FILE = "quantized-model.pt"
MODEL_INFO = "quantized-model.json"  # written last: a model file without it is incomplete
SETTING_FILE = "setting.json"  # the settings whose hash names the directory


def record_setting(root: Path, setting: str) -> None:
    """Write into ``root`` the settings key whose hash names it (a method's setting key,
    JSON text), so that the directory says which method, format and calibration it
    holds: a hash alone does not."""
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / SETTING_FILE, {"setting": setting})


def recorded_setting(root: Path) -> str | None:
    """The settings key :func:`record_setting` wrote in ``root``; for a directory made before
    it, the one its kept model's info holds (:func:`keep_model`); else ``None``."""
    for name, field in ((SETTING_FILE, "setting"), (MODEL_INFO, "setting_key")):
        path = root / name
        if path.is_file():
            value = json.loads(path.read_text()).get(field)
            if isinstance(value, str):
                return value
    return None


def keep_model(root: Path, model: nn.Module, input_ids: torch.Tensor, info: dict[str, Any]) -> Path:
    """Keep the quantized ``model`` in ``root`` with ``info`` (JSON) and its logits
    fingerprint; both files are written under temporary names and renamed, the model first,
    so a stop never leaves a model that :func:`load_kept_model` would take."""
    root.mkdir(parents=True, exist_ok=True)
    for module in model.modules():  # activation caches hold weak references: drop them
        clear = getattr(module, "clear_cache", None)
        if callable(clear):
            clear()
    path = root / MODEL_FILE
    (root / MODEL_INFO).unlink(missing_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(model, tmp)
    os.replace(tmp, path)
    info = {
        **json.loads(json.dumps(info, default=str)),
        "fingerprint": logits_fingerprint(model, input_ids),
        "torch": torch.__version__,
    }
    write_json_atomic(root / MODEL_INFO, info)
    return path


def load_kept_model(
    root: Path, input_ids: torch.Tensor, device: torch.device | str = "cpu"
) -> tuple[nn.Module, dict[str, Any]] | None:
    """The model :func:`keep_model` kept in ``root`` and its info (with ``"load_seconds"``),
    or ``None`` when there is none or it cannot be read here (a warning says why: the
    caller quantizes again). A model that reads back but computes something else than it
    did when it was kept (its fingerprint, :data:`FINGERPRINT_TOL`) is refused."""
    path, info_path = root / MODEL_FILE, root / MODEL_INFO
    if not (path.is_file() and info_path.is_file()):
        return None
    t0 = time.perf_counter()
    try:
        info = json.loads(info_path.read_text())
        # our own pickle, from the directory this code wrote (module docstring)
        model = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # another torch or transformers, a damaged file
        warnings.warn(f"{path} could not be read back ({exc}); quantizing again", stacklevel=2)
        return None
    if not isinstance(model, nn.Module):
        warnings.warn(f"{path} holds no model; quantizing again", stacklevel=2)
        return None
    model.to(device)
    model.eval()
    diff = fingerprint_distance(info["fingerprint"], logits_fingerprint(model, input_ids))
    if diff > FINGERPRINT_TOL:
        raise TorqError(
            f"{path} no longer computes what it did when it was kept (its logits differ by "
            f"{diff:.3g}); remove it to quantize again"
        )
    info["load_seconds"] = time.perf_counter() - t0
    return model, info
