"""Export to compressed-tensors, the format transformers and vLLM load.

A model quantized by torq is written as a compressed-tensors checkpoint with the
compressed-tensors package itself (``ModelCompressor``): each quantized linear becomes
``weight_packed`` (uint8 ``[out, in/2]``, element ``2i`` in the low nibble) and
``weight_scale`` (uint8 E8M0 ``[out, in/32]``) under the ``mxfp4-pack-quantized`` format, the
activations' dynamic MXFP4 quantization goes into ``quantization_config``, and a 32-block
Hadamard becomes a ``transform_config`` group of ``type: hadamard``, ``head_dim: 32``, applied
online to each linear's ``input`` and fused into its ``weight_input`` (inverse): the
Sylvester matrix the loaders build is torq's ``H₃₂`` times ``√32``, and they divide by it.

What the format cannot express is refused, naming what can be exported: TORQ's calibrated
per-position rotations, its channel balancing done online (``--fold-balance`` folds it into
the norms and the v/up rows, :mod:`torq.rotations.fold`, and leaves ``torq-had32`` with the
32-block Hadamard alone online), QuaRot's full-width rotations, NVFP4
activations with torq's dynamic tensor scale (the format's take a static one calibrated
beforehand: quantize with ``--act-scale static``), MXINT4. Linears with no online transform
beside ones with the Hadamard (a group left unrotated: the recipes leave a linear with a bias,
Qwen2's q/k/v, so) are left out of the Hadamard's group. A linear with a bias under the
Hadamard (Qwen2's q/k/v quantized with it) is written, and said: transformers runs it, vLLM
only with torq's plugin (``integrations/vllm``).

NVFP4 weights (``nvfp4-pack-quantized``: E2M1 codes as MXFP4's, ``weight_scale`` the E4M3
block scales per 16, ``weight_global_scale`` the reciprocal of torq's FP32 tensor scale, the
loaders dividing by it) are written from the tensor scale each linear kept
(:func:`torq.formats.packed.encode_nvfp4_exact`), with float activations (W4A16). The loaders'
``s / (1/g)`` rounds where torq's ``g · s`` does not, by at most an ulp of float32. NVFP4
activations (W4A4, compressed-tensors' ``NVFP4`` scheme) are written when every activation
quantizer holds a static tensor scale ``g_a`` (``act_scale="static"``): ``input_global_scale``
is ``1 / g_a``; the E4M3 block scales of the activations stay dynamic, as in torq.

Fused MoE experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) are written one
linear per projection and expert (:func:`expert_linears`), the layout transformers saves
and vLLM reads, their routers named in ``ignore``; transformers 5 merges them back as it
loads them, de-quantizing their weights, and runs their activations in float. Neither
engine runs an online transform inside the experts, so experts with one are refused, as are
NVFP4 experts, which transformers 5 de-quantizes without their tensor scale.

Tensors outside the quantized linears are written in bf16 (transformers loads this format in
bf16; float32 fails in its decompression): a float32 embedding or norm not exact in bf16 is
rounded there. The quantized weights lie on the E2M1 grid times powers of two, exact in bf16,
and pack to torq's own codes except the sign of zero (compressed-tensors stores +0 where torq
keeps the sign of a value that rounded to zero; the same value).

:func:`load_compressed_tensors` loads such a folder through transformers and attaches the
online transforms again with compressed-tensors' own ``apply_transform_config``, since
transformers' compressed-tensors loader leaves them out without a word. A folder with online
transforms carries that loader (:mod:`torq.export.modeling_torq`) for
``from_pretrained(folder, trust_remote_code=True)``, and refuses a plain ``from_pretrained``
(:func:`guard_for_transformers`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from torq.errors import TorqError
from torq.export.checkpoint import INDEX, _atomic_folder, save_quantized
from torq.export.modeling_torq import NESTED_KEY, TorqForCausalLM, refusing_config
from torq.export.reading import (
    _built_transforms,
    _checkpoint_files,
    _StoredTensors,
    read_manifest,
)
from torq.formats.packing import decode_e4m3
from torq.models.architecture import is_fused_experts
from torq.surgery.qlinear import FUSED_LINEARS, QuantExperts, QuantLinear, fused_set

FORMAT = "mxfp4-pack-quantized"
NVFP4_FORMAT = "nvfp4-pack-quantized"
# the linears a precision budget keeps in 8 bits: E4M3 weights (``weight``, float8) and E8M0
# scales, dynamic MXFP8 activations; a config group of their own, named one by one
MXFP8_FORMAT = "mxfp8-quantized"
_MXFP8_GROUP = "group_mxfp8"
CT_HOLDS = (
    "no online transform or the 32-block Hadamard alone (rtn, gptq, had32, and torq-had32 "
    "with its balancing folded, each with RTN or GPTQ weights); MXFP4 weights with MXFP4 or "
    "float activations, or NVFP4 weights with float activations or NVFP4 ones under "
    "--act-scale static"
)
log = logging.getLogger(__name__)

# fused experts (one 3-D weight per projection) are written one linear per expert, the
# layout transformers saves and vLLM reads; the engines run no online transform inside them
MOE_NOT_EXPORTED = (
    "fused MoE experts of this architecture have no compressed-tensors layout here: write "
    "the model with --save-format torq (format='torq')"
)
EXPERTS_ROTATED = (
    "MoE experts with an online transform are not exported: transformers and vLLM run none "
    "inside the experts; quantize with the default or fast recipe, which leave the experts "
    "unrotated in a compressed-tensors folder, or write the model with --save-format torq"
)
EXPERTS_NVFP4 = (
    "NVFP4 MoE experts are not exported: transformers 5 decompresses experts without their "
    "NVFP4 tensor scale; write the model with --save-format torq, or use MXFP4"
)
# what transformers does with a compressed-tensors folder's experts, said once it is written
EXPERTS_SERVED = (
    "%d MoE experts modules written one linear per expert: transformers de-quantizes their "
    "4-bit weights when it loads them and runs their activations in bf16 (it quantizes the "
    "activations of its linears only); vLLM reads them as the folder's scheme"
)
# each architecture's expert linears as transformers saves a fused-experts module and vLLM
# reads it: its gate, up and down projections (gate_up_proj holds gate's rows, then up's)
EXPERT_LAYOUT: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# the checkpoint's names where transformers renames them as it loads (Mixtral's MoE block is
# ``block_sparse_moe`` on disk, ``mlp`` in transformers 5), as vLLM reads them
CHECKPOINT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".mlp.", ".block_sparse_moe."),),
}


def checkpoint_key(key: str, model_type: str) -> str:
    """A tensor's name in the checkpoint, from its name in transformers' model."""
    for inside, on_disk in CHECKPOINT_NAMES.get(model_type, ()):
        key = key.replace(inside, on_disk)
    return key


# the routers: not quantized (compressed-tensors' class targets miss them in transformers,
# whose routers are not ``Linear``; vLLM reads them as linears, so they are named)
_ROUTERS = "re:.*(mlp|block_sparse_moe)\\.gate$"
_HADAMARD_GROUP = "torq_had32"
_NOT_EXPORTED_FORMAT = (
    "only MXFP4 (blocks of 32) and NVFP4 (blocks of 16) weights are exported, with MXFP8 "
    "ones beside them"
)
# compressed-tensors' NVFP4 activations (vLLM's too) quantize with a static FP32 tensor scale
# (input_global_scale) calibrated beforehand; torq's NVFP4 activations take the tensor's own
# amax at every call, which the format cannot say
NVFP4_ACTIVATIONS = (
    "NVFP4 activations with torq's dynamic tensor scale are not exported: compressed-tensors "
    "quantizes them with a static tensor scale calibrated beforehand; quantize with "
    "--act-scale static, or export NVFP4 weights with float activations (--a-format none)"
)

# Four Over Six on NVFP4 weights is standard NVFP4 (each block's E4M3 scale is stored as it
# is); on activations it is a rule the engine would have to run, and none does
FOUR_OVER_SIX_ACTIVATIONS = (
    "Four Over Six activations (--scale-mode 4over6) are not exported: engines quantize NVFP4 "
    "activations with the standard scale; quantize with --scale-mode 4over6-weights, which "
    "they serve as torq runs it"
)


def _scheme(
    weight: dict[str, Any] | None,
    activation: dict[str, Any] | None,
    name: str,
    static: bool = False,
) -> str:
    """The compressed-tensors format for a linear's weight and activation formats
    (``{"name", "block_size"}``; ``static``: its activation quantizer holds a static tensor
    scale), or a :class:`TorqError` naming what cannot be written."""
    w_name = None if weight is None else (weight["name"], weight["block_size"])
    a_name = None if activation is None else (activation["name"], activation["block_size"])
    if w_name == ("mxfp4", 32):
        if a_name not in (None, ("mxfp4", 32)):
            raise TorqError(f"{name}: with MXFP4 weights, activations must be MXFP4 or float")
        return FORMAT
    if w_name == ("mxfp8", 32):
        if a_name not in (None, ("mxfp8", 32)):
            raise TorqError(f"{name}: with MXFP8 weights, activations must be MXFP8 or float")
        return MXFP8_FORMAT
    if w_name == ("nvfp4", 16):
        if a_name not in (None, ("nvfp4", 16)):
            raise TorqError(f"{name}: with NVFP4 weights, activations must be NVFP4 or float")
        if a_name is not None and not static:
            raise TorqError(f"{name}: {NVFP4_ACTIVATIONS}")
        if activation is not None and activation.get("scale_mode") == "4over6":
            raise TorqError(f"{name}: {FOUR_OVER_SIX_ACTIVATIONS}")
        return NVFP4_FORMAT
    raise TorqError(f"{name}: {_NOT_EXPORTED_FORMAT}")


def _format_dict(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"name": spec.name, "block_size": spec.block_size, "scale_mode": spec.scale_mode}


def _say_biased(biased: list[str]) -> None:
    """Say, once a folder is written, which of its linears have a bias under the Hadamard
    (Qwen2's q/k/v quantized with it): transformers runs them; vLLM (0.32, 0.33) only with
    torq's plugin in its environment (``integrations/vllm``); without it, its transformed
    linear asserts at the first request that there is no bias."""
    if biased:
        log.warning(
            "%d linears (%s, …) have a bias under the online Hadamard: transformers serves "
            "the folder; vLLM needs torq's plugin in its environment (pip install "
            "integrations/vllm from torq's repository), else it stops at the first request",
            len(biased),
            biased[0],
        )


def _transform_kind(module: QuantLinear, name: str) -> str | None:
    """``None`` (no online transform) or ``"had32"``; anything else is refused."""
    return _rotation_kind(module.input_quantizer.transform, name)


def _rotation_kind(t: nn.Module | None, name: str) -> str | None:
    """:func:`_transform_kind` of an online transform ``t``."""
    if t is None:
        return None
    form = t.served_form() if hasattr(t, "served_form") else None
    if form is not None:
        return form
    what = t.unserved_reason() if hasattr(t, "unserved_reason") else type(t).__name__
    raise TorqError(
        f"{name}: its online transform ({what}) has no compressed-tensors form yet; "
        f"compressed-tensors holds: {CT_HOLDS}"
    )


def fused_experts_in(model: nn.Module) -> str | None:
    """The first fused MoE experts module of ``model`` (a skeleton will do), or ``None``."""
    return next((n for n, m in model.named_modules() if is_fused_experts(m)), None)


def experts_unserved(model: nn.Module, weight_format: str | None) -> str | None:
    """Why a compressed-tensors folder cannot hold ``model``'s fused MoE experts in
    ``weight_format`` (a skeleton will do: before any layer is quantized), in one line
    naming them; ``None`` when it can or there are none. Their online transforms are
    checked by the methods (``experts_online``) and again as the folder is written."""
    name = fused_experts_in(model)
    if name is None:
        return None
    if getattr(model.config, "model_type", None) not in EXPERT_LAYOUT:
        return f"{name}: {MOE_NOT_EXPORTED}"
    if weight_format == "nvfp4":
        return f"{name}: {EXPERTS_NVFP4}"
    return None


def _split_formats(formats: dict[str, str]) -> tuple[str, list[str]]:
    """The folder's 4-bit format and the linears kept in MXFP8 (``formats``: each quantized
    linear's); one 4-bit format for all, or MXFP8 alone."""
    high = [n for n, f in formats.items() if f == MXFP8_FORMAT]
    low = {f for f in formats.values() if f != MXFP8_FORMAT}
    if len(low) > 1:
        raise TorqError("the quantized linears differ in transform or format")
    return (low.pop() if low else MXFP8_FORMAT), high


def _plan(
    model: nn.Module,
) -> tuple[dict[str, QuantLinear], str | None, bool, str, list[str], list[str], list[str]]:
    """The quantized linears, their transform kind, whether activations are quantized
    and the compressed-tensors format; every module must agree (the format holds one scheme
    for all here) but for linears with no transform (:func:`_one_kind`) and those a
    precision budget keeps in MXFP8; the linears with a bias under the transform
    (:func:`_say_biased`), those with no transform, and those in MXFP8."""
    linears: dict[str, QuantLinear] = {}
    kinds: dict[str, str | None] = {}
    acts: set[bool] = set()
    formats: dict[str, str] = {}
    biased: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        w, a = module.config.weight, module.config.activation
        static = module.input_quantizer.tensor_scale is not None
        formats[name] = _scheme(_format_dict(w), _format_dict(a), name, static)
        kind = kinds[name] = _transform_kind(module, name)
        if kind is not None and module.bias is not None:
            biased.append(name)
        acts.add(a is not None)
        linears[name] = module
    if not linears:
        raise TorqError("the model has no quantized linears: quantize it first (torq.methods)")
    if len(acts) > 1:
        raise TorqError("the quantized linears differ in transform or format")
    fmt, high = _split_formats(formats)
    kind, plain = _one_kind(kinds)
    return linears, kind, acts.pop(), fmt, biased, plain, high


def _one_kind(kinds: dict[str, str | None]) -> tuple[str | None, list[str]]:
    """The one transform kind of the quantized linears (``kinds``: each one's) and the
    linears with none, which the transform group leaves out (a group left unrotated, the
    methods' ``unrotated`` setting: q/k/v with a bias, which vLLM serves only so)."""
    present = {k for k in kinds.values() if k is not None}
    if len(present) > 1:
        raise TorqError("the quantized linears differ in transform or format")
    plain = [n for n, k in kinds.items() if k is None] if present else []
    return (present.pop() if present else None), plain


@torch.no_grad()
def export_compressed_tensors(
    model: nn.Module, out_dir: str | Path, tokenizer: Any | None = None, overwrite: bool = False
) -> Path:
    """Write a model quantized by torq (its fake-quant :class:`QuantLinear` modules,
    Algorithm 3 option B: ``Q_w(W Tᵀ)`` with ``T`` online) as a compressed-tensors folder
    that transformers and vLLM load (module doc). Returns the folder."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM

    if any(isinstance(m, QuantExperts) for m in model.modules()):
        return _export_through_checkpoint(model, Path(out_dir), tokenizer, overwrite)
    linears, kind, activations, fmt, biased, plain_linears, high = _plan(model)
    if fmt == NVFP4_FORMAT:
        _check_fused_scales({n: m.weight_tensor_scale for n, m in linears.items() if n not in high})
    config = model.config
    # the plain Hugging Face model with torq's values: each quantized linear's weight is
    # its fused, quantized one; everything else as torq holds it
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        owner = key.rsplit(".", 1)[0]
        if any(key.startswith(f"{n}.") for n in linears) and key not in (
            f"{owner}.weight",
            f"{owner}.bias",
        ):
            continue  # a quantizer's or transform's buffer: not a model tensor
        state[key] = value
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")}
        if config.tie_word_embeddings
        else set()
    )
    if set(missing) - tied or unexpected:
        raise TorqError(
            f"the quantized model's tensors do not fit its architecture "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    plain = plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16  # what the folder holds, whatever the source said
    ignore = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and n not in linears]
    _apply_schemes(plain, kind, activations, ignore, fmt, plain_linears, high)
    expected_codes: dict[str, torch.Tensor] = {}
    expected_values: dict[str, torch.Tensor] = {}
    for name, module in linears.items():
        target = plain.get_submodule(name)
        packed = module.packed_weight()  # torq's one stored form of the weight
        if packed is None:
            raise TorqError(
                f"{name}: its NVFP4 weight has no tensor scale to pack it with (quantize it "
                "with this torq version); nothing written"
                if fmt == NVFP4_FORMAT
                else f"{name}: its weight is not on the MXFP4 grid; nothing written"
            )
        codes, scales = packed.codes.cpu(), packed.scales.cpu()
        if name in high:  # MXFP8: compressed-tensors rounds torq's weight with these scales
            expected_values[name] = codes.view(torch.float8_e4m3fn).float()
        if fmt == NVFP4_FORMAT and name not in high:
            assert packed.tensor_scale is not None  # NVFP4's packing keeps it
            scale = decode_e4m3(scales)
            target.weight_global_scale.data = (1.0 / packed.tensor_scale.cpu()).reshape(
                target.weight_global_scale.shape
            )
            if activations:  # the static activation tensor scale, inverted as the weight's
                g_a = module.input_quantizer.tensor_scale
                assert g_a is not None  # _plan refused a dynamic one
                target.input_global_scale.data = (1.0 / g_a.float().cpu()).reshape(
                    target.input_global_scale.shape
                )
            # compressed-tensors packs the model's weight (torq's, in bf16) with these
            # scales itself; the codes it writes are checked against torq's below
            expected_codes[name] = _ct_codes(codes)
        else:
            exponent = scales.to(torch.int32) - 127  # E8M0: the same bytes once stored
            scale = torch.ldexp(torch.ones(exponent.shape), exponent)
        target.weight_scale.data = scale.reshape(target.weight_scale.shape).to(
            target.weight_scale.dtype
        )
    out = Path(out_dir)
    with _atomic_folder(out, overwrite) as tmp:
        compressor = ModelCompressor.from_pretrained_model(
            plain, quantization_format=None if high else fmt
        )
        compressor.compress_model(plain)
        for name, codes in expected_codes.items():
            written = plain.get_submodule(name).weight_packed
            if not torch.equal(written.cpu(), codes):
                raise TorqError(f"{name}: compressed-tensors packed other codes; nothing written")
        for name, values in expected_values.items():
            if not torch.equal(plain.get_submodule(name).weight.cpu().float(), values):
                raise TorqError(f"{name}: compressed-tensors rounded other values; nothing written")
        plain.save_pretrained(tmp)
        compressor.update_config(str(tmp))
        names_first(tmp)
        guard_for_transformers(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    _say_biased(biased)
    return out


def _export_through_checkpoint(
    model: nn.Module, out: Path, tokenizer: Any | None, overwrite: bool
) -> Path:
    """A model with fused MoE experts, written as torq's checkpoint in a scratch folder
    beside ``out`` and exported from it (:func:`export_saved_compressed_tensors`, which cuts
    the experts into one linear per expert as the engines read them)."""
    for name, m in model.named_modules():  # refused before anything is written
        if isinstance(m, QuantExperts):
            reads = [m.input_quantizer, *m.down_quantizers]
            if any(q.transform is not None for q in reads):
                raise TorqError(f"{name}: {EXPERTS_ROTATED}")
            if m.config.weight is not None and m.config.weight.name == "nvfp4":
                raise TorqError(f"{name}: {EXPERTS_NVFP4}")
    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as scratch:
        saved = save_quantized(model, Path(scratch) / "model", tokenizer)
        return export_saved_compressed_tensors(saved, out, overwrite=overwrite)


def _apply_schemes(
    model: nn.Module,
    kind: str | None,
    activations: bool,
    ignore: list[str],
    fmt: str = FORMAT,
    untransformed: list[str] | None = None,
    high: list[str] | None = None,
) -> None:
    """compressed-tensors' MXFP4 scheme (W4A4, or W4A16 without ``activations``), or its
    NVFP4A16 scheme (``fmt``), on every linear but ``ignore``, its MXFP8 scheme (W8A8 or
    W8A16) on the linears ``high`` names (a group of its own, which names them: an exact
    name outranks the class name), and with ``kind == "had32"`` the 32-block Hadamard's
    ``transform_config`` on every one but ``ignore`` and ``untransformed`` (the weights are
    fused already, torq's: the config only says so)."""
    from compressed_tensors import TRANSFORM_CONFIG_NAME
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import (
        MXFP4,
        MXFP4A16,
        MXFP8,
        MXFP8A16,
        NVFP4,
        NVFP4A16,
    )
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    if fmt == NVFP4_FORMAT:
        preset = NVFP4 if activations else NVFP4A16
    else:
        preset = MXFP4 if activations else MXFP4A16
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **preset)}
    if high:
        groups["group_0"].format = CompressionFormat(fmt)
        groups[_MXFP8_GROUP] = QuantizationScheme(
            targets=list(high),
            format=CompressionFormat(MXFP8_FORMAT),
            **(MXFP8 if activations else MXFP8A16),
        )
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=ignore))
    if kind == "had32":
        skip = ignore + list(untransformed or [])
        args = [
            TransformArgs(targets=["Linear"], location="input", ignore=skip),
            TransformArgs(targets=["Linear"], location="weight_input", inverse=True, ignore=skip),
        ]
        transform = TransformConfig(
            config_groups={
                _HADAMARD_GROUP: TransformScheme(type="hadamard", head_dim=32, apply=args)
            }
        )
        setattr(model, TRANSFORM_CONFIG_NAME, transform)


