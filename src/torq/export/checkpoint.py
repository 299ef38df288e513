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
from torq.formats.packed import PackedTensor
from torq.kernels.linear import PackedMXFP4Linear
from torq.models.fingerprint import (
    fingerprint_ids,
    logits_fingerprint,
)
from torq.models.loading import MANIFEST
from torq.paths import usual_permissions
from torq.rotations.transform import saved_transform
from torq.surgery.qlinear import ActivationQuantizer, QuantExperts, QuantLinear
from torq.version import __version__

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CHECKPOINT_FORMAT = "torq-quantized"
CHECKPOINT_VERSION = 1
# token ids of the fingerprint when no tokenizer is given
_FALLBACK_FINGERPRINT_LEN = 16


def _spec_dict(spec: FormatSpec | None) -> dict[str, Any] | None:
    return None if spec is None else spec.to_dict()


def _spec(data: dict[str, Any] | None) -> FormatSpec | None:
    return None if data is None else FormatSpec.from_dict(data)


def _store(
    tensors: dict[str, torch.Tensor],
    key: str,
    w: torch.Tensor,
    spec: FormatSpec | None,
    packed: PackedTensor | None,
) -> dict[str, Any]:
    """Store one weight under ``key``: its packed form (``key_codes``, ``key_scales``,
    NVFP4's ``key_tensor_scale``) when it has one, else its values in float."""
    if packed is not None:
        for suffix, t in packed.to_state().items():
            tensors[f"{key}_{suffix}"] = t
    else:
        tensors[key] = w.detach().cpu().contiguous()
    return {
        "weight": _spec_dict(spec),
        "storage": "float" if packed is None else "packed",
        "dtype": str(w.dtype).removeprefix("torch."),
        "shape": list(w.shape),
    }


def _transform_entry(t: nn.Module, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    """The manifest entry of the online transform ``t`` (:func:`saved_transform`), its
    tensors stored under ``torq.transforms.<index>.<name>``."""
    try:
        entry, parts = saved_transform(t)
    except ValueError as exc:
        raise TorqError(str(exc)) from None
    for name, value in parts.items():
        tensors[f"torq.transforms.{index}.{name}"] = value
    return entry


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
                        tensors, f"{name}.weight", m.weight, m.config.weight, m.packed_weight()
                    ),
                }
                entry["activation"] = _spec_dict(m.config.activation)
                entry["bias"] = m.bias is not None
                if m.bias is not None:
                    tensors[f"{name}.bias"] = m.bias.detach().cpu().contiguous()
                entry["quantizer"] = self.quantizer_index(m.input_quantizer, tensors)
                modules[name] = entry
            elif isinstance(m, QuantExperts):
                gate_up, down = m.packed_weights()
                modules[name] = {
                    "kind": "experts",
                    "activation": _spec_dict(m.config.activation),
                    "gate_up_proj": _store(
                        tensors, f"{name}.gate_up_proj", m.gate_up_proj, m.config.weight, gate_up
                    ),
                    "down_proj": _store(
                        tensors, f"{name}.down_proj", m.down_proj, m.config.weight, down
                    ),
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
