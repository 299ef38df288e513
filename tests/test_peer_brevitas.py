"""``benchmarks/peers/brevitas_mxfp4.py``: Brevitas's data loader returns torq's windows, its
GPxQ loop's ``"cuda"`` moves go to the CPU, and the ``prepare`` step refuses in one line.

Brevitas is not in torq's environment (it has its own); these stand-in modules carry only
the two functions the script replaces, under the names Brevitas's LLM example defines them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import brevitas_mxfp4


@pytest.fixture
def brevitas_stand_in(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    moves: list[str] = []
    gpxq = ModuleType("brevitas_examples.llm.llm_quant.gpxq")

    def send_to_device(obj: Any, device: Any, *_: Any, **__: Any) -> Any:
        moves.append(str(device))
        return obj

    gpxq.send_to_device = send_to_device  # type: ignore[attr-defined]
    gpxq.moves = moves  # type: ignore[attr-defined]
    main = ModuleType("brevitas_examples.llm.main")
    main.get_dataset_for_model = None  # type: ignore[attr-defined]
    modules = {
        "brevitas_examples": ModuleType("brevitas_examples"),
        "brevitas_examples.llm": ModuleType("brevitas_examples.llm"),
        "brevitas_examples.llm.llm_quant": ModuleType("brevitas_examples.llm.llm_quant"),
        "brevitas_examples.llm.llm_quant.gpxq": gpxq,
        "brevitas_examples.llm.main": main,
    }
    modules["brevitas_examples"].llm = modules["brevitas_examples.llm"]  # type: ignore[attr-defined]
    modules["brevitas_examples.llm"].llm_quant = modules["brevitas_examples.llm.llm_quant"]  # type: ignore[attr-defined]
    modules["brevitas_examples.llm"].main = main  # type: ignore[attr-defined]
    modules["brevitas_examples.llm.llm_quant"].gpxq = gpxq  # type: ignore[attr-defined]
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return modules


def _data() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "calib": torch.randint(0, 100, (6, 32), generator=gen),
        "windows": torch.randint(0, 100, (3, 32), generator=gen),
        "calibration": {"corpus": "wikitext2-valid", "seed": 0},
    }


def test_loader_returns_torq_calibration_windows(
    brevitas_stand_in: dict[str, ModuleType],
) -> None:
    data = _data()
    substitutes = brevitas_mxfp4.install_substitutes(data, nsamples=4)
    loader = brevitas_stand_in["brevitas_examples.llm.main"].get_dataset_for_model
    train = loader("wikitext2", None, nsamples=4, seqlen=32, split="train")
    got = torch.tensor([row["input_ids"] for row in train]).squeeze(1)
    assert torch.equal(got, data["calib"][:4])
    assert "4 x 32 tokens of wikitext2-valid" in substitutes["data_utils.get_dataset_for_model"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU redirect applies without a GPU")
def test_gpxq_cuda_moves_go_to_the_cpu(brevitas_stand_in: dict[str, ModuleType]) -> None:
    substitutes = brevitas_mxfp4.install_substitutes(_data(), nsamples=4)
    gpxq = brevitas_stand_in["brevitas_examples.llm.llm_quant.gpxq"]
    x = torch.ones(2)
    assert gpxq.send_to_device(x, "cuda") is x
    gpxq.send_to_device(x, "cpu")
    assert gpxq.moves == ["cpu", "cpu"]
    assert "llm_quant.gpxq.send_to_device" in substitutes


@pytest.mark.parametrize(
    ("model", "out", "message"),
    [
        ("smollm2-135m", None, "--out is required"),
        ("tiny-llama", "w.pt", "a random smoke-test model has no folder"),
    ],
)
def test_prepare_refuses_in_one_line(model: str, out: str | None, message: str) -> None:
    args = argparse.Namespace(model=model, out=out)
    with pytest.raises(SystemExit, match=f"brevitas_mxfp4 prepare: {message}"):
        brevitas_mxfp4.prepare(args)