def _ct_codes(codes: torch.Tensor) -> torch.Tensor:
    """torq's packed E2M1 codes as compressed-tensors stores them: the same nibbles but for
    a rounded-to-zero value's sign (code 8, −0, becomes 0, +0; the same value)."""
    low, high = codes & 0x0F, codes >> 4
    low = torch.where(low == 8, torch.zeros_like(low), low)
    high = torch.where(high == 8, torch.zeros_like(high), high)
    return (high << 4) | low


_LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")


@torch.no_grad()
def _check_fused_scales(scales: dict[str, torch.Tensor | None]) -> None:
    """Refuse, in one line, NVFP4 linears that vLLM fuses into one (q/k/v, gate/up:
    :data:`~torq.surgery.qlinear.FUSED_LINEARS`) whose weights have different tensor scales:
    it reads the fused linear with one global scale, and so the others' weights wrong (a
    model quantized by an earlier torq)."""
    found: dict[tuple[str, int], set[float]] = {}
    for name, scale in scales.items():
        key = fused_set(name)
        if key is not None and scale is not None:
            found.setdefault(key, set()).add(float(scale))
    for (parent, i), values in sorted(found.items()):
        if len(values) > 1:
            raise TorqError(
                f"{parent}: {', '.join(FUSED_LINEARS[i])} hold different NVFP4 weight tensor "
                "scales, which vLLM reads as one fused linear's (quantized by an earlier "
                "torq): quantize the float model again; nothing written"
            )


