"""``benchmarks/tiny_folder.py``: a tiny folder of an architecture that loads as that
architecture, and a data folder a run reads."""

from __future__ import annotations

import sys

import pytest
import torch
from benchmarks import tiny_folder

import torq


@pytest.mark.parametrize(("model_type", "loaded"), [("granite", "GraniteForCausalLM"),
                                                    ("gemma3", "Gemma3ForCausalLM")])  # fmt: skip
def test_a_tiny_folder_loads_as_its_architecture_with_heads_of_64(
    model_type, loaded, tmp_path, monkeypatch
) -> None:
    out, data = tmp_path / model_type, tmp_path / "data"
    argv = ["tiny_folder.py", model_type, str(out), "--data-dir", str(data)]
    monkeypatch.setattr(sys, "argv", argv)
    tiny_folder.main()
    model = torq.load(out)  # a model of text and images: its language model
    assert type(model).__name__ == loaded
    assert model.config.head_dim == 64
    ids = model.tokenizer("the game", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert (data / "wikitext-2-raw" / "wiki.test.raw").stat().st_size > 100_000
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):  # never over a folder that holds something
        tiny_folder.main()
