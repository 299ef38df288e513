"""A precision budget (``--avg-bits``): the input groups that hurt most kept in MXFP8, the
average reached, the folder that holds both schemes and loads through transformers, and bad
budgets refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch

import torq
from tests.conftest import tiny_model
from torq.cli import main
from torq.driver.budget import (
    GroupCost,
    PrecisionBudget,
    choose_high_precision,
    measure_sensitivity,
)
from torq.errors import TorqError
from torq.formats import fake_quantize, get_format, pack_exact, quantize
from torq.models.streaming import ModelLayers
from torq.surgery.qlinear import QuantConfig, QuantLinear

pytest.importorskip("compressed_tensors")

CALIB = {"calib_samples": 2, "calib_seqlen": 32}
CALIB_ARGS = ["--calib-samples", "2", "--calib-seqlen", "32", "--no-progress"]


def test_mxfp8_rounds_to_e4m3_with_the_ocp_scale_and_packs_a_byte_per_element() -> None:
    """MXFP8: ``X = 2^(floor(log2 amax) − 8)``, elements E4M3 (ties to even, saturating at
    448), the packed codes the float8 bytes, and the packed form gives the values back."""
    fmt = get_format("mxfp8")
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, 0.3, 1.99  # amax 1.99: X = 2^(0 − 8)
    y = fake_quantize(x, fmt)
    scaled = x / 2.0**-8
    expected = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float() * 2.0**-8
    assert torch.equal(y, expected)
    assert y[0, 2] == 448 * 2.0**-8  # 1.99 · 256 = 509 saturates at 448
    p = quantize(torch.randn(4, 64), fmt)
    assert p.codes.shape == (4, 64) and p.scales.shape == (4, 2)
    w = fake_quantize(torch.randn(8, 96), fmt)
    packed = pack_exact(w, fmt)
    assert packed is not None and torch.equal(packed.dequantize(), w)


def _cost(layer: int, name: str, weights: int, block: float) -> GroupCost:
    return GroupCost(layer, name, [f"layers.{layer}.{name}"], weights, block=block, linear=0.0)


def test_the_budget_keeps_the_most_sensitive_groups_per_weight_that_fit() -> None:
    """Greedy by sensitivity per weight, each group while it fits: at 4.25 + 4·(300/1000)
    bits the two groups of most error per weight (100 and 200 weights) fit, the 500-weight
    one of most error does not; the baselines take theirs in their own order."""
    costs = [
        _cost(0, "a", 500, 5.0),  # 0.01 per weight
        _cost(0, "b", 100, 3.0),  # 0.03
        _cost(1, "c", 200, 4.0),  # 0.02
        _cost(1, "d", 200, 0.1),
    ]
    budget = PrecisionBudget(4.25 + 4 * 300 / 1000)
    chosen = choose_high_precision(costs, budget, 4.25)
    assert [c.name for c in chosen] == ["b", "c"]
    assert choose_high_precision(costs, PrecisionBudget(4.25), 4.25) == []
    assert len(choose_high_precision(costs, PrecisionBudget(8.25), 4.25)) == 4
    ends = choose_high_precision(costs, PrecisionBudget(4.25 + 4 * 0.6, by="ends"), 4.25)
    assert [c.name for c in ends] == ["a", "b"]  # layer 0 first
    randomly = choose_high_precision(costs, PrecisionBudget(6.0, by="random", seed=1), 4.25)
    again = choose_high_precision(costs, PrecisionBudget(6.0, by="random", seed=1), 4.25)
    assert [c.name for c in randomly] == [c.name for c in again]


def test_sensitivity_is_measured_per_input_group_and_leaves_the_layers_as_they_were() -> None:
    """One cost per input group (q/k/v, o, gate/up, down) of every layer, positive, the
    layers' float weights unchanged afterwards."""
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = torch.randint(0, model.config.vocab_size, (2, 32))
    costs = measure_sensitivity(
        ModelLayers(model), windows, QuantConfig.from_names("mxfp4", "mxfp4")
    )
    layers = model.config.num_hidden_layers
    assert len(costs) == 4 * layers
    assert {c.name for c in costs} == {
        "q_proj+k_proj+v_proj",
        "o_proj",
        "gate_proj+up_proj",
        "down_proj",
    }
    assert all(c.block > 0 and c.linear > 0 for c in costs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not [m for m in model.modules() if isinstance(m, QuantLinear)]


def test_avg_bits_keeps_groups_in_mxfp8_and_the_folder_loads_through_transformers(
    tiny_checkpoint, tiny_calibration_data_dir, tmp_path
) -> None:
    """``torq quantize --avg-bits``: the chosen groups are MXFP8 W8A8 (the record says which
    and the average reached, at most the budget), the folder holds two compressed-tensors
    config groups, loads through transformers, and computes what torq's own model does."""
    data = str(tiny_calibration_data_dir)
    out = tmp_path / "q"
    argv = ["quantize", str(tiny_checkpoint), "--out", str(out), "--avg-bits", "6"]
    assert main([*argv, "--data-dir", data, *CALIB_ARGS]) == 0
    record = json.loads((out / "torq_quantize.json").read_text())["record"]
    budget = record["rows"][0]["details"]["precision_budget"]
    assert 4.25 < budget["reached_bits"] <= 6.0
    assert "precision budget:" in (out / "README.md").read_text()
    high = [g for g in budget["groups"] if g["high"]]
    assert high
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    schemes = {
        (g["weights"]["num_bits"], g["input_activations"]["num_bits"], g["format"])
        for g in config["config_groups"].values()
    }
    assert schemes == {(4, 4, "mxfp4-pack-quantized"), (8, 8, "mxfp8-quantized")}
    # the named group first: compressed-tensors then matches each name without a warning
    assert config["config_groups"]["group_0"]["targets"] != ["Linear"]
    model = torq.quantize(str(tiny_checkpoint), data_dir=data, progress=False, avg_bits=6, **CALIB)
    eights = {
        n for n, m in model.named_modules()
        if isinstance(m, QuantLinear) and m.config.weight.name == "mxfp8"
    }  # fmt: skip
    assert eights and all(model.get_submodule(n).config.activation.name == "mxfp8" for n in eights)
    chosen = model.torq.record["precision_budget"]["groups"]
    assert [g["high"] for g in chosen] == [g["high"] for g in budget["groups"]]
    loaded = torq.load(out)
    ours = torq.evaluate(
        model.to(torch.bfloat16), seqlen=32, max_windows=4, data_dir=data, progress=False
    )
    theirs = torq.evaluate(loaded, seqlen=32, max_windows=4, data_dir=data, progress=False)
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=0.01)


