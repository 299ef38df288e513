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
* fused MoE experts ``<name>``: ``<name>.gate_up_proj_*`` and ``<name>.down_proj_*``, the same way.
* the online transforms ``T`` (Algorithm 3, steps 2–3; :class:`BlockRotation`), each once
  however many layers read it: ``torq.transforms.<i>.{r_inter, r_intra, channel_scale,
  intra_factor0, intra_factor1}``.
* everything else of the model's state dict (embeddings, norms, lm_head) as it is; a tensor
  tied to another (a tied lm_head) is stored once and named in the manifest's ``aliases``.

The manifest lists each quantized module with its formats, its storage and which activation
quantizer (transform and activation format) it reads through, so that layers that shared one
online transform share it again after loading. It also keeps a logits fingerprint
(:mod:`torq.eval.resume`) that :func:`load_quantized` checks.
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

import torq
from torq.errors import TorqError
from torq.eval.resume import (
    FINGERPRINT_TOL,
    fingerprint_distance,
    fingerprint_ids,
    logits_fingerprint,
)
from torq.formats import FormatSpec
from torq.formats.packed import PackedTensor, dequantize, quantize
from torq.paths import usual_permissions
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantExperts, QuantLinear

log = logging.getLogger(__name__)

MANIFEST = "torq_quant.json"
WEIGHTS = "model.safetensors"
CHECKPOINT_FORMAT = "torq-quantized"
CHECKPOINT_VERSION = 1
TRANSFORM_TENSORS = ("r_inter", "r_intra", "channel_scale", "intra_factor0", "intra_factor1")
# token ids of the fingerprint when no tokenizer is given
_FALLBACK_FINGERPRINT_LEN = 16


def _spec_dict(spec: FormatSpec | None) -> dict[str, Any] | None:
    return None if spec is None else spec.to_dict()


def _spec(data: dict[str, Any] | None) -> FormatSpec | None:
    return None if data is None else FormatSpec.from_dict(data)


def _pack_exact(w: torch.Tensor, spec: FormatSpec | None) -> tuple[dict[str, torch.Tensor], str]:
    """The stored tensors of one weight: packed when unpacking gives ``w`` back bit for bit
    (a weight the method quantized to ``spec``'s grid), else ``w`` in float."""
    w = w.detach().cpu().contiguous()
    if spec is not None and bool(torch.isfinite(w).all()):
        p = quantize(w, spec)
        if torch.equal(dequantize(p, w.dtype), w):
            out = {"codes": p.codes.contiguous(), "scales": p.scales.contiguous()}
            if p.tensor_scale is not None:
                out["tensor_scale"] = p.tensor_scale.reshape(1).contiguous()
            return out, "packed"
    return {"": w}, "float"


