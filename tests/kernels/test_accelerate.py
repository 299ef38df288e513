"""``torq.accelerate``: a quantized model's MXFP4 W4A4 layers swapped for the packed kernels."""

from __future__ import annotations

import copy

import pytest
import torch

import torq
from tests.conftest import TINY_TEXT, tiny_model
from torq.driver import apply_method
from torq.kernels import PackedMXFP4Linear
from torq.kernels.accelerate import SharedInputSlice, accelerate
from torq.methods import MethodContext, get_method
from torq.surgery import QuantConfig, QuantLinear


def _quantized(method: str, scale_mode: str = "ocp", act: str | None = "mxfp4", arch="llama"):
    model = tiny_model(arch)
    qconfig = QuantConfig.from_names("mxfp4", act, scale_mode=scale_mode)
    apply_method(get_method(method), model, qconfig, MethodContext(options={"progress": False}))
    return model.eval()


def _calibrated(method: str, tmp_path, tokenizer, scale_mode: str = "ocp"):
    from tests.methods.test_torq_method import _apply, _settings

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT * 30, encoding="utf-8")
    model = tiny_model("llama")
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4", scale_mode=scale_mode)
    _apply(model, method, qconfig, _settings(str(corpus)), tokenizer)
    return model.eval()


@pytest.mark.parametrize("scale_mode", ["ocp", "nearest"])
@pytest.mark.parametrize("method", ["rtn", "had32", "torq-had32+gptaq", "torq"])
def test_accelerated_model_computes_the_fake_quant_model(
    method, scale_mode, tmp_path, tiny_tokenizer
) -> None:
    """Every quantized linear is swapped (its transform kept, fused or as a module; the
    activation's scale rule kept) and the logits are the fake-quant model's: on a CPU the
    packed layers run the reference, the same arithmetic in float32."""
    if method in ("rtn", "had32"):
        model = _quantized(method, scale_mode)
    else:
        model = _calibrated(method, tmp_path, tiny_tokenizer, scale_mode)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=gen)
    n_quantized = sum(isinstance(m, QuantLinear) for m in model.modules())
    fast = copy.deepcopy(model)
    report = accelerate(fast)
    assert not report.kept, report.kept
    assert len(report.swapped) == n_quantized == 14
    assert not any(isinstance(m, QuantLinear) for m in fast.modules())
    # q/k/v and gate/up of each layer read one input: one product each
    assert [len(g) for g in report.shared] == [3, 2, 3, 2]
    assert sum(isinstance(m, SharedInputSlice) for m in fast.modules()) == 10
    packed = [m for m in fast.modules() if isinstance(m, PackedMXFP4Linear)]
    assert len(packed) == 8
    if method != "rtn":
        assert all(m.input_transform is not None for m in packed)
    assert all(m.nearest == (scale_mode == "nearest") for m in packed)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = fast(input_ids=ids).logits
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-5, rel  # float32 sums in another order, the same quantized values
    assert int(got.argmax(-1).ne(ref.argmax(-1)).sum()) == 0


def test_layers_the_kernels_do_not_compute_are_kept_with_a_reason() -> None:
    """The kernels compute MXFP4 with the OCP and nearest scale rules: a model quantized
    with another rule, or with float activations, keeps its layers and the report says why,
    in one line."""
    for kwargs, words in (
        ({"scale_mode": "paper"}, "paper rule"),
        ({"act": None}, "float activations"),
    ):
        model = _quantized("rtn", **kwargs)
        n = sum(isinstance(m, QuantLinear) for m in model.modules())
        report = torq.accelerate(model)
        assert report.swapped == [] and len(report.kept) == n
        assert words in report.summary() and "\n" not in report.summary()
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) == n


def test_a_weight_off_the_grid_is_not_packed() -> None:
    model = _quantized("rtn")
    name = "model.layers.0.mlp.down_proj"
    with torch.no_grad():
        model.get_submodule(name).weight.mul_(1.01)
    report = accelerate(model)
    assert "not on the MXFP4 grid" in report.kept[name]
    assert isinstance(model.get_submodule(name), QuantLinear)