def test_more_bits_bring_the_model_closer_to_float(tiny_checkpoint, tiny_calibration_data_dir):
    """All MXFP8 (8.25 bits) is closer to the float model's logits than all MXFP4, and the
    budget in between is no farther than all MXFP4."""
    from transformers import AutoModelForCausalLM

    data = str(tiny_calibration_data_dir)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    ids = torch.arange(2, 34).view(1, 32)
    with torch.no_grad():
        ref = float_model(input_ids=ids).logits
    errors = []
    for bits in (None, 6.0, 8.25):
        model = torq.quantize(
            str(tiny_checkpoint), data_dir=data, progress=False, avg_bits=bits, **CALIB
        )
        with torch.no_grad():
            errors.append(float((model(input_ids=ids).logits - ref).pow(2).mean()))
    assert errors[2] < errors[1] <= errors[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--avg-bits", "4.2"], "outside what MXFP4"),
        (["--avg-bits", "9"], "at most 8.25"),
        (["--avg-bits", "five"], "number of bits"),
        (["--avg-bits", "5", "--budget-by", "middle"], "invalid choice"),
    ],
)
def test_a_budget_that_cannot_be_kept_is_one_line(
    tiny_checkpoint, tmp_path, capsys, args, message
) -> None:
    try:
        code = main(["quantize", str(tiny_checkpoint), "--out", str(tmp_path / "q"), *args])
    except SystemExit as stop:  # refused by the argument parser
        code = stop.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "q").exists()


def test_the_python_budget_refuses_in_one_line(tiny_checkpoint) -> None:
    with pytest.raises(TorqError, match="outside what MXFP4"):
        torq.quantize(str(tiny_checkpoint), avg_bits=4.1, progress=False)


def test_a_budgeted_model_saved_in_torqs_format_loads_back_the_same(
    tiny_checkpoint, tiny_calibration_data_dir, tmp_path
) -> None:
    """torq's own checkpoint keeps each MXFP8 linear packed (a byte per element) and gives
    the same logits back."""
    data = str(tiny_calibration_data_dir)
    model = torq.quantize(str(tiny_checkpoint), data_dir=data, progress=False, avg_bits=5, **CALIB)
    out = torq.save(model, tmp_path / "torq-format", format="torq")
    loaded = torq.load(out)
    eights = [
        n for n, m in loaded.named_modules()
        if isinstance(m, QuantLinear) and m.config.weight.name == "mxfp8"
    ]  # fmt: skip
    assert eights
    ids = torch.arange(2, 34).view(1, 32)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_linears_kept_in_float_are_left_out_of_the_budget() -> None:
    """A group with a member ``--ignore`` keeps in float is measured, and costs, without it;
    a group wholly ignored is not measured."""
    model = tiny_model("llama")
    windows = torch.randint(0, model.config.vocab_size, (2, 32))
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4", ignore=("q_proj", "layers.0.mlp.*"))
    costs = measure_sensitivity(ModelLayers(model), windows, qconfig)
    attention = [c for c in costs if "k_proj" in c.name]
    assert attention and all(not any("q_proj" in n for n in c.linears) for c in attention)
    assert {c.name for c in attention} == {"k_proj+v_proj"}  # named by what it keeps
    assert not [c for c in costs if c.layer == 0 and "mlp" in c.linears[0]]


def test_a_budget_beside_ignored_linears_quantizes_the_rest_of_their_group(
    tiny_checkpoint, tiny_calibration_data_dir
) -> None:
    """``--ignore q_proj`` with ``--avg-bits 8.25``: every q_proj stays float, every other
    linear is MXFP8."""
    data = str(tiny_calibration_data_dir)
    model = torq.quantize(
        str(tiny_checkpoint), data_dir=data, progress=False, avg_bits=8.25, ignore=["q_proj"],
        **CALIB,
    )  # fmt: skip
    linears = {n: m for n, m in model.named_modules() if n.endswith("_proj")}
    assert all(type(m) is torch.nn.Linear for n, m in linears.items() if n.endswith("q_proj"))
    others = [m for n, m in linears.items() if not n.endswith("q_proj")]
    assert others and all(m.config.weight.name == "mxfp8" for m in others)


def test_an_mxfp8_weight_gptq_left_off_its_own_scale_still_packs() -> None:
    """A block rounded with scale 1 whose largest code saturated at 448: the ``nearest``
    rule would take it a binade up and lose the smallest codes; it packs exactly."""
    fmt = get_format("mxfp8", "nearest")
    w = torch.zeros(2, 32)
    w[:, 0], w[:, 1], w[0, 2] = 448.0, 2.0**-9, 240.0
    assert not torch.equal(fake_quantize(w, fmt), w)
    packed = pack_exact(w, fmt)
    assert packed is not None and torch.equal(packed.dequantize(), w)
