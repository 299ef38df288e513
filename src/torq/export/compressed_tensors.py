"""Export to compressed-tensors, the format transformers and vLLM load (issue 28, first part).

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
32-block Hadamard alone online), QuaRot's full-width rotations, fused MoE experts, a linear
with a bias under a transform (vLLM cannot run that combination), formats other than MXFP4.

Tensors outside the quantized linears are written in bf16 (transformers loads this format in
bf16; float32 fails in its decompression): a float32 embedding or norm not exact in bf16 is
rounded there. The quantized weights lie on the E2M1 grid times powers of two, exact in bf16,
and pack to torq's own codes except the sign of zero (compressed-tensors stores +0 where torq
keeps the sign of a value that rounded to zero; the same value).

:func:`load_compressed_tensors` loads such a folder through transformers and attaches the
online transforms again with compressed-tensors' own ``apply_transform_config``, since
transformers' compressed-tensors loader leaves them out without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torq.errors import TorqError
from torq.export.checkpoint import _atomic_folder
from torq.formats import dequantize, quantize
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantExperts, QuantLinear

FORMAT = "mxfp4-pack-quantized"
EXPORTABLE_METHODS = ("rtn", "gptq", "had32", "had32+gptq", "torq-had32", "torq-had32+gptq")
# methods whose channel balancing must be folded (--fold-balance) to leave H32 alone online
FOLDED_METHODS = ("torq-had32", "torq-had32+gptq")
EXPORTABLE = (
    f"{', '.join(EXPORTABLE_METHODS)} (MXFP4 weights; MXFP4 or float activations; "
    f"{', '.join(FOLDED_METHODS)} with --fold-balance)"
)
_HADAMARD_GROUP = "torq_had32"


def _transform_kind(module: QuantLinear, name: str) -> str | None:
    """``None`` (no online transform) or ``"had32"``; anything else is refused."""
    t = module.input_quantizer.transform
    if t is None:
        return None
    if (
        isinstance(t, BlockRotation)
        and t.block_size == 32
        and t.r_inter is None
        and t.channel_scale is None
        and t.r_intra is not None
        and torch.equal(t.r_intra.cpu(), hadamard_matrix(32, dtype=t.r_intra.dtype))
    ):
        if module.bias is not None:
            raise TorqError(
                f"{name} has a bias under its online Hadamard: vLLM cannot run a transform on a "
                "linear with a bias (Qwen2's q/k/v); export this model without a transform "
                "(rtn, gptq)"
            )
        return "had32"
    what = (
        "torq's channel balancing, done online (quantize with --fold-balance to fold it)"
        if isinstance(t, BlockRotation) and t.channel_scale is not None
        else "TORQ's calibrated rotations or QuaRot's full-width Hadamard"
    )
    raise TorqError(
        f"{name}: its online transform ({what}) has no compressed-tensors form yet; "
        f"exportable: {EXPORTABLE}"
    )


def _plan(model: nn.Module) -> tuple[dict[str, QuantLinear], str | None, bool]:
    """The quantized linears, their one transform kind, and whether activations are
    quantized; every module must agree (the format holds one scheme for all here)."""
    linears: dict[str, QuantLinear] = {}
    kinds, acts = set(), set()
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            raise TorqError(f"{name}: fused MoE experts are not exported yet; {EXPORTABLE}")
        if not isinstance(module, QuantLinear):
            continue
        w, a = module.config.weight, module.config.activation
        if w is None or w.name != "mxfp4" or w.block_size != 32:
            raise TorqError(f"{name}: only MXFP4 weights (blocks of 32) are exported yet")
        if a is not None and (a.name != "mxfp4" or a.block_size != 32):
            raise TorqError(f"{name}: activations must be MXFP4 (blocks of 32) or float")
        kinds.add(_transform_kind(module, name))
        acts.add(a is not None)
        linears[name] = module
    if not linears:
        raise TorqError("the model has no quantized linears: quantize it first (torq.methods)")
    if len(kinds) > 1 or len(acts) > 1:
        raise TorqError("the quantized linears differ in transform or activation format")
    return linears, kinds.pop(), acts.pop()


@torch.no_grad()
def export_compressed_tensors(
    model: nn.Module, out_dir: str | Path, tokenizer: Any | None = None, overwrite: bool = False
) -> Path:
    """Write a model quantized by torq (its fake-quant :class:`QuantLinear` modules,
    Algorithm 3 option B: ``Q_w(W Tᵀ)`` with ``T`` online) as a compressed-tensors folder
    that transformers and vLLM load (module doc). Returns the folder."""
    from compressed_tensors import TRANSFORM_CONFIG_NAME
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import MXFP4, MXFP4A16
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
    from transformers import AutoModelForCausalLM

    linears, kind, activations = _plan(model)
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
    scheme = QuantizationScheme(targets=["Linear"], **(MXFP4 if activations else MXFP4A16))
    ignore = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and n not in linears]
    apply_quantization_config(
        plain, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    )
    for name, module in linears.items():
        weight = module.weight.detach().float().cpu()
        packed = quantize(weight, module.config.weight)
        if not torch.equal(dequantize(packed, torch.float32), weight):
            raise TorqError(f"{name}: its weight is not on the MXFP4 grid; nothing written")
        target = plain.get_submodule(name)
        exponent = packed.scales.to(torch.int32) - 127  # E8M0: the same bytes once stored
        scale = torch.ldexp(torch.ones(exponent.shape), exponent)
        target.weight_scale.data = scale.reshape(target.weight_scale.shape).to(
            target.weight_scale.dtype
        )
    if kind == "had32":
        args = [
            TransformArgs(targets=["Linear"], location="input", ignore=ignore),
            TransformArgs(targets=["Linear"], location="weight_input", inverse=True, ignore=ignore),
        ]
        transform = TransformConfig(
            config_groups={
                _HADAMARD_GROUP: TransformScheme(type="hadamard", head_dim=32, apply=args)
            }
        )
        # the weights are fused already (torq's): the config only says so
        setattr(plain, TRANSFORM_CONFIG_NAME, transform)
    out = Path(out_dir)
    with _atomic_folder(out, overwrite) as tmp:
        compressor = ModelCompressor.from_pretrained_model(plain, quantization_format=FORMAT)
        compressor.compress_model(plain)
        plain.save_pretrained(tmp)
        compressor.update_config(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def load_compressed_tensors(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A compressed-tensors folder through transformers, with the online transforms of its
    ``transform_config`` attached again (compressed-tensors' ``apply_transform_config``,
    their ``input`` parts only: the ``weight_input`` parts are in the stored weights)."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from compressed_tensors.transform.factory.base import TransformBase
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    try:
        qconfig = json.loads((folder / "config.json").read_text())["quantization_config"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise TorqError(f"{folder} is not a compressed-tensors checkpoint") from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    data = qconfig.get("transform_config") or {}
    if not data.get("config_groups"):
        return model.eval()
    if any(isinstance(m, TransformBase) for m in model.modules()):
        return model.eval()  # a transformers that attaches them itself
    config = TransformConfig.model_validate(data)
    for group in config.config_groups.values():
        if group.type != "hadamard":
            raise TorqError(f"{folder}: transform type {group.type!r} is not re-attached by torq")
        group.apply = [a for a in group.apply if a.is_online()]
    apply_transform_config(model, config)
    return model.eval()