@pytest.mark.parametrize("scale_mode", ["ocp", "nearest"])
def test_fused_experts_are_swapped(scale_mode) -> None:
    from torq.kernels import PackedMXFP4Experts

    model = _quantized("had32", scale_mode, arch="qwen3_moe")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=gen)
    fast = copy.deepcopy(model)
    report = accelerate(fast)
    assert not report.kept, report.kept
    experts = [m for m in fast.modules() if isinstance(m, PackedMXFP4Experts)]
    assert experts and all(m.nearest == (scale_mode == "nearest") for m in experts)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = fast(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_unknown_backend_is_refused() -> None:
    from torq.errors import TorqError

    with pytest.raises(TorqError, match="unknown backend"):
        torq.accelerate(_quantized("rtn"), backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["had32", "torq"])
def test_accelerated_model_on_a_gpu_runs_the_kernels_as_the_fake_quant_model(
    method, tmp_path, tiny_tokenizer
) -> None:
    """On a GPU the swapped layers run the Triton kernels (the transform fused into the
    pre-pass for had32, a torch module before it for TORQ's inter-block rotation). Against
    the float32 fake-quant model (the definition) the accelerated bf16 model is no farther
    than the bf16 fake-quant model is: the kernels compute the transform in float32 and the
    products exactly, where the bf16 model rounds the transform's output first."""
    if method == "torq":
        model = _calibrated(method, tmp_path, tiny_tokenizer)
    else:
        model = _quantized(method)
    exact = model.to("cuda")
    bf16 = copy.deepcopy(exact).to(torch.bfloat16)
    fast = copy.deepcopy(bf16)
    report = accelerate(fast)
    assert not report.kept, report.kept
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=gen).cuda()
    for tokens in (ids, ids[:1, :1], ids[:, :1]):  # the matmul, GEMV and rows paths
        with torch.no_grad():
            ref = exact(input_ids=tokens).logits
            rel_bf16 = float((bf16(input_ids=tokens).logits.float() - ref).norm() / ref.norm())
            rel_fast = float((fast(input_ids=tokens).logits.float() - ref).norm() / ref.norm())
        shape = tuple(tokens.shape)
        print(f"{method} {shape}: bf16 fake-quant {rel_bf16:.2e}, kernels {rel_fast:.2e}")
        assert rel_fast <= 2 * rel_bf16 + 1e-3, (tokens.shape, rel_fast, rel_bf16)


@pytest.mark.parametrize("method", ["rtn", "had32", "torq", "torq-perm"])
def test_torch_compile_traces_the_whole_model_with_the_kernels_as_operators(
    method, tmp_path, tiny_tokenizer, monkeypatch
) -> None:
    """``torch.compile(fullgraph=True)`` of an accelerated model: one graph, with every
    packed product one ``torq::mxfp4_linear`` node (the transform inside it, or before it as
    its module for ``torq-perm``'s permutation), a shared q/k/v or gate/up product computed
    once, and the eager model's logits."""
    import torq.kernels.ops as ops

    if method in ("rtn", "had32"):
        model = _quantized(method, "nearest")
    else:
        model = _calibrated(method, tmp_path, tiny_tokenizer, "nearest")
    accelerate(model)
    transforms = [m.input_transform for m in model.modules() if isinstance(m, PackedMXFP4Linear)]
    forms = [t.kernel_form() for t in transforms if t is not None]
    assert set(forms) == {"rtn": set(), "had32": {"block_matrix"}, "torq": {"prepass"}}.get(
        method,
        {"module", "prepass"},  # the permutation where the balancing found one
    )
    calls = []
    run = ops.mxfp4_linear

    def counted(*args, **kwargs):
        calls.append(kwargs["rotation"] is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(ops, "mxfp4_linear", counted)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)
    )
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        assert not calls  # eager: the layers call the kernels, not the operator
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids)
    # per decoder layer: q/k/v (shared), o, gate/up (shared), down; each transform the
    # kernels run goes into the operator
    assert len(calls) == len(transforms) == 8
    assert sum(calls) == sum(form != "module" for form in forms)
    assert torch.equal(compiled.logits, eager)


