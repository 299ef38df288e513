"""TORQ end to end on tiny models: the transformed model is the same function in float."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import TINY_TEXT, tiny_model
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.driver import apply_method
from torq.methods import MethodContext, TorqSettings, get_method
from torq.methods.registry import method_specs
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.intra_block import IntraBlockConfig
from torq.rotations.transform import BlockRotation
from torq.runs.config import RunConfig
from torq.runs.store import record_key
from torq.surgery import QuantConfig, QuantLinear


def _settings(corpus: str, sequential: bool = False, **kw) -> dict:
    """TORQ's settings and the capture, as a method's context holds them."""
    calibration = CalibrationConfig(corpus=corpus, n_samples=3, seqlen=48)
    return {
        "settings": TorqSettings(intra=IntraBlockConfig(max_iter=2), **kw),
        "capture": CaptureSettings(calibration, sequential=sequential, reservoir_tokens=64),
    }


def _key(name: str, *given: object) -> str:
    """The settings key of ``name`` in a run's record, the spec made from ``given``."""
    run = RunConfig.of(model="m", methods=method_specs([name], *given)).record()
    return record_key(run, name)


def _apply(model, method: str, qconfig: QuantConfig, settings: dict, tokenizer):
    ctx = MethodContext(tokenizer=tokenizer, options={"progress": False}, **settings)
    return apply_method(get_method(method), model, qconfig, ctx)


@pytest.mark.parametrize(
    ("method", "balance"),
    [
        ("torq", 0.5),
        ("torq", None),
        ("torq-inter", None),
        ("torq-intra", None),
        ("torq-had32", 0.5),
        ("torq-perm", 0.5),
    ],
)
def test_transformed_model_matches_in_float(arch, method, balance, corpus, tiny_tokenizer) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    settings = _settings(corpus, balance=balance)
    record = _apply(q, method, QuantConfig(None, None), settings, tiny_tokenizer)
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    assert record["settings"]["balance"] == balance
    qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(isinstance(m.input_transform, BlockRotation) for m in qlinears)
    has_inter = method not in ("torq-intra", "torq-had32", "torq-perm")
    has_intra = method != "torq-inter"
    t = qlinears[0].input_transform
    assert (t.r_inter is not None) == has_inter and (t.r_intra is not None) == has_intra
    assert (t.channel_scale is not None) == (balance is not None)
    if method in ("torq-had32", "torq-perm"):  # the fixed block Hadamard, not calibrated
        h = hadamard_matrix(32)
        assert torch.allclose(t.r_intra.double(), h / h[0].norm(), atol=1e-6)
    json.dumps(record)  # the record is JSON-serialisable as it stands
    assert record["calibration_seconds"]["solve"] >= 0


def test_qkv_share_one_transform(corpus, tiny_tokenizer) -> None:
    model = tiny_model("llama")
    _apply(model, "torq", QuantConfig(None, None), _settings(corpus), tiny_tokenizer)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.input_transform is attn.k_proj.input_transform is attn.v_proj.input_transform
    assert mlp.gate_proj.input_transform is mlp.up_proj.input_transform
    assert attn.o_proj.input_transform is not attn.q_proj.input_transform


@pytest.mark.parametrize("sequential", [False, True])
def test_w4a4_torq_runs_and_is_finite(sequential, corpus, tiny_tokenizer) -> None:
    model = tiny_model("qwen2")
    qc = QuantConfig.from_names("mxfp4", "mxfp4")
    rec = _apply(model, "torq", qc, _settings(corpus, sequential=sequential), tiny_tokenizer)
    assert rec["calibration"]["sequential"] is sequential
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 300, (1, 16))).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", ["had16", "had32", "had128", "hadfull"])
def test_block_hadamard_baseline_is_exact_in_float(arch, method) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    record = apply_method(get_method(method), q, QuantConfig(None, None), MethodContext())
    # tiny widths: 64 and 128 (hidden, intermediate); groups 16 / 32 / ≤128 / full width
    expected = {
        "had16": {64: 16, 128: 16},
        "had32": {64: 32, 128: 32},
        "had128": {64: 64, 128: 128},
    }.get(method, {64: 64, 128: 128})
    groups = record["group_by_width"]
    assert groups and all(expected[w] == g for w, g in groups.items())
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(isinstance(m.input_transform, BlockRotation) for m in qlinears)