def export_saved_compressed_tensors(
    folder: str | Path, out_dir: str | Path, overwrite: bool = False
) -> Path:
    """:func:`export_compressed_tensors` of a checkpoint torq saved (``--save-dir``), read and
    written one decoder layer at a time: the packed codes and scales as stored (−0 as +0),
    every other tensor in bf16, a shard per layer; memory of one layer, whatever the model's
    size. The same tensors as the whole-model export, bit for bit. Returns the folder."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    manifest = read_manifest(folder)
    tensors = _StoredTensors(_checkpoint_files(folder))
    modules: dict[str, dict[str, Any]] = manifest["modules"]
    (kind, plain), activations, fmt, biased, high = _saved_linears(
        folder, manifest, _built_transforms(manifest, tensors)
    )
    if fmt == NVFP4_FORMAT:
        keys = {n: f"{n}.weight_tensor_scale" for n in modules if n not in high}
        # the packed NVFP4 weights (a weight stored as values has no tensor scale)
        _check_fused_scales({n: tensors[k] for n, k in keys.items() if k in tensors})
    parts_of = ("weight_packed", "weight_scale") + (
        ("weight_global_scale",) if fmt == NVFP4_FORMAT else ()
    )
    if fmt == NVFP4_FORMAT and activations:
        parts_of += ("input_global_scale",)
    # compressed-tensors' MXFP8: the float8 weight under its own name, and the E8M0 scales
    parts = {n: ("weight", "weight_scale") if n in high else parts_of for n in modules}
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):  # the architecture's module names, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    ignore = [
        n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear) and n not in modules
    ]
    experts = {n: e for n, e in modules.items() if e["kind"] == "experts"}
    if experts:
        ignore.append(_ROUTERS)
    # the compressed folder's names: a quantized linear's weight is its packed codes and
    # scales; fused experts are written one linear per projection and expert
    expected = set(skeleton.state_dict()) - {f"{n}.weight" for n in modules}
    expected -= {f"{n}.{p}" for n in experts for p in ("gate_up_proj", "down_proj")}
    expected |= {f"{n}.{part}" for n in modules if n not in experts for part in parts[n]}
    expected |= {
        f"{linear}.{part}"
        for n, e in experts.items()
        for linear, *_ in expert_linears(n, config.model_type, e["gate_up_proj"]["shape"])
        for part in ("weight_packed", "weight_scale")
    }
    expected = {checkpoint_key(k, config.model_type) for k in expected}
    _apply_schemes(skeleton, kind, activations, ignore, fmt, plain, high)
    compressor = ModelCompressor.from_pretrained_model(
        skeleton, quantization_format=None if high else fmt
    )
    del skeleton
    # the tensors below are written compressed (what compress_model would leave)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    sources = _written_sources(
        manifest,
        tensors,
        fmt,
        activations,
        config.tie_word_embeddings,
        set(high),
        config.model_type,
    )
    missing = {k for k in expected if k not in sources}
    missing -= {k for k in missing if config.tie_word_embeddings and k.endswith("lm_head.weight")}
    unexpected = set(sources) - expected
    if missing or unexpected:
        raise TorqError(
            f"{folder}: its tensors do not fit its architecture (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    out = Path(out_dir)
    with _atomic_folder(out, overwrite) as tmp:
        _write_shards(tmp, sources, tensors, manifest)
        for extra in folder.iterdir():  # the tokenizer's and generation's files
            if (
                extra.is_file()
                and extra.suffix in (".json", ".txt", ".model", ".jinja")
                and extra.name not in (INDEX, "torq_quant.json", "config.json")
            ):
                shutil.copy2(extra, tmp / extra.name)
        config.dtype = torch.bfloat16  # what the folder holds
        config.save_pretrained(str(tmp))
        compressor.update_config(str(tmp))
        _ignored_on_disk(tmp, config.model_type)
        names_first(tmp)
        guard_for_transformers(tmp)
    _say_biased(biased)
    if experts:
        log.warning(EXPERTS_SERVED, len(experts))
    return out


def _saved_linears(
    folder: Path, manifest: dict[str, Any], transforms: list[nn.Module]
) -> tuple[tuple[str | None, list[str]], bool, str, list[str], list[str]]:
    """What a saved checkpoint's quantized linears hold, checked to be one scheme that
    compressed-tensors holds (with MXFP8 beside it): the transform's kind
    (:func:`_one_kind`), whether activations are quantized, the format, the linears with a
    bias under a transform, and those in MXFP8. Fused experts must hold the same scheme with
    no online transform (:func:`_check_experts`)."""
    kinds: dict[str, str | None] = {}
    acts: set[bool] = set()
    formats: dict[str, str] = {}
    biased: list[str] = []
    for name, entry in manifest["modules"].items():
        quantizer = manifest["quantizers"][entry["quantizer"]]
        static = quantizer.get("tensor_scale") is not None
        if entry["kind"] == "experts":
            _check_experts(name, entry, manifest)
            formats[name] = _scheme(entry["gate_up_proj"]["weight"], entry["activation"], name)
            acts.add(entry["activation"] is not None)
            continue
        w, a = entry["weight"], entry["activation"]
        formats[name] = _scheme(w, a, name, static)
        if entry["storage"] != "packed":
            raise TorqError(
                f"{name}: its weight is not stored packed (an NVFP4 weight saved before torq "
                "kept its tensor scale, or one off the format's grid); nothing written"
            )
        t_index = quantizer["transform"]
        t = None if t_index is None else transforms[t_index]
        kind = kinds[name] = _rotation_kind(t, name)
        if kind is not None and entry["bias"]:
            biased.append(name)
        acts.add(a is not None)
    if not formats:
        raise TorqError(f"{folder} has no quantized linears")
    if len(acts) > 1:
        raise TorqError("the quantized linears differ in transform or format")
    fmt, high = _split_formats(formats)
    return _one_kind(kinds), acts.pop(), fmt, biased, high


def _check_experts(name: str, entry: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Refuse, in one line, saved fused experts that compressed-tensors cannot serve as torq
    runs them: an online transform on their inputs (the engines run none inside the
    experts), NVFP4 (transformers reads NVFP4 experts without their tensor scale), a weight
    not stored packed."""
    quantizers = manifest["quantizers"]
    reads = [entry["quantizer"], *entry["down_quantizers"]]
    if any(quantizers[q]["transform"] is not None for q in reads):
        raise TorqError(f"{name}: {EXPERTS_ROTATED}")
    if (entry["gate_up_proj"]["weight"] or {}).get("name") == "nvfp4":
        raise TorqError(f"{name}: {EXPERTS_NVFP4}")
    if any(entry[p]["storage"] != "packed" for p in ("gate_up_proj", "down_proj")):
        raise TorqError(f"{name}: its weights are not stored packed; nothing written")


