"""A quantized model as a checkpoint folder: packed 4-bit weights, transforms, manifest.

Layout of a folder written by :func:`save_quantized`::

    config.json, generation_config.json   the model's Hugging Face configuration
    tokenizer files                       when a tokenizer was given
    model.safetensors                     every tensor (below)
    torq_quant.json                       the manifest, written last

Tensors in ``model.safetensors``:

* for each quantized linear ``<name>`` (a :class:`~torq.surgery.qlinear.QuantLinear`): the
  weight ``Q_w(W Tᵀ)`` of the paper's Algorithm 3 (option B) in its packed form,
  ``<name>.weight_codes`` (``uint8 [out, ⌈in/bs⌉·bs/2]``, two 4-bit codes per byte, element
  ``2i`` in the low nibble) and ``<name>.weight_scales`` (``uint8 [out, ⌈in/bs⌉]``, E8M0 for
  MXFP4/MXINT4, E4M3 bits for NVFP4, whose FP32 tensor scale is
  ``<name>.weight_tensor_scale``): the layout of :class:`torq.formats.packed.PackedTensor`.
  A weight that its format's packing does not reproduce bit for bit (it is kept in float by
  the method, or is not on the format's grid) is stored as ``<name>.weight`` in float, and
  the manifest says so. ``<name>.bias`` in float.
* fused MoE experts ``<name>``: ``<name>.gate_up_proj_*`` and ``<name>.down_proj_*``, the same
  way; their manifest entry names the expert input's activation quantizer and the
  ``down_proj`` inputs' (one shared, or one per expert).
* the online transforms ``T`` (Algorithm 3, steps 2–3; :class:`BlockRotation`), each once
  however many layers read it: ``torq.transforms.<i>.{r_inter, r_intra, channel_scale,
  intra_factor0, intra_factor1}``.
* everything else of the model's state dict (embeddings, norms, lm_head) as it is; a tensor
  tied to another (a tied lm_head) is stored once and named in the manifest's ``aliases``.

The manifest lists each quantized module with its formats, its storage and which activation
quantizer (transform and activation format) it reads through, so that layers that shared one
online transform share it again after loading. It also keeps a logits fingerprint
(:mod:`torq.runs.kept`) that :func:`load_quantized` checks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torq.errors import TorqError
from torq.formats import FormatSpec
from torq.formats.packed import PackedTensor, dequantize, encode_nvfp4_exact, quantize
from torq.kernels.linear import PackedMXFP4Linear
from torq.kernels.weight import MXFP4Weight
from torq.models.architecture import decoder_layers
from torq.models.fingerprint import (
    FINGERPRINT_TOL,
    fingerprint_distance,
    fingerprint_ids,
    logits_fingerprint,
)
from torq.models.loading import MANIFEST
from torq.models.streaming import return_free_heap
from torq.paths import usual_permissions
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantExperts, QuantLinear
from torq.version import __version__

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CHECKPOINT_FORMAT = "torq-quantized"
CHECKPOINT_VERSION = 1
TRANSFORM_TENSORS = (
    "r_inter",
    "r_intra",
    "channel_scale",
    "intra_factor0",
    "intra_factor1",
    "channel_perm",
)
# token ids of the fingerprint when no tokenizer is given
_FALLBACK_FINGERPRINT_LEN = 16


def _spec_dict(spec: FormatSpec | None) -> dict[str, Any] | None:
    return None if spec is None else spec.to_dict()


def _spec(data: dict[str, Any] | None) -> FormatSpec | None:
    return None if data is None else FormatSpec.from_dict(data)


def _pack_exact(
    w: torch.Tensor, spec: FormatSpec | None, tensor_scale: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """The stored tensors of one weight: packed when unpacking gives ``w`` back bit for bit
    (a weight the method quantized to ``spec``'s grid), else ``w`` in float. An NVFP4
    weight packs with the tensor scale it was quantized with (``tensor_scale``,
    :func:`torq.formats.packed.encode_nvfp4_exact`); quantizing it again would take the
    quantized weight's own amax, another scale."""
    w = w.detach().cpu().contiguous()
    if spec is not None and bool(torch.isfinite(w).all()):
        if spec.name == "nvfp4":
            p = None if tensor_scale is None else encode_nvfp4_exact(w, tensor_scale.cpu())
        else:
            p = quantize(w, spec)
        if p is not None and torch.equal(dequantize(p, w.dtype), w):
            out = {"codes": p.codes.contiguous(), "scales": p.scales.contiguous()}
            if p.tensor_scale is not None:
                out["tensor_scale"] = p.tensor_scale.reshape(1).contiguous()
            return out, "packed"
    return {"": w}, "float"


def _unpack(
    tensors: _StoredTensors,
    key: str,
    entry: dict[str, Any],
) -> torch.Tensor:
    """Inverse of :func:`_pack_exact` for the weight stored under ``key``."""
    dtype = getattr(torch, entry["dtype"])
    shape = tuple(entry["shape"])
    if entry["storage"] == "float":
        w = _take(tensors, key)
        if tuple(w.shape) != shape:
            raise TorqError(f"{key} has shape {tuple(w.shape)}, the manifest says {shape}")
        return w.to(dtype)
    spec = _spec(entry["weight"])
    if spec is None:
        raise TorqError(f"{key} is stored packed but its manifest entry names no format")
    ts = tensors.get(f"{key}_tensor_scale")
    p = PackedTensor(
        fmt=spec,
        codes=_take(tensors, f"{key}_codes"),
        scales=_take(tensors, f"{key}_scales"),
        tensor_scale=None if ts is None else ts.reshape(()),
        shape=shape,
    )
    bs = spec.block_size
    padded = -(-shape[-1] // bs) * bs
    if tuple(p.codes.shape) != (*shape[:-1], padded // 2) or tuple(p.scales.shape) != (
        *shape[:-1],
        padded // bs,
    ):
        raise TorqError(f"{key}: packed codes/scales do not match the shape {shape}")
    return dequantize(p, dtype)


def _take(tensors: _StoredTensors | dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise TorqError(f"the checkpoint lacks the tensor {key}")
    return tensors[key]


def _store(
    tensors: dict[str, torch.Tensor],
    key: str,
    w: torch.Tensor,
    spec: FormatSpec | None,
    tensor_scale: torch.Tensor | None = None,
) -> dict[str, Any]:
    parts, storage = _pack_exact(w, spec, tensor_scale)
    for suffix, t in parts.items():
        tensors[key + (f"_{suffix}" if suffix else "")] = t
    return {
        "weight": _spec_dict(spec),
        "storage": storage,
        "dtype": str(w.dtype).removeprefix("torch."),
        "shape": list(w.shape),
    }


def _transform_entry(t: nn.Module, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    if not isinstance(t, BlockRotation):
        raise TorqError(
            f"cannot save an online transform of type {type(t).__name__}; "
            "only torq's BlockRotation is serialisable"
        )
    names = []
    for n in TRANSFORM_TENSORS:
        v = getattr(t, n, None)
        if isinstance(v, torch.Tensor):
            tensors[f"torq.transforms.{index}.{n}"] = v.detach().cpu().contiguous()
            names.append(n)
    return {"block_size": t.block_size, "n_blocks": t.n_blocks, "tensors": names}


def _fingerprint_input(model: nn.Module, tokenizer: Any | None) -> torch.Tensor:
    if tokenizer is not None:
        return fingerprint_ids(tokenizer)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, _FALLBACK_FINGERPRINT_LEN), generator=gen)


def _module_state(model: nn.Module, skip: list[str]) -> tuple[dict, dict[str, str]]:
    """The state dict without the quantized modules' entries; shared tensors once, with
    the other names as aliases."""
    prefixes = tuple(f"{s}." for s in skip)
    rest: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], str], str] = {}
    for key, t in model.state_dict(keep_vars=False).items():
        if key.startswith(prefixes) or t is None:
            continue
        ident = (t.data_ptr(), t.storage_offset(), tuple(t.shape), str(t.device))
        if t.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        rest[key] = t.detach().cpu().contiguous()
    return rest, aliases