def test_guard_keeps_the_transform_with_the_lower_held_back_error(corpus, tiny_tokenizer) -> None:
    """``torq-guard``: each group's calibrated transform is checked on the sampled tokens
    held back (a quarter) against the balanced ``H₃₂``; the group keeps the one with the
    lower W4A4 output error, which the record names with both errors; where it is the
    Hadamard, the transform is ``torq-had32``'s exactly. The fit sees the rest only."""
    from torq.calibration.capture import BlockStatistics
    from torq.formats import get_format
    from torq.methods.torq_rotation import build_group_transform, output_error

    fmt = get_format("mxfp4")
    chosen = set()
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        stats = BlockStatistics(64, 32, reservoir=96, seed=seed)
        x = torch.randn(96, 64, generator=gen) * torch.exp(torch.randn(1, 64, generator=gen))
        stats.update(x)
        weight = torch.randn(48, 64, generator=gen) * 0.1
        settings = _settings(corpus, guard=0.25)
        t, rec = build_group_transform(stats, settings["settings"], fmt, weight, fmt)
        guard = rec["guard"]
        assert guard["held_tokens"] == 24 and rec["intra"]["samples"] == 72 * 2
        errors = guard["error"]
        assert guard["chosen"] == min(errors, key=errors.get)
        held = stats.sample[72:]
        assert output_error(held, weight, t, fmt, fmt) == errors[guard["chosen"]]
        if guard["chosen"] == "hadamard":
            assert t.r_inter is None
            assert torch.equal(t.r_intra, hadamard_matrix(32, dtype=torch.float64).float())
        chosen.add(guard["chosen"])
        plain = _settings(corpus)["settings"]
        _, plain_rec = build_group_transform(stats, plain, fmt, weight, fmt)
        assert "guard" not in plain_rec and rec["intra"]["samples"] < plain_rec["intra"]["samples"]
    assert chosen  # (which one wins depends on the draw)
    with pytest.raises(ValueError, match="fraction"):
        _settings(corpus, guard=1.0)


def test_guard_runs_as_a_method_and_stays_out_of_the_other_keys(corpus, tiny_tokenizer) -> None:

    model = tiny_model("llama")
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    rec = _apply(model, "torq-guard", qconfig, _settings(corpus), tiny_tokenizer)
    json.dumps(rec)
    groups = [g for layer in rec["layers"] for k, g in layer.items() if isinstance(g, dict)]
    guarded = [g["guard"] for g in groups if "guard" in g]
    assert len(guarded) == 4 * model.config.num_hidden_layers
    assert rec["settings"]["guard"] == 0.25
    assert "guard" not in _key("torq")
    assert _key("torq", TorqSettings(guard=0.5)) != _key("torq")


def test_balance_check_keeps_the_power_with_the_lowest_output_error(corpus) -> None:
    """``--balance-check``: each group's balancing scales ``s^β`` (``β`` 0, ½, 1) are
    probed with ``H₃₂`` on the sampled tokens; the group keeps the power with the lowest
    W4A4 output error, which the record names with every error. A channel of activations
    100× the others is the balancing's own case (it must keep some); with ``β = 0`` the
    transform carries no scales (nothing is folded)."""
    from torq.calibration.capture import BlockStatistics
    from torq.formats import get_format
    from torq.methods.torq_rotation import build_group_transform, output_error
    from torq.rotations.balance import balance_scales, channel_energy

    fmt = get_format("mxfp4")
    had = hadamard_matrix(32, dtype=torch.float64)
    for seed, outlier in ((0, 100.0), (1, 1.0), (2, 1.0)):
        gen = torch.Generator().manual_seed(seed)
        stats = BlockStatistics(64, 32, reservoir=96, seed=seed)
        x = torch.randn(96, 64, generator=gen) * torch.exp(torch.randn(1, 64, generator=gen))
        x[:, 5] *= outlier
        stats.update(x)
        weight = torch.randn(48, 64, generator=gen) * 0.1
        settings = _settings(corpus, balance_check=True)["settings"].fixed_hadamard()
        t, rec = build_group_transform(stats, settings, fmt, weight, fmt)
        check = rec["balance"]["check"]
        errors = {float(p): e for p, e in check["error"].items()}
        assert set(errors) == {0.0, 0.5, 1.0} and check["tokens"] == 96
        power = check["chosen_power"]
        assert errors[power] == min(errors.values())
        full = balance_scales(channel_energy(stats.covariance()), weight, 0.5)
        if power == 0.0:
            assert t.channel_scale is None
        else:
            assert torch.allclose(t.channel_scale.double(), full.pow(power), rtol=1e-6)
        probe = BlockRotation(32, None, had, dtype=torch.float32, channel_scale=t.channel_scale)
        assert output_error(stats.sample, weight, probe, fmt, fmt) == errors[power]
        if outlier > 1.0:
            assert power > 0.0 and errors[power] < 0.5 * errors[0.0]
    with pytest.raises(ValueError, match="permutation"):
        TorqSettings(balance_check=True, use_inter=False, permute=True)
    assert "balance_check" not in _key("torq-had32")
    assert _key("torq-had32", TorqSettings(balance_check=True)) != _key("torq-had32")
    assert TorqSettings(balance_check=True).paper().balance_check is False