def test_a_compiled_decoding_step_gives_the_eager_tokens() -> None:
    """``torch.compile(fullgraph=True)`` of the decoding step over transformers' static
    cache, as ``benchmarks/gpu.py --compiled`` decodes: one graph, the eager loop's tokens."""
    from torq.models.decoding import greedy_decode

    model = _quantized("had32", "nearest")
    accelerate(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator())
    eager = greedy_decode(model, ids, 6)
    torch._dynamo.reset()
    step = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    assert torch.equal(greedy_decode(model, ids, 6, step_forward=step), eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_accelerated_step_captures_as_a_cuda_graph() -> None:
    """On a GPU: the accelerated model through ``torch.compile`` (Inductor, one graph with
    torq's products as operators) and captured as a CUDA graph, as ``benchmarks/gpu.py
    --compiled`` decodes, gives the eager kernels' logits to bf16's rounding of the fused
    code around them."""
    model = _quantized("had32").to("cuda", torch.bfloat16)
    accelerate(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda")
    torch._dynamo.reset()
    forward = torch.compile(model, dynamic=False, fullgraph=True)
    with torch.no_grad():
        eager = model(input_ids=ids).logits.float()
        for _ in range(3):
            forward(input_ids=ids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(input_ids=ids).logits
        graph.replay()
        torch.cuda.synchronize()
    rel = float((out.float() - eager).norm() / eager.norm())
    assert rel < 2e-2, rel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_on_the_kernels_gives_the_eager_tokens() -> None:
    """``torq generate --packed --cuda-graph``'s loop on a GPU: the accelerated model's
    step captured once and replayed gives the tokens of the same step run eagerly."""
    from torq.models.decoding import greedy_decode

    model = _quantized("had32").to("cuda", torch.bfloat16)
    accelerate(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), device="cuda")
    eager = greedy_decode(model, ids, 12)
    assert torch.equal(greedy_decode(model, ids, 12, cuda_graph=True), eager)


def test_a_saved_default_recipe_checkpoint_runs_on_the_kernels(tmp_path, tiny_tokenizer) -> None:
    """A torq checkpoint of the default recipe's method (nearest-rule activations): loaded
    with its weights kept packed, or loaded unpacked and accelerated, every linear runs on
    the kernels and computes the saved model's logits."""
    from torq.export import load_quantized, save_quantized

    model = _calibrated("torq-had32+gptaq", tmp_path, tiny_tokenizer, "nearest")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer, method="torq-had32+gptaq")
    packed, _, manifest = load_quantized(out, packed=True)
    assert manifest["load"]["packed_layers"] == 14
    unpacked, _, _ = load_quantized(out)
    report = accelerate(unpacked, share=False)
    assert len(report.swapped) == 14 and not report.kept
    for loaded in (packed, unpacked):
        layers = [m for m in loaded.modules() if isinstance(m, PackedMXFP4Linear)]
        assert len(layers) == 14 and all(m.nearest for m in layers)
        with torch.no_grad():
            got = loaded(input_ids=ids).logits
        assert float((got - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("method", ["rtn", "had32"])
def test_a_compressed_tensors_checkpoint_runs_on_the_kernels(method, tmp_path, tiny_tokenizer):
    """A compressed-tensors folder loaded through transformers (bf16, activations by the
    nearest rule, the Hadamard as a hooked transform module) with ``packed``: every
    quantized linear is de-compressed and swapped, its Hadamard read off the module, and
    the model is as close to torq's float32 model as the compressed-tensors model itself
    is, within 5 % (measured: 27.7 % and 27.7 % for rtn, 24.8 % and 24.4 % for had32: both
    compute in bf16 between the layers; the kernels take the transform in float32 where
    compressed-tensors rounds it to bf16)."""
    pytest.importorskip("compressed_tensors")
    from torq.export.compressed_tensors import export_compressed_tensors
    from torq.export.loading import load_model

    model = _quantized(method, "nearest")
    out = export_compressed_tensors(model, tmp_path / "ct", tiny_tokenizer)
    served = torq.load(out)
    loaded = load_model(str(out), packed=True)  # `torq eval --packed`: on the kernels
    assert loaded.quantized["load"] == {"packed_layers": 14, "kept": {}}
    fast = loaded.model
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    packed = [m for m in fast.modules() if isinstance(m, PackedMXFP4Linear)]
    assert all(m.nearest for m in packed)
    assert all((m.input_transform is not None) == (method == "had32") for m in packed)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        rel_ct = float((served(input_ids=ids).logits.float() - ref).norm() / ref.norm())
        rel_fast = float((fast(input_ids=ids).logits.float() - ref).norm() / ref.norm())
    print(f"{method}: compressed-tensors {rel_ct:.2e}, on the kernels {rel_fast:.2e}")
    assert rel_fast <= rel_ct * 1.05 + 1e-3, (rel_fast, rel_ct)


def test_generate_command_runs_a_saved_checkpoint_on_the_kernels(
    tmp_path, tiny_tokenizer, tiny_checkpoint, capsys
) -> None:
    """``torq generate --packed``: the saved model's greedy text, the same as without the
    kernels (the reference arithmetic on a CPU) and with ``--compile`` too, and one line on
    stderr with the speed and what ran on the kernels; a float model with --packed is
    refused in one line."""
    from torq.cli import main
    from torq.export import save_quantized

    folder = save_quantized(_quantized("had32", "nearest"), tmp_path / "q", tiny_tokenizer)
    base = ["generate", "--model", str(folder), "--prompt", "the", "--max-new-tokens", "6"]
    assert main([*base, "--device", "cpu"]) == 0
    plain = capsys.readouterr()
    assert main([*base, "--device", "cpu", "--packed"]) == 0
    fast = capsys.readouterr()
    assert fast.out == plain.out and fast.out.startswith("the")
    assert "6 tokens in" in fast.err and "14 layers on torq's MXFP4 W4A4 kernels" in fast.err
    assert "the prompt and first token" in fast.err and "tokens/s" in fast.err
    # the step through torch.compile (Inductor on the CPU): one graph, the same text
    assert main([*base, "--device", "cpu", "--packed", "--compile"]) == 0
    compiled = capsys.readouterr()
    assert compiled.out == plain.out and "the step through torch.compile" in compiled.err
    assert main(["generate", "--model", str(tiny_checkpoint), "--packed"]) == 2
    err = capsys.readouterr().err
    assert "is not a quantized checkpoint" in err and len(err.strip().splitlines()) == 1


def test_layers_that_read_one_input_run_as_one_product() -> None:
    """q/k/v (and gate/up) as one stacked packed product: the model's logits are those of
    the layers run one by one, and a group's product is only reused for the very input it
    was computed from (another tensor, or the same one changed in place, is computed anew)."""
    model = _quantized("had32", "nearest")
    alone, shared = copy.deepcopy(model), copy.deepcopy(model)
    accelerate(alone, share=False)
    report = accelerate(shared)
    assert report.shared[0] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert "14 layers on torq's MXFP4 W4A4 kernels (10 of them in 4 shared products)" in (
        report.summary()
    )
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=gen)
    with torch.no_grad():
        ref = alone(input_ids=ids).logits
        got = shared(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    q, k = (shared.get_submodule(f"model.layers.0.self_attn.{p}_proj") for p in "qk")
    q_ref, k_ref = (alone.get_submodule(f"model.layers.0.self_attn.{p}_proj") for p in "qk")
    x1, x2 = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        assert torch.allclose(q(x1), q_ref(x1), atol=1e-6)
        assert torch.allclose(k(x2), k_ref(x2), atol=1e-6)  # another input: not q's product
        q(x1)
        x1.mul_(2)  # changed in place after q read it
        assert torch.allclose(k(x1), k_ref(x1), atol=1e-6)


def test_a_shared_product_with_biases_on_some_layers() -> None:
    """Qwen2's q/k/v carry biases: the stacked product adds each layer's (zeros where a
    layer has none) and computes the layers alone."""
    model = _quantized("rtn", "nearest", arch="qwen2")
    with torch.no_grad():  # one layer of the group without its bias
        model.model.layers[0].self_attn.k_proj.bias = None
    alone, shared = copy.deepcopy(model), copy.deepcopy(model)
    accelerate(alone, share=False)
    report = accelerate(shared)
    assert (report.shared[0][:2]) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
    ]
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator())
    with torch.no_grad():
        ref = alone(input_ids=ids).logits
        got = shared(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-6
