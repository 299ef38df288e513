"""WUSH's block transform: its closed form balances the weight and activation Grams of
each block; as a method it is the same function in float, streams as the whole model,
saves and loads in torq's checkpoint, composes with GPTQ and GPTAQ, and is refused by
compressed-tensors with its reason."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import calibrated_context, tiny_model
from tests.test_driver import _config, _save
from tests.whole_model import whole_model_run
from torq.driver import apply_method
from torq.errors import TorqError
from torq.methods import get_method
from torq.pipeline import run
from torq.rotations.block_transform import BlockMatrices, block_grams, wush_matrices
from torq.surgery import QuantConfig, QuantLinear


def test_wush_balances_the_weight_and_activation_grams_of_each_block() -> None:
    """``W_b T_b⁻¹`` and ``T_b x_b`` have the same Gram (``H Λ^{1/2} Hᵀ``), the fused layer
    computes the same function, and ``T H Tᵀ`` is the transformed inputs' Gram."""
    gen = torch.Generator().manual_seed(0)
    d, n_out, tokens = 96, 40, 500
    w = torch.randn(n_out, d, generator=gen, dtype=torch.float64)
    scale = torch.exp(torch.randn(d, generator=gen, dtype=torch.float64))
    x = torch.randn(tokens, d, generator=gen, dtype=torch.float64) * scale
    t = BlockMatrices(
        wush_matrices(block_grams(w.T @ w, 32), block_grams(x.T @ x / tokens, 32), damp=0.0),
        dtype=torch.float64,
    )
    fused, z = t.fuse_inverse(w), t(x)
    assert torch.allclose(fused @ z.T, w @ x.T, atol=1e-9)
    assert torch.allclose(block_grams(fused.T @ fused, 32), block_grams(z.T @ z / tokens, 32))
    assert torch.allclose(t.conjugate_hessian(x.T @ x), z.T @ z, rtol=1e-9, atol=1e-6)
    with pytest.raises(ValueError, match="does not match"):
        t(x[:, :64])


def test_wush_is_the_same_function_in_float(tiny_tokenizer, tiny_calibration_data_dir) -> None:
    corpus = str(tiny_calibration_data_dir / "wikitext-2" / "wiki.valid.tokens")
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    record = apply_method(
        get_method("wush"),
        model,
        QuantConfig(None, None),
        calibrated_context(tiny_tokenizer, corpus),
    )
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    qlinears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(isinstance(m.input_transform, BlockMatrices) for m in qlinears)
    conds = [
        g["wush"]["max_condition"]
        for layer in record["layers"]
        for g in layer.values()
        if isinstance(g, dict) and "wush" in g
    ]
    assert conds and all(math.isfinite(c) for c in conds)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_wush_streams_saves_and_composes(arch, tmp_path, tiny_calibration_data_dir, tiny_tokenizer):
    """Streamed it is the whole model bit for bit, with GPTQ and GPTAQ weights too; the
    folder it saves loads to the same perplexity; compressed-tensors says why not."""
    data_dir = tiny_calibration_data_dir
    folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    methods = ["wush", "wush+gptq", "wush+gptaq"]
    whole = whole_model_run(_config(folder, data_dir, methods))
    streamed = run(_config(folder, data_dir, methods, save_dir=str(tmp_path / "s")), progress=False)
    assert [r["ppl"] for r in streamed["rows"]] == [r["ppl"] for r in whole["rows"]]
    assert len({r["ppl"] for r in streamed["rows"]}) == 3
    saved = Path(streamed["rows"][1]["details"]["saved"]["path"])
    again = run(_config(saved, data_dir, ["wush+gptq"]), progress=False)
    assert again["rows"][0]["ppl"] == streamed["rows"][1]["ppl"]
    with pytest.raises(TorqError, match="WUSH's data-aware block transforms"):
        run(
            _config(
                folder,
                data_dir,
                ["wush"],
                save_dir=str(tmp_path / "ct"),
                save_format="compressed-tensors",
            ),
            progress=False,
        )