def expert_linears(
    name: str, model_type: str, shape: list[int]
) -> list[tuple[str, str, int, int, int]]:
    """Fused experts ``name`` (``gate_up_proj`` of ``shape`` ``[E, 2I, H]``) as linears,
    one per projection and expert, in :data:`EXPERT_LAYOUT` (named as in transformers'
    model: :func:`checkpoint_key` gives their names on disk): each ``(its name, the fused
    tensor it is cut from, expert, first row, end row)``."""
    layout = EXPERT_LAYOUT.get(model_type)
    if layout is None or not name.endswith(".mlp.experts"):
        raise TorqError(f"{name}: {MOE_NOT_EXPORTED}")
    gate, up, down = layout
    experts, rows = shape[0], shape[1] // 2
    out: list[tuple[str, str, int, int, int]] = []
    for e in range(experts):
        out += [
            (f"{name}.{e}.{gate}", "gate_up_proj", e, 0, rows),
            (f"{name}.{e}.{up}", "gate_up_proj", e, rows, 2 * rows),
            (f"{name}.{e}.{down}", "down_proj", e, 0, -1),
        ]
    return out


class _Source(NamedTuple):
    """What one tensor of the compressed folder is made from: the stored tensor, how it is
    converted, and for a fused expert's linear the rows it is cut from
    (``(expert, first, end)``, end ``-1``: all)."""

    stored: str
    how: str
    rows: tuple[int, int, int] | None = None