def _unpack(
    tensors: dict[str, torch.Tensor],
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


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise TorqError(f"the checkpoint lacks the tensor {key}")
    return tensors[key]


def _store(
    tensors: dict[str, torch.Tensor], key: str, w: torch.Tensor, spec: FormatSpec | None
) -> dict[str, Any]:
    parts, storage = _pack_exact(w, spec)
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
def _atomic_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; it becomes ``out`` only when complete."""
    if out.exists() and not out.is_dir():
        raise TorqError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise TorqError(f"{out} exists and is not empty; choose another folder or overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


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

    from torq.kernels.linear import PackedMXFP4Linear

    t0 = time.perf_counter()
    out = Path(out_dir)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TorqError("save_quantized needs a Hugging Face model (it has no .config)")
    for module in model.modules():  # activation caches hold weak references: drop them
        clear = getattr(module, "clear_cache", None)
        if callable(clear):
            clear()

    tensors: dict[str, torch.Tensor] = {}
    quantizers: dict[int, int] = {}
    quantizer_entries: list[dict[str, Any]] = []
    transforms: dict[int, int] = {}
    transform_entries: list[dict[str, Any]] = []
    modules: dict[str, dict[str, Any]] = {}

    def quantizer_index(q: ActivationQuantizer) -> int:
        if id(q) not in quantizers:
            t_index = None
            if q.transform is not None:
                if id(q.transform) not in transforms:
                    transforms[id(q.transform)] = len(transform_entries)
                    transform_entries.append(
                        _transform_entry(q.transform, len(transform_entries), tensors)
                    )
                t_index = transforms[id(q.transform)]
            quantizers[id(q)] = len(quantizer_entries)
            quantizer_entries.append({"activation": _spec_dict(q.fmt), "transform": t_index})
        return quantizers[id(q)]

    for name, m in model.named_modules():
        if isinstance(m, PackedMXFP4Linear):
            raise TorqError(
                f"{name} is a packed kernel layer; save the model as quantized by torq "
                "(load_quantized(..., packed=False)), not after packing it"
            )
        if isinstance(m, QuantLinear):
            entry = {
                "kind": "linear",
                **_store(tensors, f"{name}.weight", m.weight, m.config.weight),
            }
            entry["activation"] = _spec_dict(m.config.activation)
            entry["bias"] = m.bias is not None
            if m.bias is not None:
                tensors[f"{name}.bias"] = m.bias.detach().cpu().contiguous()
            entry["quantizer"] = quantizer_index(m.input_quantizer)
            modules[name] = entry
        elif isinstance(m, QuantExperts):
            entry = {
                "kind": "experts",
                "activation": _spec_dict(m.config.activation),
                "gate_up_proj": _store(
                    tensors, f"{name}.gate_up_proj", m.gate_up_proj, m.config.weight
                ),
                "down_proj": _store(tensors, f"{name}.down_proj", m.down_proj, m.config.weight),
            }
            modules[name] = entry
    if not modules:
        raise TorqError("the model has no quantized layers: quantize it first (torq.methods)")

    rest, aliases = _module_state(model, list(modules))
    clash = set(rest) & set(tensors)
    if clash:
        raise TorqError(f"tensor names clash with quantized modules: {sorted(clash)[:3]}")
    tensors.update(rest)

    ids = _fingerprint_input(model, tokenizer)
    fingerprint = logits_fingerprint(model, ids)
    packed = sum(
        1
        for e in modules.values()
        for s in ([e] if e["kind"] == "linear" else [e["gate_up_proj"], e["down_proj"]])
        if s["storage"] == "packed"
    )
    import transformers

    manifest = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "method": method,
        "model_class": type(model).__name__,
        "tokenizer_class": None if tokenizer is None else type(tokenizer).__name__,
        "modules": modules,
        "quantizers": quantizer_entries,
        "transforms": transform_entries,
        "aliases": aliases,
        "fingerprint": {"input_ids": ids[0].tolist(), "logits": fingerprint},
        "stats": {
            "quantized_modules": len(modules),
            "packed_weights": packed,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        },
        "versions": {
            "torq": torq.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "info": json.loads(json.dumps(info or {}, default=str)),
    }
    with _atomic_folder(out, overwrite) as tmp:
        config.save_pretrained(str(tmp))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            with contextlib.suppress(Exception):  # an unusable generation config is optional
                gen.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "torq": CHECKPOINT_FORMAT})
        manifest["stats"]["save_seconds"] = time.perf_counter() - t0
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        usual_permissions(tmp)
    log.info("saved %d quantized modules (%d packed) to %s", len(modules), packed, out)
    return out


def is_quantized_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_quantized`."""
    return (Path(path) / MANIFEST).is_file()


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
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        try:
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
        except ImportError:
            no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    config = AutoConfig.from_pretrained(str(path))
    with no_init_weights():
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


@torch.no_grad()
def load_quantized(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    packed: bool = False,
    verify: bool = True,
) -> tuple[nn.Module, Any | None, dict[str, Any]]:
    """Rebuild the model that :func:`save_quantized` wrote in ``path``.

    Returns ``(model, tokenizer or None, manifest)``. By default each quantized linear is a
    :class:`QuantLinear` (weights unpacked to float, activations fake-quantized), the same
    computation as the model that was saved; ``packed=True`` makes each MXFP4 W4A4 linear a
    :class:`~torq.kernels.linear.PackedMXFP4Linear` instead (packed weights, Triton kernels
    on a GPU, the same reference arithmetic on a CPU). ``verify`` checks the logits
    fingerprint stored at save time (a mismatch raises, except for packed layers on a GPU,
    whose accumulation order differs: there it warns).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from torq.kernels.linear import MXFP4Weight, PackedMXFP4Linear

    t0 = time.perf_counter()
    root = Path(path)
    manifest = read_manifest(root)
    weights = root / WEIGHTS
    if not weights.is_file():
        raise TorqError(f"{root} has a manifest but no {WEIGHTS}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise TorqError(f"{weights} could not be read ({exc})") from None
    model = _empty_model(root)

    built_transforms = []
    for i, t in enumerate(manifest["transforms"]):
        parts = {n: _take(tensors, f"torq.transforms.{i}.{n}") for n in t["tensors"]}
        factors = [parts[n] for n in ("intra_factor0", "intra_factor1") if n in parts]
        dtype = next(iter(parts.values())).dtype
        built_transforms.append(
            BlockRotation(
                t["block_size"],
                r_inter=parts.get("r_inter"),
                r_intra=parts.get("r_intra"),
                dtype=dtype,
                channel_scale=parts.get("channel_scale"),
                intra_factors=factors or None,
            )
        )
    built_quantizers = [
        ActivationQuantizer(
            _spec(q["activation"]),
            None if q["transform"] is None else built_transforms[q["transform"]],
        )
        for q in manifest["quantizers"]
    ]

    n_packed_layers = 0
    for name, entry in manifest["modules"].items():
        act = _spec(entry["activation"])
        if entry["kind"] == "linear":
            bias = tensors.get(f"{name}.bias") if entry["bias"] else None
            if entry["bias"] and bias is None:
                raise TorqError(f"the checkpoint lacks the tensor {name}.bias")
            quantizer = built_quantizers[entry["quantizer"]]
            if packed and _packable(entry):
                in_features = int(entry["shape"][1])
                layer: nn.Module = PackedMXFP4Linear(
                    MXFP4Weight(
                        _take(tensors, f"{name}.weight_codes"),
                        _take(tensors, f"{name}.weight_scales"),
                        in_features,
                    ),
                    bias,
                    input_transform=quantizer.transform,
                )
                n_packed_layers += 1
            else:
                cfg = QuantConfig(weight=_spec(entry["weight"]), activation=act)
                w = _unpack(tensors, f"{name}.weight", entry)
                layer = QuantLinear(w, bias, cfg, input_quantizer=quantizer, weight_quantized=True)
            _set_module(model, name, layer)
        elif entry["kind"] == "experts":
            old = model.get_submodule(name)
            gu = _unpack(tensors, f"{name}.gate_up_proj", entry["gate_up_proj"])
            dn = _unpack(tensors, f"{name}.down_proj", entry["down_proj"])
            cfg = QuantConfig(weight=_spec(entry["gate_up_proj"]["weight"]), activation=act)
            _set_module(model, name, QuantExperts.from_quantized(old.act_fn, gu, dn, cfg))
        else:
            raise TorqError(f"unknown module kind {entry['kind']!r} for {name} in the manifest")

    prefixes = tuple(f"{n}." for n in manifest["modules"])
    rest = {k: v for k, v in tensors.items() if not k.startswith((*prefixes, "torq.transforms."))}
    for alias, source in manifest["aliases"].items():
        rest[alias] = _take(rest, source)
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if not k.startswith(prefixes)]
    if unexpected or missing:
        raise TorqError(
            f"{weights} does not match the model of its config.json: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.eval().to(device)

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
