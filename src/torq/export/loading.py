"""Loading any model torq can evaluate: a checkpoint torq saved quantized
(:func:`~torq.export.reading.load_quantized`), or a float model
(:func:`torq.models.load`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from torq.errors import TorqError
from torq.export.compressed_tensors import (
    compressed_tensors_manifest,
    is_compressed_tensors_folder,
    load_compressed_tensors,
)
from torq.export.reading import load_quantized
from torq.kernels.accelerate import accelerate
from torq.models.loading import LoadedModel, is_quantized_checkpoint, load

log = logging.getLogger(__name__)


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    packed: bool = False,
    gguf_dtype: str = "float32",
    offload_dir: Path | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """:func:`torq.models.load`, or for a folder written by
    :func:`~torq.export.checkpoint.save_quantized` the quantized model it holds
    (``LoadedModel.quantized`` is then its manifest), its MXFP4 W4A4 weights kept packed
    with ``packed``, its decoder layers offloaded to the empty folder ``offload_dir`` when
    given (the layers then compute on ``device``)."""
    path = Path(name_or_path.strip()).expanduser()
    if path.is_dir() and is_quantized_checkpoint(path):
        return _from_quantized_folder(path, packed, offload_dir, device)
    if path.is_dir() and is_compressed_tensors_folder(path):
        return _from_compressed_tensors(path, packed, offload_dir)
    return load(name_or_path, dtype=dtype, gguf_dtype=gguf_dtype)


def _from_compressed_tensors(path: Path, packed: bool, offload_dir: Path | None) -> LoadedModel:
    """A compressed-tensors folder through transformers in bfloat16, its online Hadamard
    transforms attached: the model as the serving stack computes it; with ``packed`` its
    MXFP4 W4A4 linears on torq's kernels (:func:`torq.kernels.accelerate.accelerate`)."""
    from transformers import AutoTokenizer

    if offload_dir is not None:
        raise TorqError(
            f"{path} is a compressed-tensors checkpoint: it loads through transformers, "
            "without --offload-dir"
        )
    model = load_compressed_tensors(path)
    manifest = compressed_tensors_manifest(path)
    if packed:
        report = accelerate(model)
        manifest["load"] = {"packed_layers": len(report.swapped), "kept": report.kept}
        if report.kept:
            log.warning("%s: %s", path, report.summary())
    return LoadedModel(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        source=f"compressed-tensors:{path.resolve()}",
        path=str(path),
        quantized=manifest,
    )


def _from_quantized_folder(
    path: Path,
    packed: bool = False,
    offload_dir: Path | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    # with its layers offloaded the model is dispatched, where it computes, as it loads
    # (it cannot be moved after); otherwise it loads on the CPU and the caller moves it
    where = device if offload_dir is not None else "cpu"
    model, tokenizer, manifest = load_quantized(
        path, packed=packed, offload_dir=offload_dir, device=where
    )
    if tokenizer is None:
        raise TorqError(f"{path} holds no tokenizer; save it with one to evaluate it here")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=f"torq-quantized:{path.resolve()}",
        path=str(path),
        quantized=manifest,
    )