@contextlib.contextmanager
def _atomic_folder(out: Path, overwrite: bool, keep_partial: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; it becomes ``out`` only when complete.
    ``keep_partial``: the sibling is ``.<name>.partial``, taken up if there and left in
    place on an error (a later run writes on into it)."""
    if out.exists() and not out.is_dir():
        raise TorqError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise TorqError(f"{out} exists and is not empty; choose another folder or overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    if keep_partial:
        tmp = out.with_name(f".{out.name}.partial")
        tmp.mkdir(exist_ok=True)
    else:
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        if not keep_partial:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


class _Entries:
    """The manifest entries of quantized modules, their activation quantizers and online
    transforms, each quantizer and transform stored once however many modules read it. The
    objects are held while the entries are built (so that a freed layer's transform is not
    taken for a later one that reuses its ``id``)."""

    def __init__(self) -> None:
        self.quantizers: dict[int, int] = {}
        self.quantizer_entries: list[dict[str, Any]] = []
        self.transforms: dict[int, int] = {}
        self.transform_entries: list[dict[str, Any]] = []
        self._held: list[nn.Module] = []

    def quantizer_index(self, q: ActivationQuantizer, tensors: dict[str, torch.Tensor]) -> int:
        if id(q) not in self.quantizers:
            t_index = None
            if q.transform is not None:
                if id(q.transform) not in self.transforms:
                    self.transforms[id(q.transform)] = len(self.transform_entries)
                    self.transform_entries.append(
                        _transform_entry(q.transform, len(self.transform_entries), tensors)
                    )
                    self._held.append(q.transform)
                t_index = self.transforms[id(q.transform)]
            self.quantizers[id(q)] = len(self.quantizer_entries)
            entry: dict[str, Any] = {"activation": _spec_dict(q.fmt), "transform": t_index}
            if q.tensor_scale is not None:
                # a static NVFP4 activation tensor scale (float32: exact as a JSON number)
                entry["tensor_scale"] = float(q.tensor_scale)
            self.quantizer_entries.append(entry)
            self._held.append(q)
        return self.quantizers[id(q)]

    def add(
        self, root: nn.Module, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, dict[str, Any]]:
        """The entries of ``root``'s quantized modules (names ``prefix + name``), their
        tensors stored into ``tensors``."""

        for module in root.modules():  # activation caches hold weak references: drop them
            clear = getattr(module, "clear_cache", None)
            if callable(clear):
                clear()
        modules: dict[str, dict[str, Any]] = {}
        for local, m in root.named_modules():
            name = prefix + local
            if isinstance(m, PackedMXFP4Linear):
                raise TorqError(
                    f"{name} is a packed kernel layer; save the model as quantized by torq "
                    "(load_quantized(..., packed=False)), not after packing it"
                )
            if isinstance(m, QuantLinear):
                entry = {
                    "kind": "linear",
                    **_store(
                        tensors,
                        f"{name}.weight",
                        m.weight,
                        m.config.weight,
                        getattr(m, "weight_tensor_scale", None),
                    ),
                }
                entry["activation"] = _spec_dict(m.config.activation)
                entry["bias"] = m.bias is not None
                if m.bias is not None:
                    tensors[f"{name}.bias"] = m.bias.detach().cpu().contiguous()
                entry["quantizer"] = self.quantizer_index(m.input_quantizer, tensors)
                modules[name] = entry
            elif isinstance(m, QuantExperts):
                modules[name] = {
                    "kind": "experts",
                    "activation": _spec_dict(m.config.activation),
                    "gate_up_proj": _store(
                        tensors, f"{name}.gate_up_proj", m.gate_up_proj, m.config.weight
                    ),
                    "down_proj": _store(tensors, f"{name}.down_proj", m.down_proj, m.config.weight),
                    # the expert input's quantizer and the down_proj inputs' (one or one per
                    # expert), with their online transforms
                    "quantizer": self.quantizer_index(m.input_quantizer, tensors),
                    "down_quantizers": [
                        self.quantizer_index(q, tensors) for q in m.down_quantizers
                    ],
                }
        return modules


@torch.no_grad()
def save_quantized(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer: Any | None = None,
    *,
    method: str | None = None,
    info: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the quantized ``model`` (torq's fake-quant modules) as a checkpoint folder.

    The weights of Algorithm 3's option B (``Q_w(W Tᵀ)``, the inverse transform fused in)
    are stored packed in their block format, the online transforms ``T`` beside them (module
    docstring). The folder appears complete or not at all: it is written under a temporary
    name and renamed; an existing non-empty folder is replaced only with ``overwrite``.
    ``info`` (JSON-serialisable: the method's details, its calibration time, the command)
    is kept in the manifest. Returns the folder.
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    out = Path(out_dir)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TorqError("save_quantized needs a Hugging Face model (it has no .config)")
    entries = _Entries()
    tensors: dict[str, torch.Tensor] = {}
    modules = entries.add(model, "", tensors)
    if not modules:
        raise TorqError("the model has no quantized layers: quantize it first (torq.methods)")

    rest, aliases = _module_state(model, list(modules))
    clash = set(rest) & set(tensors)
    if clash:
        raise TorqError(f"tensor names clash with quantized modules: {sorted(clash)[:3]}")
    tensors.update(rest)

    ids = _fingerprint_input(model, tokenizer)
    fingerprint = logits_fingerprint(model, ids)
    manifest = _manifest(
        method, type(model).__name__, tokenizer, entries, modules, aliases, ids, fingerprint, info
    )
    manifest["stats"]["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    with _atomic_folder(out, overwrite) as tmp:
        _write_configs(tmp, model, tokenizer)
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "torq": CHECKPOINT_FORMAT})
        manifest["stats"]["save_seconds"] = time.perf_counter() - t0
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        usual_permissions(tmp)
    log.info("saved %d quantized modules to %s", len(modules), out)
    return out


def _manifest(
    method: str | None,
    model_class: str,
    tokenizer: Any | None,
    entries: _Entries,
    modules: dict[str, dict[str, Any]],
    aliases: dict[str, str],
    ids: torch.Tensor,
    fingerprint: list[float],
    info: dict[str, Any] | None,
) -> dict[str, Any]:
    import transformers

    packed = sum(
        1
        for e in modules.values()
        for s in ([e] if e["kind"] == "linear" else [e["gate_up_proj"], e["down_proj"]])
        if s["storage"] == "packed"
    )
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "method": method,
        "model_class": model_class,
        "tokenizer_class": None if tokenizer is None else type(tokenizer).__name__,
        "modules": modules,
        "quantizers": entries.quantizer_entries,
        "transforms": entries.transform_entries,
        "aliases": aliases,
        "fingerprint": {"input_ids": ids[0].tolist(), "logits": fingerprint},
        "stats": {"quantized_modules": len(modules), "packed_weights": packed},
        "versions": {
            "torq": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "info": json.loads(json.dumps(info or {}, default=str)),
    }


def _write_configs(folder: Path, model: nn.Module, tokenizer: Any | None) -> None:
    model.config.save_pretrained(str(folder))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        with contextlib.suppress(Exception):  # an unusable generation config is optional
            gen.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


INDEX = "model.safetensors.index.json"


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in bf16 when bf16 holds every value exactly (a float32 copy of a bf16
    checkpoint's embedding or norm), else as it is: lossless, and half the bytes."""
    t = t.detach().cpu().contiguous()
    if t.dtype != torch.float32 or not t.numel():
        return t
    # bf16 is float32's upper half: exact iff the lower 16 bits are zero (NaN excepted, as
    # NaN != NaN). Checked a slab at a time: a round trip of a whole 8B model's embedding
    # would hold two more copies of it (3 GB) while its checkpoint is written.
    bits = t.reshape(-1).view(torch.int32)
    slab = 1 << 24
    for i in range(0, bits.numel(), slab):
        part = bits[i : i + slab]
        if bool((part & 0xFFFF).any()) or bool(torch.isnan(part.view(torch.float32)).any()):
            return t
    return t.to(torch.bfloat16)


class CheckpointWriter:
    """:func:`save_quantized`, one part at a time, for the layer-streaming driver
    (:func:`torq.driver.run_layerwise`): the embedding, each quantized decoder layer as it
    is done, and the head each go to a shard of their own (``model-<part>.safetensors``,
    named in ``model.safetensors.index.json``), so the whole model is never in memory. The
    quantized weights are packed exactly as :func:`save_quantized` packs them; tensors
    outside the quantized modules are stored in bf16 when that is exact (a bf16
    checkpoint's values), else as computed. The logits fingerprint is computed by the
    driver, streamed. Use as a context manager: the folder appears, complete, only when
    :meth:`finish` was called and the block ends without an error.

    ``resumable``: the parts are written to ``.<name>.partial`` beside the folder, which a
    failed or stopped run leaves in place, so that a run continued from the driver's kept
    progress (:class:`torq.driver.LayerProgress`, which keeps :meth:`snapshot`) writes on
    into it instead of starting again; :meth:`finish` removes any part no longer named."""

    def __init__(
        self,
        out_dir: str | Path,
        model: nn.Module,
        tokenizer: Any | None = None,
        *,
        method: str | None = None,
        info: dict[str, Any] | None = None,
        overwrite: bool = False,
        resumable: bool = False,
    ) -> None:
        self.out = Path(out_dir)
        self.model = model  # the skeleton: config, class, where the parts sit
        self.tokenizer = tokenizer
        self.method, self.info, self.overwrite = method, info, overwrite
        self.resumable = resumable
        self.entries = _Entries()
        self.modules: dict[str, dict[str, Any]] = {}
        self.weight_map: dict[str, str] = {}
        self.aliases: dict[str, str] = {}
        self.bytes = 0
        self.t0 = time.perf_counter()
        self._folder: contextlib.AbstractContextManager[Path] | None = None
        self._tmp: Path | None = None
        self._manifest: dict[str, Any] | None = None

    def __enter__(self) -> CheckpointWriter:
        self._folder = _atomic_folder(self.out, self.overwrite, self.resumable)
        self._tmp = self._folder.__enter__()
        return self

    def snapshot(self) -> dict[str, Any]:
        """What has been written so far (plain data), for :meth:`restore` in a later run."""
        e = self.entries
        return {
            "quantizer_entries": e.quantizer_entries,
            "transform_entries": e.transform_entries,
            "modules": self.modules,
            "weight_map": self.weight_map,
            "aliases": self.aliases,
            "bytes": self.bytes,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take up a :meth:`snapshot`: the parts written after it are written again. The
        quantizers and transforms written before are not shared with the later layers'
        (their objects are gone with the run that made them): entries of their own."""
        self.entries = _Entries()
        self.entries.quantizer_entries = list(state["quantizer_entries"])
        self.entries.transform_entries = list(state["transform_entries"])
        self.modules = dict(state["modules"])
        self.weight_map = dict(state["weight_map"])
        self.aliases = dict(state["aliases"])
        self.bytes = int(state["bytes"])

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        assert self._folder is not None
        if exc_type is None and self._manifest is None:
            err = TorqError(f"{self.out}: the checkpoint was not finished; nothing written")
            self._folder.__exit__(TorqError, err, None)  # removes the temporary folder
            raise err
        return self._folder.__exit__(exc_type, exc, tb)

    @property
    def fingerprint_ids(self) -> torch.Tensor:
        """The input whose logits :meth:`finish` stores (as :func:`save_quantized` does)."""
        return _fingerprint_input(self.model, self.tokenizer)

    def _shard(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        assert self._tmp is not None, "use CheckpointWriter as a context manager"
        if not tensors:
            return
        clash = set(tensors) & set(self.weight_map)
        if clash:
            raise TorqError(f"tensor names written twice: {sorted(clash)[:3]}")
        file = f"model-{part}.safetensors"
        save_file(tensors, str(self._tmp / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            self.weight_map[name] = file
            self.bytes += t.numel() * t.element_size()

    @torch.no_grad()
    def add_layer(self, prefix: str, index: int, layer: nn.Module) -> None:
        """Decoder layer ``index`` (its modules named ``prefix + name``), quantized."""
        tensors: dict[str, torch.Tensor] = {}
        modules = self.entries.add(layer, prefix, tensors)
        rest, aliases = _module_state(layer, [n.removeprefix(prefix) for n in modules])
        tensors.update({prefix + k: _narrowest_exact(v) for k, v in rest.items()})
        self.aliases.update({prefix + k: prefix + v for k, v in aliases.items()})
        self.modules.update(modules)
        self._shard(f"layer-{index:05d}", tensors)

    @torch.no_grad()
    def add_outer(self, part: str, modules: list[nn.Module], tied_head: bool = False) -> None:
        """Parameters of modules outside the decoder layers (the embedding; the final norm
        and lm_head), under their names in the model. ``tied_head``: lm_head is the
        embedding's tensor, stored once (under the embedding's name)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        head = self.model.get_output_embeddings()
        emb = self.model.get_input_embeddings()
        tensors: dict[str, torch.Tensor] = {}
        for module in modules:
            base = names[id(module)]
            for n, p in module.named_parameters(recurse=False):
                key = f"{base}.{n}" if base else n
                if tied_head and module is head:
                    self.aliases[key] = f"{names[id(emb)]}.{n}"
                    continue
                tensors[key] = _narrowest_exact(p)
        self._shard(part, tensors)

    def finish(self, fingerprint: list[float]) -> dict[str, Any]:
        """Write the index, the configuration, the tokenizer and (last) the manifest."""
        assert self._tmp is not None, "use CheckpointWriter as a context manager"
        if not self.modules:
            raise TorqError("the model has no quantized layers: quantize it first (torq.methods)")
        manifest = _manifest(
            self.method,
            type(self.model).__name__,
            self.tokenizer,
            self.entries,
            self.modules,
            self.aliases,
            self.fingerprint_ids,
            fingerprint,
            self.info,
        )
        manifest["stats"]["bytes"] = self.bytes
        manifest["stats"]["shards"] = len(set(self.weight_map.values()))
        named = set(self.weight_map.values())
        for f in self._tmp.glob("model-*.safetensors"):
            if f.name not in named:  # a part of a run that stopped and did not come back
                f.unlink()
        index = {"metadata": {"total_size": self.bytes}, "weight_map": self.weight_map}
        (self._tmp / INDEX).write_text(json.dumps(index, indent=1))
        _write_configs(self._tmp, self.model, self.tokenizer)
        manifest["stats"]["save_seconds"] = time.perf_counter() - self.t0
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        usual_permissions(self._tmp)
        self._manifest = manifest
        return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for format and version."""
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise TorqError(f"{path} is not a torq quantized checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise TorqError(f"{p} is not valid JSON ({exc})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise TorqError(f"{p} does not describe a torq quantized checkpoint")
    if manifest.get("version") != CHECKPOINT_VERSION:
        raise TorqError(
            f"{p} has checkpoint version {manifest.get('version')}; this torq reads version "
            f"{CHECKPOINT_VERSION}"
        )
    return manifest


def _empty_model(path: Path) -> nn.Module:
    """The model of ``path``'s config.json with its parameters on ``meta`` (no memory: the
    quantized modules replace theirs, the stored tensors are assigned to the rest), buffers
    real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr, None)
    if old is None:
        raise TorqError(f"the model built from config.json has no module {name}")
    setattr(parent, attr, module)
    return old