def test_balance_check_with_gptq_weights_scores_each_power_with_gptq(
    corpus, tiny_tokenizer
) -> None:
    """``--balance-check gptq``: each power's weights are GPTQ's on the probe's Hessian
    ``T Σ Tᵀ`` (not RTN's); the group keeps the power with the lowest of those errors,
    each equal to the output error of GPTQ's weights computed here on their own. A group
    captured without ``Σ x xᵀ`` is refused; through the driver the Hessian is captured even
    for RTN's weights; the setting is in the key only when it is not RTN's."""
    from torq.calibration.capture import BlockStatistics
    from torq.formats import get_format
    from torq.methods.torq_rotation import build_group_transform, output_error
    from torq.rotations.balance import balance_scales, channel_energy
    from torq.surgery.gptq import gptq_quantize

    fmt = get_format("mxfp4")
    had = hadamard_matrix(32, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    stats = BlockStatistics(64, 32, reservoir=128, seed=3, hessian=True)
    x = torch.randn(128, 64, generator=gen) * torch.exp(torch.randn(1, 64, generator=gen))
    x[:, 7] *= 30.0
    stats.update(x)
    weight = torch.randn(40, 64, generator=gen) * 0.1
    settings = _settings(corpus, balance_check=True, balance_probe="gptq")["settings"]
    t, rec = build_group_transform(stats, settings.fixed_hadamard(), fmt, weight, fmt)
    check = rec["balance"]["check"]
    assert check["weights"] == "gptq"
    errors = {float(p): e for p, e in check["error"].items()}
    assert errors[check["chosen_power"]] == min(errors.values())
    full = balance_scales(channel_energy(stats.covariance()), weight, 0.5)
    if check["chosen_power"] == 0.0:
        assert t.channel_scale is None
    else:
        kept = full.pow(check["chosen_power"])
        assert torch.allclose(t.channel_scale.double(), kept, rtol=1e-6)
    rtn = {}
    for power, err in errors.items():
        scale = None if power == 0.0 else full.pow(power).to(torch.float32)
        probe = BlockRotation(32, None, had, dtype=torch.float32, channel_scale=scale)
        hessian = probe.conjugate_hessian(stats.hessian())
        q, _ = gptq_quantize(probe.fuse_inverse(weight), hessian, fmt)
        assert output_error(stats.sample, weight, probe, fmt, fmt, quantized=q) == pytest.approx(
            err, rel=1e-9
        )
        rtn[power] = output_error(stats.sample, weight, probe, fmt, fmt)
    assert rtn != errors  # RTN's weights score differently
    without = BlockStatistics(64, 32, reservoir=128, seed=3)
    without.update(x)
    with pytest.raises(ValueError, match="without the Hessian"):
        build_group_transform(without, settings.fixed_hadamard(), fmt, weight, fmt)
    with pytest.raises(ValueError, match="balance_probe"):
        TorqSettings(balance_check=True, balance_probe="gptaq")
    assert "balance_probe" not in _key("torq-had32", TorqSettings(balance_check=True))
    assert _key("torq-had32", settings) != _key("torq-had32", TorqSettings(balance_check=True))
    assert settings.paper().balance_probe == "rtn"
    model = tiny_model("llama")
    run = _apply(
        model, "torq-had32", QuantConfig.from_names("mxfp4", "mxfp4"), _settings(
            corpus, balance_check=True, balance_probe="gptq", fold=True
        ), tiny_tokenizer,
    )  # fmt: skip
    groups = [g for layer in run["layers"] for g in layer.values() if isinstance(g, dict)]
    checks = [g["balance"]["check"] for g in groups if "balance" in g]
    assert len(checks) == 4 * model.config.num_hidden_layers
    assert all(c["weights"] == "gptq" for c in checks)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])  # folded models