def _written_sources(
    manifest: dict[str, Any],
    tensors: _StoredTensors,
    fmt: str,
    activations: bool,
    tied: bool,
    high: set[str] | None = None,
    model_type: str = "",
) -> dict[str, _Source]:
    """What each tensor of the compressed folder is made from (:class:`_Source`), by its
    name; ``high``: the linears in MXFP8; fused experts are cut into one linear per
    projection and expert (:func:`expert_linears`, the layout of ``model_type``)."""
    modules: dict[str, dict[str, Any]] = manifest["modules"]
    sources: dict[str, _Source] = {}
    for name, entry in modules.items():
        if entry["kind"] == "experts":
            for linear, fused, e, start, end in expert_linears(
                name, model_type, entry["gate_up_proj"]["shape"]
            ):
                stored = f"{name}.{fused}"
                sources[f"{linear}.weight_packed"] = _Source(
                    f"{stored}_codes", "codes", (e, start, end)
                )
                sources[f"{linear}.weight_scale"] = _Source(
                    f"{stored}_scales", "scales", (e, start, end)
                )
            continue
        if name in (high or ()):
            sources[f"{name}.weight"] = _Source(f"{name}.weight_codes", "float8")
            sources[f"{name}.weight_scale"] = _Source(f"{name}.weight_scales", "scales")
            if entry["bias"]:
                sources[f"{name}.bias"] = _Source(f"{name}.bias", "bf16")
            continue
        sources[f"{name}.weight_packed"] = _Source(f"{name}.weight_codes", "codes")
        sources[f"{name}.weight_scale"] = _Source(
            f"{name}.weight_scales", "e4m3" if fmt == NVFP4_FORMAT else "scales"
        )
        if fmt == NVFP4_FORMAT:
            sources[f"{name}.weight_global_scale"] = _Source(
                f"{name}.weight_tensor_scale", "global"
            )
            if activations:  # kept in the manifest: the quantizer's static scale
                sources[f"{name}.input_global_scale"] = _Source(name, "input_global")
        if entry["bias"]:
            sources[f"{name}.bias"] = _Source(f"{name}.bias", "bf16")
    quantized_keys = {s.stored for s in sources.values() if s.how != "input_global"}
    for key in tensors:
        if key.startswith("torq.transforms.") or key in quantized_keys:
            continue
        sources[key] = _Source(key, "bf16")
    for alias, stored in (manifest.get("aliases") or {}).items():
        if not (tied and alias.endswith("lm_head.weight")):
            sources[alias] = _Source(stored, "bf16")
    return {checkpoint_key(k, model_type): v for k, v in sources.items()}


