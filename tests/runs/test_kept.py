"""Keeping a quantized model in a resume directory and reading it back (torq.runs.kept)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY_TEXT, calibrated_context, tiny_model
from torq.driver import apply_method
from torq.errors import TorqError
from torq.methods import METHODS, MethodContext, get_method
from torq.runs.kept import MODEL_FILE, MODEL_INFO, keep_model, load_kept_model
from torq.surgery import QuantConfig

QUANTIZING = sorted(name for name, cls in METHODS.items() if cls.quantizes)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, tiny_tokenizer) -> MethodContext:
    corpus = tmp_path_factory.mktemp("calib") / "corpus.txt"
    corpus.write_text(TINY_TEXT * 30, encoding="utf-8")
    return calibrated_context(tiny_tokenizer, str(corpus), 2, 32, max_iter=1, reservoir=32)


def _ids(tokenizer) -> torch.Tensor:
    return tokenizer(TINY_TEXT, return_tensors="pt").input_ids[:, :40]


@pytest.mark.parametrize("method", [*QUANTIZING, "torq+gptq"])
def test_every_method_reads_back_the_same(method, ctx, tiny_tokenizer, tmp_path) -> None:
    """Every registered quantizing method (and a GPTQ composition) on a tiny llama: the model
    read back computes exactly what the kept one did, and the info comes back with it."""
    model = tiny_model("llama")
    apply_method(get_method(method), model, QuantConfig.from_names("mxfp4", "mxfp4", "ocp"), ctx)
    ids = _ids(tiny_tokenizer)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    keep_model(tmp_path, model, ids[:, :8], {"method": method, "quantize_seconds": 1.5})
    kept = load_kept_model(tmp_path, ids[:, :8])
    assert kept is not None
    again, info = kept
    assert again is not model
    assert (info["method"], info["quantize_seconds"]) == (method, 1.5)
    assert info["load_seconds"] >= 0.0
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, before)


def test_every_architecture_reads_back_the_same(arch, ctx, tiny_tokenizer, tmp_path) -> None:
    model = tiny_model(arch)
    apply_method(get_method("torq"), model, QuantConfig.from_names("mxfp4", "mxfp4", "ocp"), ctx)
    ids = _ids(tiny_tokenizer)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    keep_model(tmp_path, model, ids[:, :8], {})
    kept = load_kept_model(tmp_path, ids[:, :8])
    assert kept is not None
    with torch.no_grad():
        assert torch.equal(kept[0](input_ids=ids).logits, before)


def test_incomplete_damaged_and_stale_models(tiny_tokenizer, tmp_path) -> None:
    ids = _ids(tiny_tokenizer)[:, :8]
    assert load_kept_model(tmp_path, ids) is None  # nothing kept
    model = tiny_model("llama")
    keep_model(tmp_path, model, ids, {})
    assert not list(tmp_path.glob("*.tmp"))

    (tmp_path / MODEL_INFO).rename(tmp_path / "info.json")  # a stop before the info
    assert load_kept_model(tmp_path, ids) is None
    (tmp_path / "info.json").rename(tmp_path / MODEL_INFO)

    info = json.loads((tmp_path / MODEL_INFO).read_text())
    info["fingerprint"][3] += 0.5  # kept by code that computed something else
    (tmp_path / MODEL_INFO).write_text(json.dumps(info))
    with pytest.raises(TorqError, match="no longer computes what it did"):
        load_kept_model(tmp_path, ids)

    (tmp_path / MODEL_FILE).write_bytes(b"not a pickle")
    with pytest.warns(UserWarning, match="could not be read back"):
        assert load_kept_model(tmp_path, ids) is None