def test_balance_check_folded_is_exact_in_float(arch, corpus, tiny_tokenizer) -> None:
    """Whatever power each group keeps (float formats: the probe's errors are rounding
    noise, so the choices fall anywhere; here they mix 0, ½ and 1), the folded model
    computes the float model's logits."""
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    settings = _settings(corpus, balance_check=True, fold=True)
    rec = _apply(q, "torq-had32", QuantConfig(None, None), settings, tiny_tokenizer)
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    groups = [g for layer in rec["layers"] for k, g in layer.items() if isinstance(g, dict)]
    powers = [g["balance"]["check"]["chosen_power"] for g in groups if "balance" in g]
    assert len(powers) == 4 * model.config.num_hidden_layers


def test_balance_check_runs_folded_and_exports(corpus, tiny_tokenizer) -> None:
    """The `default`'s transform with the balancing check, folded: every group's record
    names its chosen power, the quantized model's transforms carry no scales (each group's
    chosen ones are in the float weights, none where β = 0), and the recipe stays servable."""
    from torq.methods.recipes import get_recipe

    model = tiny_model("llama")
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    settings = _settings(corpus, balance_check=True, fold=True)
    rec = _apply(model, "torq-had32", qconfig, settings, tiny_tokenizer)
    json.dumps(rec)
    groups = [g for layer in rec["layers"] for k, g in layer.items() if isinstance(g, dict)]
    checks = [g["balance"]["check"] for g in groups if "balance" in g]
    assert len(checks) == 4 * model.config.num_hidden_layers
    assert all(c["chosen_power"] in (0.0, 0.5, 1.0) for c in checks)
    folded = sum("fold" in g for g in groups)
    assert folded == sum(c["chosen_power"] > 0 for c in checks)
    qlinears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(m.input_transform.channel_scale is None for m in qlinears)
    recipe = get_recipe("default")
    spec = recipe.spec(TorqSettings(balance_check=True))
    assert spec.settings.balance_check and spec.settings.fold
    reason = spec.method.transform.compressed_tensors(
        recipe.quant_config("mxfp4"), spec.context(recipe.capture())
    )
    assert reason is None


def test_calibrate_rotates_only_the_named_groups(corpus, tiny_tokenizer) -> None:
    """``calibrate=("o_proj",)``: o_proj's input group gets ``torq``'s calibrated transform
    and every other group ``torq-had32``'s, each bit for bit; names are checked; the setting
    stays out of the keys of the methods it cannot change."""
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    models = {}
    for label, method, kw in [
        ("o", "torq", {"calibrate": ("o_proj",)}),
        ("torq", "torq", {}),
        ("had32", "torq-had32", {}),
    ]:
        models[label] = tiny_model("llama")
        _apply(models[label], method, qconfig, _settings(corpus, **kw), tiny_tokenizer)
    names = ("q_proj", "o_proj", "gate_proj", "down_proj")
    for i, layer in enumerate(models["o"].model.layers):
        for name in names:
            sub = "self_attn" if name in ("q_proj", "o_proj") else "mlp"
            ref = models["torq" if name == "o_proj" else "had32"].model.layers[i]
            got_t = getattr(getattr(layer, sub), name).input_transform
            ref_t = getattr(getattr(ref, sub), name).input_transform
            assert set(got_t.state_dict()) == set(ref_t.state_dict())
            for key, tensor in ref_t.state_dict().items():
                assert torch.equal(got_t.state_dict()[key], tensor), (i, name, key)
            w = getattr(getattr(layer, sub), name).weight
            assert torch.equal(w, getattr(getattr(ref, sub), name).weight)
        assert layer.self_attn.o_proj.input_transform.r_inter is not None
        assert layer.self_attn.q_proj.input_transform.r_inter is None
    with pytest.raises(ValueError, match="calibrate names"):
        _settings(corpus, calibrate=("o_proj", "not a name"))
    with pytest.raises(ValueError, match="calibrate names"):
        _settings(corpus, calibrate=())
    o_only = TorqSettings(calibrate=("o_proj",))
    assert "calibrate" not in _key("torq")
    assert _key("torq", o_only) != _key("torq")
    assert _key("torq-had32", o_only) == _key("torq-had32")