def _packable(entry: dict[str, Any]) -> bool:
    mx = {"name": "mxfp4", "block_size": 32, "scale_mode": "ocp"}
    return entry["storage"] == "packed" and entry["weight"] == mx and entry["activation"] == mx


class _StoredTensors:
    """A checkpoint's tensors, each read from its safetensors file when it is asked for, so
    that loading never holds the stored copy of the whole model beside the built one."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import SafetensorError, safe_open

        self._handles: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise TorqError(f"{file} could not be read ({exc})") from None
            self._handles[file] = handle
            self.file_of.update(dict.fromkeys(handle.keys(), file))

    def __contains__(self, key: object) -> bool:
        return key in self.file_of

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            return self._handles[self.file_of[key]].get_tensor(key)
        except SafetensorError as exc:
            raise TorqError(f"{self.file_of[key]} could not be read ({exc})") from None

    def get(self, key: str) -> torch.Tensor | None:
        return self[key] if key in self.file_of else None

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)


def _checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: one, or the shards of its index."""
    if (root / INDEX).is_file():  # written part by part (CheckpointWriter)
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TorqError(f"{root / INDEX} is not a safetensors index ({exc})") from None
        return [root / f for f in sorted(set(weight_map.values()))]
    if not (root / WEIGHTS).is_file():
        raise TorqError(f"{root} has a manifest but no {WEIGHTS}")
    return [root / WEIGHTS]


