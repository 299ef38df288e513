"""Where a run's models come from and go: the float checkpoint read again for each method,
a checkpoint torq saved already quantized (evaluated as it is), and ``--save-dir``'s folders."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torq.errors import TorqError
from torq.export import is_quantized_checkpoint, read_manifest
from torq.export.compressed_tensors import compressed_tensors_manifest, is_compressed_tensors_folder
from torq.formats.config import run_scale_mode
from torq.paths import check_destination
from torq.results import command_line, now_iso
from torq.runs.config import Formats, Outputs


@contextlib.contextmanager
def offload_scratch(folder: str | None) -> Iterator[Path | None]:
    """A new folder inside ``folder`` for the offloaded layers of the run (None without
    ``folder``), removed with everything in it when the run ends, however it ends."""
    if folder is None:
        yield None
        return
    check_destination(folder, folder=True, what="--offload-dir")
    created = not Path(folder).exists()
    Path(folder).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="torq-offload-", dir=folder))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):  # only if nothing else was put there
                Path(folder).rmdir()


def saved_manifest(model: str) -> dict[str, Any] | None:
    """The manifest when ``model`` is a checkpoint folder torq saved quantized (or a
    compressed-tensors folder, described alike), else None."""

    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    if is_quantized_checkpoint(path):
        return read_manifest(path)
    if is_compressed_tensors_folder(path):
        return compressed_tensors_manifest(path)
    return None


class SavedMethod:
    """The row of a model that was quantized before it was saved: nothing to apply."""

    quantizes = True

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.name = manifest.get("method") or "saved"


def saved_run_formats(
    model: str, methods: list[str], formats: Formats, manifest: dict[str, Any]
) -> Formats:
    """The run's ``formats`` as the saved model at ``model`` holds them; the run's
    ``methods`` must name the saved method."""
    name = manifest.get("method") or "saved"
    if methods != [name]:
        raise TorqError(
            f"{model} holds a model already quantized with '{name}'; evaluate it with "
            f"--methods {name} (or without --methods). To compare other methods, start from "
            "the float model."
        )
    saved = saved_formats(manifest)
    if saved is None:
        return formats
    weight_format, act_format, scale_mode = saved
    return replace(
        formats, weight_format=weight_format, act_format=act_format, scale_mode=scale_mode
    )


def saved_formats(manifest: dict[str, Any]) -> tuple[str | None, str | None, str] | None:
    """``(weight format, activation format, block scale rule)`` of a saved quantized model's
    linear layers (None for a float side), or None when it has no quantized linear layer."""
    linear = next((e for e in manifest["modules"].values() if e["kind"] == "linear"), None)
    if linear is None:
        return None

    def name_of(spec: dict[str, Any] | None) -> str | None:
        return None if spec is None else spec["name"]

    def mode_of(spec: dict[str, Any] | None) -> str | None:
        return None if spec is None else spec["scale_mode"]

    scale_mode = run_scale_mode(mode_of(linear["weight"]), mode_of(linear["activation"]))
    return name_of(linear["weight"]), name_of(linear["activation"]), scale_mode


def saved_model_dir(outputs: Outputs, model: str, method: str) -> Path:
    """``<save_dir>/<model>-<method>``: where ``--save-dir`` writes one method's model."""
    if outputs.save_dir is None:
        raise TorqError("no save directory configured")
    stem = Path(model).name or model
    slug = "".join(c if c.isalnum() or c in "-._" else "_" for c in stem)
    return Path(outputs.save_dir) / f"{slug}-{method.replace('+', '-')}"


def streamed_save_dir(outputs: Outputs, model: str, method: str) -> Path:
    """Where a streamed run writes a method's torq checkpoint as the layers are done: its
    ``--save-dir`` folder, or for ``--save-format compressed-tensors`` a staging folder beside
    it (``.<name>.torq``) that is exported and removed once the model is whole."""
    out = saved_model_dir(outputs, model, method)
    if outputs.save_format == "compressed-tensors":
        return out.with_name(f".{out.name}.torq")
    return out


def saved_info(
    record: dict[str, Any], source: str, quantize_seconds: float, details: dict[str, Any]
) -> dict[str, Any]:
    """What a saved checkpoint's manifest keeps of the run that made it (``record``: the
    run's settings as its record keeps them)."""
    return {
        "model": record["model"],
        "source": source,
        "quantize_seconds": quantize_seconds,
        "details": {k: v for k, v in details.items() if k not in ("kept_model", "save_seconds")},
        "config": record,
        "command": command_line(),
        "saved_at": now_iso(),
    }