@pytest.mark.parametrize("method", ["torq", "torq-had32"])
def test_unrotated_groups_get_their_balancing_alone(method, corpus, tiny_tokenizer) -> None:
    """``unrotated=("q_proj",)``: the q/k/v group's transform is its balancing alone (no
    rotation; with the fold, nothing online), every other group's is the method's own, bit
    for bit; without the balancing the group has no transform at all; names are checked and
    the setting enters the key."""
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    models = {}
    for label, kw in [
        ("plain", {"unrotated": ("q_proj",)}),
        ("folded", {"unrotated": ("q_proj",), "fold": True}),
        ("paper", {"unrotated": ("q_proj",), "balance": None}),
        ("own", {}),
    ]:
        models[label] = tiny_model("llama")
        _apply(models[label], method, qconfig, _settings(corpus, **kw), tiny_tokenizer)
    for i, layer in enumerate(models["plain"].model.layers):
        q = layer.self_attn.q_proj.input_transform
        assert q.r_inter is None and q.r_intra is None and q.channel_scale is not None
        assert models["folded"].model.layers[i].self_attn.q_proj.input_transform is None
        assert models["paper"].model.layers[i].self_attn.q_proj.input_transform is None
        own = models["own"].model.layers[i]
        for sub, name in (("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")):
            got = getattr(getattr(layer, sub), name)
            ref = getattr(getattr(own, sub), name)
            for key, tensor in ref.input_transform.state_dict().items():
                assert torch.equal(got.input_transform.state_dict()[key], tensor), (i, name, key)
            assert torch.equal(got.weight, ref.weight)
    with pytest.raises(ValueError, match="unrotated names"):
        _settings(corpus, unrotated=("q_proj", "not a name"))
    assert "unrotated" not in _key(method)
    assert _key(method, TorqSettings(unrotated=("q_proj",))) != _key(method)
    assert TorqSettings(unrotated=("q_proj",)).paper().unrotated is None


def test_the_unrotated_groups_take_their_own_balancing_strength(corpus, tiny_tokenizer) -> None:
    """``unrotated_balance``: the unrotated group is balanced with that strength (the first
    layer's q/k/v scales are those of a run with it as every group's), the rotated groups
    with ``balance``'s; it enters the key only when set, is checked, and the paper's
    settings drop it."""
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    models = {}
    for label, kw in [("own", {"unrotated_balance": 0.8}), ("all", {"balance": 0.8})]:
        models[label] = tiny_model("llama")
        settings = _settings(corpus, unrotated=("q_proj",), **kw)
        _apply(models[label], "torq-had32", qconfig, settings, tiny_tokenizer)
    own, every = (models[k].model.layers[0] for k in ("own", "all"))
    # the same inputs (the embeddings) and strength: the same scales
    assert torch.equal(
        own.self_attn.q_proj.input_transform.channel_scale,
        every.self_attn.q_proj.input_transform.channel_scale,
    )
    # the MLP's input, after the same attention, balanced with ½ against 0.8
    assert not torch.allclose(
        own.mlp.gate_proj.input_transform.channel_scale,
        every.mlp.gate_proj.input_transform.channel_scale,
    )
    assert "unrotated_balance" not in _key("torq-had32")
    given = TorqSettings(unrotated=("q_proj",), unrotated_balance=0.8)
    assert _key("torq-had32", given) != _key("torq-had32", TorqSettings(unrotated=("q_proj",)))
    with pytest.raises(ValueError, match="unrotated_balance"):
        TorqSettings(unrotated_balance=1.5)
    assert given.paper().unrotated_balance is None


