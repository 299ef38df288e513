"""GPTQ as a method and composed with transforms, end to end on tiny models."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import TINY_TEXT, calibrated_context, tiny_model
from torq.driver import apply_method
from torq.errors import TorqError
from torq.formats import fake_quantize, get_format
from torq.methods import MethodContext, get_method
from torq.surgery import QuantConfig, QuantLinear


def _ctx(corpus: str, tokenizer) -> MethodContext:
    return calibrated_context(tokenizer, corpus)


def test_names_compose() -> None:
    assert get_method("gptq").name == "gptq"
    assert get_method("rtn+gptq").name == "gptq"
    m = get_method("torq+gptq")
    assert m.name == "torq+gptq" and m.gptq_enabled
    assert get_method("had32+GPTQ").gptq_enabled
    assert not get_method("torq").gptq_enabled
    with pytest.raises(TorqError, match="composes with"):
        get_method("fp+gptq")


@pytest.mark.parametrize("method", ["gptq", "had32+gptq", "quarot+gptq", "torq+gptq", "mr-gptq"])
def test_gptq_weights_are_on_the_grid_and_beat_rtn(method, corpus, tiny_tokenizer) -> None:
    """Weight-only MXFP4: the GPTQ variant's weights lie on the grid, and on the calibration
    text its logits are closer to the float model's than the same method with RTN weights."""
    model = tiny_model("llama")
    fmt = get_format("mxfp4")
    qconfig = QuantConfig(fmt, None)
    ids = tiny_tokenizer(TINY_TEXT * 3, return_tensors="pt").input_ids[:, :96]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    errors = {}
    for name in (method, method.replace("+gptq", "") if "+" in method else "rtn"):
        q = copy.deepcopy(model)
        record = apply_method(get_method(name), q, qconfig, _ctx(corpus, tiny_tokenizer))
        json.dumps(record)
        with torch.no_grad():
            errors[name] = float((q(input_ids=ids).logits - ref).norm() / ref.norm())
        if name == method:
            qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
            assert len(qlinears) == 7 * model.config.num_hidden_layers
            for m in qlinears:
                assert torch.equal(fake_quantize(m.weight, fmt), m.weight)
    gptq_err, rtn_err = errors[method], errors[next(n for n in errors if n != method)]
    assert gptq_err < rtn_err, errors