def _built_transforms(manifest: dict[str, Any], tensors: _StoredTensors) -> list[BlockRotation]:
    """The online transforms ``T`` (Algorithm 3, steps 2–3), once each."""
    built = []
    for i, t in enumerate(manifest["transforms"]):
        parts = {n: _take(tensors, f"torq.transforms.{i}.{n}") for n in t["tensors"]}
        factors = [parts[n] for n in ("intra_factor0", "intra_factor1") if n in parts]
        dtype = next(v.dtype for v in parts.values() if v.is_floating_point())
        built.append(
            BlockRotation(
                t["block_size"],
                r_inter=parts.get("r_inter"),
                r_intra=parts.get("r_intra"),
                dtype=dtype,
                channel_scale=parts.get("channel_scale"),
                intra_factors=factors or None,
                channel_perm=parts.get("channel_perm"),
            )
        )
    return built


def _quantized_module(
    name: str,
    entry: dict[str, Any],
    tensors: _StoredTensors,
    quantizers: list[ActivationQuantizer],
    old: nn.Module,
    packed: bool,
) -> nn.Module:
    """The module of one manifest entry: a linear ``Q_w(W Tᵀ)`` read through its activation
    quantizer ``Q_a(T x)`` (unpacked to float, or packed MXFP4), or fused MoE experts."""

    act = _spec(entry["activation"])
    if entry["kind"] == "linear":
        bias = tensors.get(f"{name}.bias") if entry["bias"] else None
        if entry["bias"] and bias is None:
            raise TorqError(f"the checkpoint lacks the tensor {name}.bias")
        quantizer = quantizers[entry["quantizer"]]
        if packed and _packable(entry):
            weight = MXFP4Weight(
                _take(tensors, f"{name}.weight_codes"),
                _take(tensors, f"{name}.weight_scales"),
                int(entry["shape"][1]),
            )
            return PackedMXFP4Linear(weight, bias, input_transform=quantizer.transform)
        cfg = QuantConfig(weight=_spec(entry["weight"]), activation=act)
        w = _unpack(tensors, f"{name}.weight", entry)
        ts = tensors.get(f"{name}.weight_tensor_scale") if entry["storage"] == "packed" else None
        return QuantLinear(
            w,
            bias,
            cfg,
            input_quantizer=quantizer,
            weight_quantized=True,
            weight_tensor_scale=None if ts is None else ts.reshape(()),
        )
    if entry["kind"] == "experts":
        gu = _unpack(tensors, f"{name}.gate_up_proj", entry["gate_up_proj"])
        dn = _unpack(tensors, f"{name}.down_proj", entry["down_proj"])
        cfg = QuantConfig(weight=_spec(entry["gate_up_proj"]["weight"]), activation=act)
        # (checkpoints written before experts had transforms name no quantizers: RTN's)
        q_in = quantizers[entry["quantizer"]] if "quantizer" in entry else None
        q_down = [quantizers[i] for i in entry.get("down_quantizers", [])] or None
        experts = QuantExperts.from_quantized(old.act_fn, gu, dn, cfg, q_in, q_down)
        if packed and all(
            _packable({**entry[p], "activation": entry["activation"]})
            for p in ("gate_up_proj", "down_proj")
        ):
            from torq.kernels.experts import PackedMXFP4Experts

            return PackedMXFP4Experts.from_quant_experts(experts)
        return experts
    raise TorqError(f"unknown module kind {entry['kind']!r} for {name} in the manifest")


