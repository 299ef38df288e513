"""Loading a checkpoint folder torq saved (:mod:`torq.export.checkpoint` writes it): the
manifest read and checked, each quantized module rebuilt from its packed weights (torq's
fake-quant layers, bit for bit the model that was saved, or the packed MXFP4 kernel layers),
the online transforms shared again, the decoder layers optionally offloaded to disk."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torq.errors import TorqError
from torq.export.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    INDEX,
    WEIGHTS,
    _spec,
)
from torq.formats.packed import PackedTensor
from torq.kernels.config import SCALE_RULES
from torq.kernels.linear import PackedMXFP4Linear
from torq.kernels.weight import MXFP4Weight
from torq.models.architecture import decoder_layers
from torq.models.fingerprint import (
    FINGERPRINT_TOL,
    fingerprint_distance,
    logits_fingerprint,
)
from torq.models.loading import MANIFEST
from torq.models.streaming import return_free_heap
from torq.rotations.transform import transform_from_saved
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantExperts, QuantLinear

log = logging.getLogger(__name__)


def _packed(tensors: _StoredTensors, key: str, entry: dict[str, Any]) -> PackedTensor:
    """The packed weight stored under ``key`` (:meth:`PackedTensor.to_state`'s tensors)."""
    spec = _spec(entry["weight"])
    if spec is None:
        raise TorqError(f"{key} is stored packed but its manifest entry names no format")
    try:
        return PackedTensor.from_state(
            spec,
            tuple(entry["shape"]),
            _take(tensors, f"{key}_codes"),
            _take(tensors, f"{key}_scales"),
            tensors.get(f"{key}_tensor_scale"),
        )
    except ValueError as e:
        raise TorqError(f"{key}: {e}") from None


def _unpack(
    tensors: _StoredTensors,
    key: str,
    entry: dict[str, Any],
) -> torch.Tensor:
    """The values of the weight stored under ``key``, packed or in float."""
    dtype = getattr(torch, entry["dtype"])
    shape = tuple(entry["shape"])
    if entry["storage"] == "float":
        w = _take(tensors, key)
        if tuple(w.shape) != shape:
            raise TorqError(f"{key} has shape {tuple(w.shape)}, the manifest says {shape}")
        return w.to(dtype)
    return _packed(tensors, key, entry).dequantize(dtype)


def _take(tensors: _StoredTensors | dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise TorqError(f"the checkpoint lacks the tensor {key}")
    return tensors[key]


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
    """Whether the kernels run an entry: its weight packed in MXFP4 blocks of 32 (codes and
    scales, whatever rule chose them), its activation MXFP4 by the OCP or nearest rule."""

    def mx32(spec: dict[str, Any] | None) -> bool:
        return spec is not None and spec["name"] == "mxfp4" and spec["block_size"] == 32

    act = entry["activation"]
    return (
        entry["storage"] == "packed"
        and mx32(entry["weight"])
        and mx32(act)
        and act["scale_mode"] in SCALE_RULES
    )


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

    def rows(self, key: str, index: int, start: int, end: int | None) -> torch.Tensor:
        """``self[key][index, start:end]``, reading those rows alone (one expert's linear
        of a fused ``[E, rows, cols]`` stack, without the other experts')."""
        from safetensors import SafetensorError

        try:
            part = self._handles[self.file_of[key]].get_slice(key)
            return part[index : index + 1, start:end][0]
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


def _built_transforms(manifest: dict[str, Any], tensors: _StoredTensors) -> list[nn.Module]:
    """The online transforms ``T`` (Algorithm 3, steps 2–3), once each, each built back by
    its kind (:func:`torq.rotations.transform.transform_from_saved`)."""
    built: list[nn.Module] = []
    for i, t in enumerate(manifest["transforms"]):
        parts = {n: _take(tensors, f"torq.transforms.{i}.{n}") for n in t["tensors"]}
        try:
            built.append(transform_from_saved(t, parts))
        except ValueError as exc:
            raise TorqError(f"online transform {i} of the manifest: {exc}") from None
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
            weight = MXFP4Weight.from_packed(_packed(tensors, f"{name}.weight", entry))
            nearest = entry["activation"]["scale_mode"] == "nearest"
            return PackedMXFP4Linear(
                weight, bias, input_transform=quantizer.transform, nearest=nearest
            )
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

    def __init__(self, folder: Path, transforms: list[nn.Module]) -> None:
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
        # on the 0.92B shape: 1.2 GiB after one forward,
        # docs/research/streaming-and-engineering.md §9.2)
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
    offload = None if offload_dir is None else _DiskOffload(Path(offload_dir), transforms)
    assembly = _Assembly(root, manifest, tensors, model, transforms, packed)
    layers_name, n_layers = assembly.assemble(offload)
    model.eval()
    if offload is not None:
        where = torch.device(device)
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        offload.dispatch(model, layers_name, n_layers, str(where))
    else:
        model.to(device)
    tokenizer = _saved_tokenizer(root, manifest)
    n_packed = assembly.n_packed
    manifest["load"] = {"packed_layers": n_packed, "seconds": time.perf_counter() - t0}
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
            if n_packed and on_gpu:
                log.warning("%s; the packed GPU kernels accumulate in another order", message)
            else:
                raise TorqError(message)
    return model, tokenizer, manifest


class _Assembly:
    """A saved checkpoint's tensors put into its empty model one decoder layer at a time:
    the quantized linears rebuilt (:func:`_quantized_module`), every other tensor in
    float32, as the layers compute (one tensor per stored key, so that a tied head stays
    the embedding's tensor)."""

    def __init__(
        self,
        root: Path,
        manifest: dict[str, Any],
        tensors: _StoredTensors,
        model: nn.Module,
        transforms: list[nn.Module],
        packed: bool,
    ) -> None:
        self.root, self.tensors, self.model, self.packed = root, tensors, model, packed
        self.quantizers = [
            ActivationQuantizer(
                _spec(q["activation"]),
                None if q["transform"] is None else transforms[q["transform"]],
                tensor_scale=q.get("tensor_scale"),
            )
            for q in manifest["quantizers"]
        ]
        self.modules: dict[str, dict[str, Any]] = manifest["modules"]
        self.prefixes = tuple(f"{n}." for n in self.modules)
        self.stored_float = [
            k for k in tensors if not k.startswith((*self.prefixes, "torq.transforms."))
        ]
        self.aliases: dict[str, str] = manifest["aliases"]
        self.converted: dict[str, torch.Tensor] = {}
        self.n_packed = 0

    def assemble(self, offload: _DiskOffload | None) -> tuple[str, int]:
        """Every decoder layer, then the rest of the model; the decoder layers' name and
        count."""
        layers = decoder_layers(self.model)
        layers_name = next(n for n, m in self.model.named_modules() if m is layers)
        done: set[str] = set()
        for i, layer in enumerate(layers):
            p = f"{layers_name}.{i}."
            names = [n for n in self.modules if n.startswith(p)]
            self._build(names)
            keys = [k for k in self.stored_float if k.startswith(p)]
            keys += [a for a in self.aliases if a.startswith(p)]
            result = layer.load_state_dict(self._float_state(keys, p), strict=False, assign=True)
            skip = tuple(f"{n[len(p) :]}." for n in names)
            self._check(result.missing_keys, result.unexpected_keys, skip)
            for k in keys:
                self.converted.pop(self.aliases.get(k, k), None)
            done.update(names, keys)
            if offload is not None:
                offload.add_layer(p[:-1], layer)
        self._build([n for n in self.modules if n not in done])
        keys = [k for k in (*self.stored_float, *self.aliases) if k not in done]
        result = self.model.load_state_dict(self._float_state(keys), strict=False, assign=True)
        skip = (*self.prefixes, f"{layers_name}.")
        self._check(result.missing_keys, result.unexpected_keys, skip)
        return layers_name, len(layers)

    def _float_state(self, keys: list[str], strip: str = "") -> dict[str, torch.Tensor]:
        state = {}
        for k in keys:
            source = self.aliases.get(k, k)
            if source not in self.converted:
                v = _take(self.tensors, source)
                self.converted[source] = v.to(torch.float32) if v.is_floating_point() else v
            state[k[len(strip) :]] = self.converted[source]
        return state

    def _build(self, names: list[str]) -> None:
        for name in names:
            layer = _quantized_module(
                name,
                self.modules[name],
                self.tensors,
                self.quantizers,
                self.model.get_submodule(name),
                self.packed,
            )
            _set_module(self.model, name, layer)
            self.n_packed += isinstance(layer, PackedMXFP4Linear)

    def _check(self, missing: list[str], unexpected: list[str], skip: tuple[str, ...]) -> None:
        missing = [k for k in missing if not k.startswith(skip)]
        if unexpected or missing:
            raise TorqError(
                f"the checkpoint in {self.root} does not match the model of its config.json: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )


def _saved_tokenizer(root: Path, manifest: dict[str, Any]) -> Any | None:
    """The tokenizer saved with the checkpoint, of the class that was saved (AutoTokenizer
    may pick another from config.json's model type, which tokenizes differently)."""
    if not (root / "tokenizer_config.json").is_file():
        return None
    import transformers

    cls = getattr(transformers, manifest.get("tokenizer_class") or "", None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(root))