def test_the_residual_hadamard_balances_the_norms_readers_with_nothing_online(
    corpus, tiny_tokenizer
) -> None:
    """``TorqSettings(residual=True)`` with the balancing folded (Qwen2, q/k/v with a bias):
    q/k/v and gate/up, rotated through the residual stream, are balanced in that basis
    with the balancing folded into the norm, so they run no transform; o_proj and down_proj
    keep the balanced block Hadamard online; in float the model is the float model; the
    setting enters the key only when set, and the paper's settings drop it."""
    ids = tiny_tokenizer(TINY_TEXT, return_tensors="pt").input_ids[:, :24]
    model = tiny_model("qwen2")
    settings = _settings(corpus, fold=True, residual=True)
    in_float = copy.deepcopy(model)
    _apply(in_float, "torq-had32", QuantConfig(None, None), settings, tiny_tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(
            in_float(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    q = copy.deepcopy(model)
    _apply(q, "torq-had32", QuantConfig.from_names("mxfp4", "mxfp4"), settings, tiny_tokenizer)
    for layer in q.model.layers:
        readers = [getattr(layer.self_attn, f"{n}_proj") for n in "qkv"]
        readers += [layer.mlp.gate_proj, layer.mlp.up_proj]
        assert all(r.input_transform is None for r in readers)
        # the balancing folded into the norm: its weight is no longer the folded γ's ones
        assert not torch.allclose(layer.input_layernorm.weight, torch.ones(1))
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            t = linear.input_transform
            assert t is not None and t.r_intra is not None and t.channel_scale is None
    assert "residual" not in _key("torq-had32")
    assert _key("torq-had32", TorqSettings(residual=True)) != _key("torq-had32")
    assert TorqSettings(residual=True).paper().residual is False


def test_the_solvers_on_the_calibration_device(corpus, tiny_tokenizer, monkeypatch) -> None:
    """``solver_device="calibration"`` (the default) hands both solvers their inputs on the
    device the statistics are summed on (on a CPU run, the CPU: the same transforms bit for
    bit as ``"cpu"``); ``"cpu"`` enters the settings key; other values are refused."""
    import torq.methods.torq_rotation as tr

    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    seen: list[tuple[str, str]] = []
    inter, intra = tr.inter_block_rotations, tr.fit_intra_block_rotation

    def watch_inter(covariance, *a, **k):
        seen.append(("inter", covariance.device.type))
        return inter(covariance, *a, **k)

    def watch_intra(sample, *a, **k):
        seen.append(("intra", sample.device.type))
        return intra(sample, *a, **k)

    monkeypatch.setattr(tr, "inter_block_rotations", watch_inter)
    monkeypatch.setattr(tr, "fit_intra_block_rotation", watch_intra)
    models = {}
    for where in ("cpu", "calibration"):
        models[where] = tiny_model("llama")
        settings = _settings(corpus, solver_device=where)
        _apply(models[where], "torq", qconfig, settings, tiny_tokenizer)
    assert {kind for kind, _ in seen} == {"inter", "intra"}
    assert {device for _, device in seen} == {"cpu"}
    for a, b in zip(models["cpu"].parameters(), models["calibration"].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(models["cpu"].buffers(), models["calibration"].buffers(), strict=True):
        assert torch.equal(a, b)
    assert TorqSettings().solver_device == "calibration"
    assert "solver_device" not in _key("torq")
    assert _key("torq", TorqSettings(solver_device="cpu")) != _key("torq")
    with pytest.raises(ValueError, match="solver_device"):
        TorqSettings(solver_device="gpu")


def test_the_block_mass_permutation_is_kept_where_it_lowers_the_held_back_error(
    corpus, tiny_tokenizer
) -> None:
    """``torq-perm``: each group's permutation is fitted on the tokens the guard does not
    hold back and kept (as the transform's ``channel_perm``) only where it lowers the W4A4
    output error there, else the group gets ``torq-had32``'s transform; the records say
    which and why; it needs the balancing and no inter-block level."""
    model = tiny_model("llama")
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    rec = _apply(model, "torq-perm", qconfig, _settings(corpus), tiny_tokenizer)
    json.dumps(rec)
    groups = [g for layer in rec["layers"] for g in layer.values() if isinstance(g, dict)]
    groups = [g for g in groups if "tokens" in g]  # (not the layer's fallback summary)
    assert groups and all("permutation" in g and "guard" in g for g in groups)
    for g in groups:
        perm = g["permutation"]
        assert perm["block_mass_sq_after"] <= perm["block_mass_sq_before"] * (1 + 1e-12)
        errors = g["guard"]["error"]
        assert g["guard"]["chosen"] == min(errors, key=errors.get)
    transforms = [m.input_transform for m in model.modules() if isinstance(m, QuantLinear)]
    kept = [t for t in transforms if getattr(t, "channel_perm", None) is not None]
    chosen = sum(g["guard"]["chosen"] == "calibrated" for g in groups)
    assert (len(kept) > 0) == (chosen > 0)
    with pytest.raises(ValueError, match="needs the balancing and no inter-block"):
        _settings(corpus, permute=True)  # with the inter-block level on


def test_rotation_check_keeps_a_groups_rotation_only_where_it_pays(
    corpus, tiny_tokenizer, tmp_path
) -> None:
    """``--rotation-check``: each group's balanced Hadamard is weighed against its balancing
    alone on the sampled tokens held back; the group keeps the one with the lower W4A4
    output error, which the record names with both. On a group whose values lie on the grid
    the balancing alone wins, on one with a large value in another channel in each token the
    rotation. Folded, a group left balanced only runs nothing online; the model computes the
    float model in float, and exports to compressed-tensors."""
    from torq.calibration.capture import BlockStatistics
    from torq.export.compressed_tensors import export_compressed_tensors
    from torq.formats import get_format
    from torq.methods.torq_rotation import build_group_transform, output_error

    fmt = get_format("mxfp4")
    settings = TorqSettings(
        intra=IntraBlockConfig(max_iter=0, init="hadamard"),
        use_inter=False,
        rotation_check=0.25,
    )
    chosen = {}
    gen = torch.Generator().manual_seed(0)
    signs = torch.randn(96, 64, generator=gen).sign()  # each value on the grid: no error
    spikes = torch.randn(96, 64, generator=gen) * 0.1  # one large channel in each token
    spikes[torch.arange(96), torch.randint(0, 64, (96,), generator=gen)] = 20.0
    weight = torch.randn(48, 64, generator=gen).sign() * 0.1  # columns of equal norm
    for name, x in (("signs", signs), ("spikes", spikes)):
        stats = BlockStatistics(64, 32, reservoir=96, seed=0)
        stats.update(x)
        t, rec = build_group_transform(stats, settings, fmt, weight, fmt)
        check = rec["rotation_check"]
        errors = check["error"]
        assert check["held_tokens"] == 24 and check["chosen"] == min(errors, key=errors.get)
        assert output_error(stats.sample[72:], weight, t, fmt, fmt) == errors[check["chosen"]]
        assert (t.r_intra is None) == (check["chosen"] == "balanced")
        chosen[name] = check["chosen"]
    assert chosen == {"signs": "balanced", "spikes": "rotated"}
    with pytest.raises(ValueError, match="needs the balancing"):
        TorqSettings(rotation_check=0.25, balance=None)

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    checked = {**_settings(corpus, fold=True, rotation_check=0.25), "tokenizer": tiny_tokenizer}
    for qconfig in (QuantConfig(None, None), QuantConfig.from_names("mxfp4", "mxfp4")):
        q = copy.deepcopy(model)
        ctx = MethodContext(options={"progress": False}, **checked)
        record = apply_method(get_method("torq-had32"), q, qconfig, ctx)
        kept = [
            r["rotation_check"]["chosen"]
            for layer in record["layers"]
            for r in layer.values()
            if isinstance(r, dict) and "rotation_check" in r
        ]
        assert kept  # every group was checked
        if qconfig.weight is None:
            with torch.no_grad():
                out = q(input_ids=ids).logits
            assert ((out - ref).norm() / ref.norm()) < 1e-4
    online = [m.input_transform for m in q.modules() if isinstance(m, QuantLinear)]
    assert ("balanced" in kept) == any(t is None for t in online)  # nothing online there
    export_compressed_tensors(q, tmp_path / "ct", tiny_tokenizer)