def _written_value(
    source: _Source, tensors: _StoredTensors, manifest: dict[str, Any]
) -> torch.Tensor:
    """A tensor of the compressed folder from the stored one (:func:`_written_sources`)."""
    stored, how, rows = source
    if how == "input_global":
        quantizer = manifest["quantizers"][manifest["modules"][stored]["quantizer"]]
        g_a = torch.tensor(quantizer["tensor_scale"], dtype=torch.float32)
        return (1.0 / g_a).reshape(1)
    if rows is None:
        value = tensors[stored]
    else:  # one expert's linear: its rows of the fused stack, read alone
        e, start, end = rows
        value = tensors.rows(stored, e, start, None if end < 0 else end)
    if how == "codes":
        return _ct_codes(value)
    if how == "float8":  # MXFP8's elements: torq stores their E4M3 bits as bytes
        return value.view(torch.float8_e4m3fn)
    if how == "e4m3":  # torq stores the E4M3 bits as bytes
        return value.view(torch.float8_e4m3fn)
    if how == "global":  # the loaders divide by it: torq's scale inverted
        return (1.0 / value.to(torch.float32)).reshape(1)
    if how == "bf16":
        return value.to(torch.bfloat16)
    return value


def _write_shards(
    tmp: Path,
    sources: dict[str, _Source],
    tensors: _StoredTensors,
    manifest: dict[str, Any],
) -> None:
    """The compressed folder's tensors, a shard per decoder layer (the rest: one shard),
    and their index."""
    from safetensors.torch import save_file

    parts: dict[str, list[str]] = {}
    for key in sorted(sources):
        m = _LAYER_KEY.search(key)
        parts.setdefault("outer" if m is None else f"layer-{int(m.group(1)):05d}", []).append(key)
    weight_map: dict[str, str] = {}
    total = 0
    for part, keys in parts.items():
        shard: dict[str, torch.Tensor] = {}
        for key in keys:
            value = _written_value(sources[key], tensors, manifest).contiguous()
            shard[key] = value
            total += value.numel() * value.element_size()
        file = f"model-{part}.safetensors"
        save_file(shard, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def is_compressed_tensors_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a compressed-tensors checkpoint (its ``config.json`` names
    the quantization method); a ``config.json`` that is not JSON is refused in one line."""
    config = Path(folder).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TorqError(f"{config} is not valid JSON ({exc})") from None
    qconfig = data.get("quantization_config") if isinstance(data, dict) else None
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == "compressed-tensors"


# what torq quantize writes beside a checkpoint: its recipe, method and run record
QUANTIZE_RECORD = "torq_quantize.json"


def compressed_tensors_manifest(folder: str | Path) -> dict[str, Any]:
    """A compressed-tensors folder described as torq describes its own saved checkpoints
    (``method``: the one ``torq quantize`` recorded, else ``"compressed-tensors"``)."""
    record = Path(folder).expanduser() / QUANTIZE_RECORD
    method = "compressed-tensors"
    if record.is_file():
        try:
            method = json.loads(record.read_text()).get("method") or method
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise TorqError(f"{record} is not valid JSON: write the folder again") from None
    return {"method": method, "modules": {}, "format": "compressed-tensors"}


# the loader a folder with online transforms carries (a copy of torq.export.modeling_torq)
MODELING_FILE = "modeling_torq.py"


def _has_online_transforms(qconfig: dict[str, Any]) -> bool:
    groups = (qconfig.get("transform_config") or {}).get("config_groups") or {}
    return any(
        not str(a.get("location", "")).startswith("weight")
        for g in groups.values()
        for a in g.get("apply", [])
    )


def _ignored_on_disk(folder: Path, model_type: str) -> None:
    """The linears ``folder``'s ``config.json`` leaves unquantized, named as on disk
    (:func:`checkpoint_key`: what vLLM matches them against)."""
    if model_type not in CHECKPOINT_NAMES:
        return
    path = folder / "config.json"
    config = json.loads(path.read_text())
    qconfig = config["quantization_config"]
    qconfig["ignore"] = [checkpoint_key(n, model_type) for n in qconfig.get("ignore") or []]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def names_first(folder: Path) -> None:
    """Put the config groups that name their linears (a precision budget's MXFP8 group)
    before the one that targets every ``Linear`` in ``folder``'s ``config.json``:
    compressed-tensors gives an exact name the priority either way, but it walks the
    targets in order and warns, once per named linear, of each name the class matched
    first."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    groups = config["quantization_config"].get("config_groups") or {}
    if len(groups) < 2:
        return
    order = sorted(groups, key=lambda g: "Linear" in groups[g].get("targets", []))
    # renamed in that order: the config is written with its keys sorted
    config["quantization_config"]["config_groups"] = {
        f"group_{i}": groups[g] for i, g in enumerate(order)
    }
    path.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")


def guard_for_transformers(folder: Path) -> bool:
    """Make a folder with online transforms load right through transformers or not at all:
    copy :mod:`torq.export.modeling_torq` into it, name it in ``config.json``'s
    ``auto_map`` (``from_pretrained(folder, trust_remote_code=True)`` attaches the
    transforms), and nest the refusing quantization config that a plain ``from_pretrained``
    stops on (vLLM reads the outer one). Whether the folder needed it."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    qconfig = config["quantization_config"]
    if not _has_online_transforms(qconfig):
        return False
    shutil.copyfile(Path(__file__).with_name(MODELING_FILE), folder / MODELING_FILE)
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_torq.TorqForCausalLM"}
    qconfig[NESTED_KEY] = refusing_config()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True


def load_compressed_tensors(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A compressed-tensors folder through transformers, with the online transforms of its
    ``transform_config`` attached again: :class:`torq.export.modeling_torq.TorqForCausalLM`,
    the loader such a folder carries."""
    from transformers import AutoConfig

    folder = Path(folder)
    try:
        json.loads((folder / "config.json").read_text())["quantization_config"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise TorqError(f"{folder} is not a compressed-tensors checkpoint") from None
    config = AutoConfig.from_pretrained(str(folder))
    try:
        return TorqForCausalLM.from_pretrained(str(folder), config=config, dtype=dtype)
    except ValueError as exc:
        raise TorqError(f"{folder}: {exc}") from None