class _DiskOffload:
    """accelerate's disk offload of the decoder layers, written layer by layer as they are
    built: each layer's tensors go to ``folder`` as accelerate's memory-mapped ``.dat``
    files and are replaced by ``meta`` ones, so no more than one layer is ever held.

    The online transforms stay in memory: several layers (often all of them) read one, and
    they are small (a few 32×32 blocks and a channel scale per group). Their buffers are
    made non-persistent here, which is what accelerate leaves on the execution device;
    otherwise every linear reading a transform would load it from disk again."""

    def __init__(self, folder: Path, transforms: list[BlockRotation]) -> None:
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise TorqError(f"the offload folder {folder} is not empty")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.index: dict[str, dict[str, Any]] = {}
        for t in transforms:
            t._non_persistent_buffers_set.update(n for n, _ in t.named_buffers(recurse=False))

    def add_layer(self, prefix: str, layer: nn.Module) -> None:
        from accelerate.utils import named_module_tensors, offload_weight
        from accelerate.utils.modeling import set_module_tensor_to_device

        # every name a tensor is reached by (accelerate hooks each module by its own path)
        seen: dict[int, str] = {}
        for name, module in layer.named_modules(remove_duplicate=False):
            for n, t in named_module_tensors(
                module, include_buffers=True, recurse=False, remove_non_persistent=True
            ):
                full = f"{name}.{n}" if name else n
                if id(t) in seen and seen[id(t)] != full:
                    raise TorqError(f"cannot offload {prefix}: {full} is also {seen[id(t)]}")
                seen[id(t)] = full
                offload_weight(t, f"{prefix}.{full}", str(self.folder), self.index)
                set_module_tensor_to_device(module, n, "meta")
        return_free_heap()

    def dispatch(self, model: nn.Module, layers_name: str, n_layers: int, device: str) -> None:
        """``accelerate.dispatch_model`` with each decoder layer on ``"disk"`` and the rest
        (embeddings, final norm, head) on ``device``, where every layer also computes."""
        from accelerate import dispatch_model
        from accelerate.utils.offload import save_offload_index

        save_offload_index(self.index, str(self.folder))
        device_map = _layers_on_disk(model, layers_name, n_layers, device)
        # (accelerate warns that the offloaded parameters are on meta: that is the point)
        quiet = logging.getLogger("accelerate.big_modeling")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            dispatch_model(
                model,
                device_map,
                main_device=device,
                offload_dir=str(self.folder),
                offload_buffers=True,
            )
        finally:
            quiet.setLevel(level)
        # each layer's weights, read from disk and dropped again, leave the heap fragmented:
        # without giving it back the resident set grows by about a layer per layer (measured
        # on the 0.92B shape: 1.2 GiB after one forward, docs/RESULTS.md §9.2)
        for layer in model.get_submodule(layers_name):
            layer.register_forward_hook(lambda *_: return_free_heap())


def _layers_on_disk(model: nn.Module, layers_name: str, n_layers: int, device: str) -> dict:
    """A device map with every decoder layer on ``"disk"`` and every other module on
    ``device``: the siblings of each module on the way from the root to the layer list."""
    device_map: dict[str, str] = {}
    path = layers_name.split(".")
    for depth in range(len(path)):
        parent = model.get_submodule(".".join(path[:depth])) if depth else model
        prefix = ".".join(path[:depth])
        for child, _ in parent.named_children():
            if child != path[depth]:
                device_map[f"{prefix}.{child}" if prefix else child] = device
        if (
            next(parent.parameters(recurse=False), None) is not None
            or next(parent.buffers(recurse=False), None) is not None
        ):
            raise TorqError(f"cannot offload a model whose {prefix or 'root'} holds tensors itself")
    for i in range(n_layers):
        device_map[f"{layers_name}.{i}"] = "disk"
    return device_map


@torch.no_grad()
def load_quantized(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    packed: bool = False,
    verify: bool = True,
    offload_dir: str | Path | None = None,
) -> tuple[nn.Module, Any | None, dict[str, Any]]:
    """Rebuild the model that :func:`save_quantized` wrote in ``path``.

    Returns ``(model, tokenizer or None, manifest)``. By default each quantized linear is a
    :class:`QuantLinear` (weights unpacked to float, activations fake-quantized), the same
    computation as the model that was saved; ``packed=True`` makes each MXFP4 W4A4 linear a
    :class:`~torq.kernels.linear.PackedMXFP4Linear` instead (packed weights, Triton kernels
    on a GPU, the same reference arithmetic on a CPU). ``offload_dir`` (an empty or new
    folder) keeps the decoder layers on disk there, through accelerate's ``device_map``
    offload: the model is built one layer at a time and each layer is read back only while
    it computes, so a model larger than memory can be evaluated (slowly). ``verify`` checks
    the logits fingerprint stored at save time (a mismatch raises, except for packed layers
    on a GPU, whose accumulation order differs: there it warns).
    """

    t0 = time.perf_counter()
    root = Path(path)
    manifest = read_manifest(root)
    tensors = _StoredTensors(_checkpoint_files(root))
    model = _empty_model(root)
    transforms = _built_transforms(manifest, tensors)
    quantizers = [
        ActivationQuantizer(
            _spec(q["activation"]),
            None if q["transform"] is None else transforms[q["transform"]],
            tensor_scale=q.get("tensor_scale"),
        )
        for q in manifest["quantizers"]
    ]
    offload = None
    if offload_dir is not None:
        offload = _DiskOffload(Path(offload_dir), transforms)

    modules: dict[str, dict[str, Any]] = manifest["modules"]
    prefixes = tuple(f"{n}." for n in modules)
    stored_float = [k for k in tensors if not k.startswith((*prefixes, "torq.transforms."))]
    aliases: dict[str, str] = manifest["aliases"]
    # in float32, as the layers compute (a part-by-part checkpoint keeps bf16 where exact)
    # (one tensor per stored key, so that a tied head stays the embedding's tensor)
    converted: dict[str, torch.Tensor] = {}

    def float_state(keys: list[str], strip: str = "") -> dict[str, torch.Tensor]:
        state = {}
        for k in keys:
            source = aliases.get(k, k)
            if source not in converted:
                v = _take(tensors, source)
                converted[source] = v.to(torch.float32) if v.is_floating_point() else v
            state[k[len(strip) :]] = converted[source]
        return state

    def build(names: list[str]) -> int:
        n = 0
        for name in names:
            entry = modules[name]
            layer = _quantized_module(
                name, entry, tensors, quantizers, model.get_submodule(name), packed
            )
            _set_module(model, name, layer)
            n += isinstance(layer, PackedMXFP4Linear)
        return n

    def check(missing: list[str], unexpected: list[str], skip: tuple[str, ...]) -> None:
        missing = [k for k in missing if not k.startswith(skip)]
        if unexpected or missing:
            raise TorqError(
                f"the checkpoint in {root} does not match the model of its config.json: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )

    layers = decoder_layers(model)
    layers_name = next(n for n, m in model.named_modules() if m is layers)
    n_packed_layers = 0
    done: set[str] = set()
    for i, layer in enumerate(layers):
        p = f"{layers_name}.{i}."
        names = [n for n in modules if n.startswith(p)]
        n_packed_layers += build(names)
        keys = [k for k in stored_float if k.startswith(p)] + [
            a for a in aliases if a.startswith(p)
        ]
        result = layer.load_state_dict(float_state(keys, p), strict=False, assign=True)
        check(result.missing_keys, result.unexpected_keys, tuple(f"{n[len(p) :]}." for n in names))
        for k in keys:
            converted.pop(aliases.get(k, k), None)
        done.update(names, keys)
        if offload is not None:
            offload.add_layer(p[:-1], layer)
    n_packed_layers += build([n for n in modules if n not in done])
    keys = [k for k in (*stored_float, *aliases) if k not in done]
    result = model.load_state_dict(float_state(keys), strict=False, assign=True)
    check(result.missing_keys, result.unexpected_keys, (*prefixes, f"{layers_name}."))
    model.eval()
    if offload is not None:
        where = torch.device(device)
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        offload.dispatch(model, layers_name, len(layers), str(where))
    else:
        model.to(device)

    tokenizer = None
    if (root / "tokenizer_config.json").is_file():
        import transformers

        # the class that was saved: AutoTokenizer may pick another from config.json's
        # model type, which tokenizes differently
        cls = getattr(transformers, manifest.get("tokenizer_class") or "", None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            cls = transformers.AutoTokenizer
        tokenizer = cls.from_pretrained(str(root))
    manifest["load"] = {"packed_layers": n_packed_layers, "seconds": time.perf_counter() - t0}
    if offload is not None:
        manifest["load"]["offload_dir"] = str(offload.folder)
    if verify:
        ids = torch.tensor([manifest["fingerprint"]["input_ids"]])
        diff = fingerprint_distance(
            manifest["fingerprint"]["logits"], logits_fingerprint(model, ids)
        )
        manifest["load"]["fingerprint_difference"] = diff
        if diff > FINGERPRINT_TOL:
            message = (
                f"the model loaded from {root} does not compute what was saved "
                f"(its logits differ by {diff:.3g})"
            )
            on_gpu = torch.device(device).type == "cuda"
            if n_packed_layers and on_gpu:
                log.warning("%s; the packed GPU kernels accumulate in another order", message)
            else:
                raise TorqError(message)
    return model, tokenizer, manifest
