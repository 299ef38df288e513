"""The layer-streaming driver, the only path a run takes: the same numbers as the whole
model quantized and evaluated in memory, bit for bit, on every architecture, and memory
that follows one layer's size."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import tiny_model
from tests.whole_model import whole_model_run
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.driver import run_layerwise
from torq.errors import TorqError
from torq.eval.perplexity import perplexity
from torq.methods.registry import LayerPlan, method_specs
from torq.methods.settings import TorqSettings
from torq.models.streaming import LayerStream, ModelLayers
from torq.pipeline import run
from torq.rotations.intra_block import IntraBlockConfig
from torq.runs.config import RunConfig

STREAMED_METHODS = ["fp", "rtn", "had32", "gptq", "torq", "torq-had32", "torq+gptq"]


@pytest.fixture
def data_dir(tiny_calibration_data_dir: Path) -> Path:
    return tiny_calibration_data_dir


def _save(arch: str, folder: Path, tokenizer, dtype: torch.dtype = torch.float32) -> Path:
    model = tiny_model(arch).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_float_model_layer_by_layer_is_the_whole_model(arch, tmp_path, tiny_tokenizer) -> None:
    """Embedding, every layer with the model's own keyword arguments, final norm and head
    (Gemma's soft-capping included): the whole model's perplexity, bit for bit, from the
    streamed folder and from the model in memory."""
    folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    model = tiny_model(arch)
    windows = torch.randint(0, model.config.vocab_size, (3, 32))
    whole = perplexity(model, windows, progress=False).ppl
    streamed = run_layerwise(LayerStream(folder), LayerPlan(None), None, windows, progress=False)
    in_memory = run_layerwise(ModelLayers(model), LayerPlan(None), None, windows, progress=False)
    assert streamed.perplexity is not None and in_memory.perplexity is not None
    assert streamed.perplexity.ppl == whole
    assert in_memory.perplexity.ppl == whole
    assert streamed.perplexity.window_nll == perplexity(model, windows, progress=False).window_nll


def test_a_checkpoint_under_names_transformers_converts_streams_as_the_whole_model(
    tmp_path, tiny_tokenizer
) -> None:
    """Mixtral's checkpoint keeps its own names (``block_sparse_moe``, each expert's ``w1``,
    ``w2``, ``w3``), which transformers converts as it loads (the router renamed, the
    experts stacked, ``w1`` and ``w3`` into ``gate_up_proj``): streamed, the float model's
    perplexity is the whole model's, bit for bit."""
    folder = _save("mixtral", tmp_path / "mixtral", tiny_tokenizer)
    names = LayerStream(folder).files
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    windows = torch.randint(0, model.config.vocab_size, (3, 32))
    streamed = run_layerwise(LayerStream(folder), LayerPlan(None), None, windows, progress=False)
    assert streamed.perplexity is not None
    assert streamed.perplexity.ppl == perplexity(model, windows, progress=False).ppl


def test_a_prefetched_layer_is_the_layer_read_when_asked(tmp_path, tiny_tokenizer) -> None:
    """With ``prefetch`` (a GPU's default) each layer is read on a background thread while
    the one before is worked on: every layer's parameters and the walk's perplexity are
    those of the plain read, bit for bit, and each layer after the first comes from the
    background thread."""
    folder = _save("llama", tmp_path / "m", tiny_tokenizer, torch.bfloat16)
    plain, ahead = LayerStream(folder), LayerStream(folder, prefetch=True)
    assert not plain.prefetch and ahead.prefetch
    threads: list[str] = []
    read = ahead._read

    def spy(names: list[str], host: bool = False) -> dict[str, torch.Tensor]:
        threads.append(threading.current_thread().name)
        return read(names, host)

    ahead._read = spy  # type: ignore[method-assign]
    for i in range(plain.num_layers):
        a, b = plain.load_layer(i).state_dict(), ahead.load_layer(i).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(v.dtype == torch.float32 for v in b.values())
    assert threads[0] == "MainThread" and len(threads) == plain.num_layers
    assert all(t.startswith("torq-prefetch") for t in threads[1:])
    windows = torch.randint(0, 300, (2, 32))
    one = run_layerwise(LayerStream(folder), LayerPlan(None), None, windows, progress=False)
    two = run_layerwise(ahead, LayerPlan(None), None, windows, progress=False)
    assert one.perplexity is not None and two.perplexity is not None
    assert one.perplexity.ppl == two.perplexity.ppl


def test_batches_of_windows_give_the_same_perplexity(tmp_path, tiny_tokenizer) -> None:
    folder = _save("llama", tmp_path / "m", tiny_tokenizer)
    windows = torch.randint(0, 300, (4, 32))
    one = run_layerwise(LayerStream(folder), LayerPlan(None), None, windows, 1, progress=False)
    two = run_layerwise(LayerStream(folder), LayerPlan(None), None, windows, 2, progress=False)
    assert one.perplexity is not None and two.perplexity is not None
    assert one.perplexity.ppl == pytest.approx(two.perplexity.ppl, rel=1e-6)


def _config(
    folder: Path,
    data_dir: Path,
    methods: list[str],
    sequential: bool = False,
    fold: bool = False,
    **kw,
) -> RunConfig:
    settings = TorqSettings(
        intra=IntraBlockConfig(max_iter=1, init="hadamard", k_top=32), fold=fold
    )
    capture = CaptureSettings(
        CalibrationConfig(n_samples=3, seqlen=48), sequential=sequential, reservoir_tokens=48
    )
    return RunConfig.of(
        model=str(folder),
        methods=method_specs(methods, settings),
        seqlen=48,
        max_windows=3,
        data_dir=str(data_dir),
        capture=capture,
        **kw,
    )


def test_streamed_methods_match_the_whole_model_path(
    arch, tmp_path, data_dir, tiny_tokenizer
) -> None:
    """Every streamable method, quantized and evaluated layer by layer from the checkpoint
    folder, gives the whole-model path's perplexity bit for bit."""
    folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    # today's whole-model path: the folder loaded whole in float32 (its own tokenizer)
    whole = whole_model_run(_config(folder, data_dir, STREAMED_METHODS))
    streamed = run(_config(folder, data_dir, STREAMED_METHODS), progress=False)
    for a, b in zip(whole["rows"], streamed["rows"], strict=True):
        assert a["method"] == b["method"]
        assert a["ppl"] == b["ppl"], a["method"]
    rows = {r["method"]: r for r in streamed["rows"]}
    assert rows["torq"]["details"]["layers"][0]["groups"]  # calibrated, layer by layer
    assert set(rows["torq"]["details"]["streamed"]["stored_dtypes"]) == {"F32"}
    assert streamed["peak_memory"]["host_rss_bytes"] > 0
    assert len({r["ppl"] for r in streamed["rows"]}) == len(STREAMED_METHODS)
    # each step's own peak resident set, never above the run's
    torq_row = rows["torq"]["details"]
    steps = [p["peak_rss_bytes"] for p in torq_row["streamed"]["per_layer"]]
    assert all(set(p) == {"load", "capture", "quantize", "evaluate"} for p in steps)
    peaks = [v for p in steps for v in p.values()] + list(torq_row["peak_rss_bytes"].values())
    assert all(0 < v <= streamed["peak_memory"]["host_rss_bytes"] for v in peaks)


def test_static_activation_scales_stream_as_the_whole_model(
    tmp_path, data_dir, tiny_tokenizer
) -> None:
    """NVFP4 W4A4 with static activation tensor scales (``act_scale="static"``): fixed and
    calibrating methods read the calibration windows, stream bit for bit as the whole-model
    path, and differ from the dynamic scales' numbers."""
    folder = _save("qwen3", tmp_path / "m", tiny_tokenizer)
    methods = ["rtn", "had32", "torq-had32"]
    nv = {"weight_format": "nvfp4", "act_format": "nvfp4"}
    whole = whole_model_run(_config(folder, data_dir, methods, act_scale="static", **nv))
    streamed = run(_config(folder, data_dir, methods, act_scale="static", **nv), progress=False)
    dynamic = run(_config(folder, data_dir, methods, **nv), progress=False)
    for a, b, c in zip(whole["rows"], streamed["rows"], dynamic["rows"], strict=True):
        assert a["ppl"] == b["ppl"] != c["ppl"], a["method"]
        layers = a["details"]["layers"]
        assert all(layer["activation_scales"]["static"] > 0 for layer in layers)
    assert streamed["quant_config"]["act_scale"] == "static"


def test_bf16_checkpoint_streams_as_float32_of_its_values(tmp_path, data_dir, tiny_tokenizer):
    """A bf16 checkpoint is read in bf16 and computed in float32: the same numbers as the
    whole model loaded in float32 from the same folder."""
    folder = _save("llama", tmp_path / "bf16", tiny_tokenizer, torch.bfloat16)
    whole = whole_model_run(_config(folder, data_dir, ["fp", "rtn"]))
    streamed = run(_config(folder, data_dir, ["fp", "rtn"]), progress=False)
    assert [r["ppl"] for r in whole["rows"]] == [r["ppl"] for r in streamed["rows"]]
    assert streamed["rows"][0]["details"]["streamed"]["stored_dtypes"].get("BF16", 0) > 0


def test_the_block_mass_permutation_streams_as_the_whole_model(
    tmp_path, data_dir, tiny_tokenizer
) -> None:
    """``torq-perm`` (and with GPTQ) layer by layer gives the whole-model perplexity bit
    for bit, with the same choices per group."""
    folder = _save("llama", tmp_path / "llama", tiny_tokenizer)
    methods = ["torq-perm", "torq-perm+gptq"]
    whole = whole_model_run(_config(folder, data_dir, methods))
    streamed = run(_config(folder, data_dir, methods), progress=False)
    for a, b in zip(whole["rows"], streamed["rows"], strict=True):
        assert a["ppl"] == b["ppl"], a["method"]
        choices = [
            [
                [layer[g["name"]]["guard"]["chosen"] for g in layer["groups"]]
                for layer in r["details"]["layers"]
            ]
            for r in (a, b)
        ]
        assert choices[0] == choices[1] and any(choices[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama-tied"])
def test_quarot_streams_its_residual_rotation_part_by_part(
    arch, tmp_path, data_dir, tiny_tokenizer
) -> None:
    """QuaRot's residual and head rotations, fused into the embedding, each layer and the
    head as each is read (ResidualRotation): the whole model rotated at once, bit for bit,
    tied embeddings included."""
    if arch == "llama-tied":
        model = tiny_model("llama")
        model.config.tie_word_embeddings = True
        model.tie_weights()
        model.save_pretrained(tmp_path / arch)
        tiny_tokenizer.save_pretrained(tmp_path / arch)
        folder = tmp_path / arch
    else:
        folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    methods = ["quarot", "quarot+gptq"]
    whole = whole_model_run(_config(folder, data_dir, methods, seed=3))
    streamed = run(_config(folder, data_dir, methods, seed=3), progress=False)
    assert [r["ppl"] for r in whole["rows"]] == [r["ppl"] for r in streamed["rows"]]
    other = run(_config(folder, data_dir, ["quarot"], seed=4), progress=False)
    assert other["rows"][0]["ppl"] != streamed["rows"][0]["ppl"]  # the signs follow --seed


def test_the_residual_hadamard_streams_as_the_whole_model(
    tmp_path, data_dir, tiny_tokenizer
) -> None:
    """The block Hadamard of the residual stream (``residual``: the block Hadamard's and
    TORQ's, its balancing folded after it) on Qwen2, fused part by part as each is read:
    the whole model's perplexities, bit for bit."""
    from torq.methods.hadamard import HadamardSettings

    folder = _save("qwen2", tmp_path / "qwen2", tiny_tokenizer)
    methods = ["had32", "torq-had32+gptq"]
    settings = TorqSettings(
        intra=IntraBlockConfig(max_iter=1, init="hadamard", k_top=32), fold=True, residual=True
    )

    def config() -> RunConfig:
        plain = _config(folder, data_dir, methods)
        return plain.replace(
            methods=method_specs(methods, settings, HadamardSettings(residual=True))
        )

    whole = whole_model_run(config())
    streamed = run(config(), progress=False)
    assert [r["ppl"] for r in whole["rows"]] == [r["ppl"] for r in streamed["rows"]]
    rotated = run(_config(folder, data_dir, ["had32"]), progress=False)
    assert rotated["rows"][0]["ppl"] != streamed["rows"][0]["ppl"]


def _tied_llama(folder: Path, tokenizer) -> Path:
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "arch", ["llama", "llama-tied", "qwen3_moe", "gemma3_text", "granite", "mixtral"]
)
def test_streamed_save_dir_writes_the_model_that_save_quantized_writes(
    arch, tmp_path, data_dir, tiny_tokenizer
) -> None:
    """``--stream --save-dir``: each quantized layer is written as it is done (a shard per
    part, an index), and the folder loads as the model the whole-model path saves: the same
    logits bit for bit, the same fingerprint, and evaluated again it gives the row's
    perplexity."""
    from torq.export import load_quantized, read_manifest

    if arch == "llama-tied":
        folder = _tied_llama(tmp_path / arch, tiny_tokenizer)
    else:
        folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    methods = ["rtn", "torq+gptq"] + (
        ["quarot"] if arch in ("llama", "llama-tied", "granite") else []
    )
    whole = whole_model_run(_config(folder, data_dir, methods, save_dir=str(tmp_path / "w")))
    cfg = _config(folder, data_dir, methods, save_dir=str(tmp_path / "s"))
    streamed = run(cfg, progress=False)
    ids = torch.randint(0, 300, (2, 24))
    for a, b in zip(whole["rows"], streamed["rows"], strict=True):
        assert a["ppl"] == b["ppl"], a["method"]
        saved = Path(b["details"]["saved"]["path"])
        assert (saved / "model.safetensors.index.json").is_file()
        assert not (saved / "model.safetensors").exists()
        assert len(list(saved.glob("model-layer-*.safetensors"))) == 2  # a shard per layer
        ref, _, ref_manifest = load_quantized(a["details"]["saved"]["path"])
        got, tok, manifest = load_quantized(saved)  # checks the streamed fingerprint
        assert tok is not None
        assert manifest["fingerprint"] == ref_manifest["fingerprint"]
        assert manifest["modules"].keys() == ref_manifest["modules"].keys()
        assert len(manifest["transforms"]) == len(ref_manifest["transforms"])
        with torch.no_grad():
            assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits), b["method"]
        again = run(_config(saved, data_dir, [b["method"]]), progress=False)
        assert again["rows"][0]["ppl"] == b["ppl"]
        assert read_manifest(saved)["info"]["details"][
            "layers" if "torq" in b["method"] else "replaced"
        ]


def test_streaming_refuses_what_it_cannot_do_before_any_work(tmp_path, data_dir, tiny_tokenizer):
    gemma = _save("gemma3_text", tmp_path / "g", tiny_tokenizer)
    with pytest.raises(TorqError, match="residual-stream rotation"):
        run(_config(gemma, data_dir, ["rtn", "quarot"]), progress=False)
    folder = _save("llama", tmp_path / "m", tiny_tokenizer)
    with pytest.raises(TorqError, match="--hidden-states ram: use auto, memory"):
        run(_config(folder, data_dir, ["rtn"], hidden_states="ram"), progress=False)
    with pytest.raises(TorqError, match="--packed loads a saved"):
        run(_config(folder, data_dir, ["rtn"], packed=True), progress=False)


class _Stop(Exception):
    pass


def _untimed(record):
    """A record without its wall times (which differ between any two runs)."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items() if "seconds" not in k}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    return record


@pytest.mark.parametrize(
    ("method", "hidden", "sequential", "stop_at", "save"),
    [
        ("torq+gptq", "memory", False, 1, False),
        ("torq", "disk", True, 1, True),
        ("had32", "bfloat16", False, 0, True),
        ("quarot", "memory", False, 1, True),
        ("torq-had32+gptaq", "disk", False, 1, True),
    ],
)
def test_a_stopped_streamed_run_continues_after_its_last_kept_layer(
    method, hidden, sequential, stop_at, save, tmp_path, data_dir, tiny_tokenizer, monkeypatch
) -> None:
    """``--stream --resume-dir``: a run stopped while quantizing layer ``stop_at + 1``
    continues from it, and its row is the row of a run never stopped, bit for bit (the
    perplexity, every layer's record); its progress file goes when it is done. With
    ``--save-dir`` the parts written before the stop stay (``.<name>.partial``) and the
    finished folder is the never-stopped run's model: the same logits bit for bit."""
    from transformers import AutoModelForCausalLM

    import torq.driver as driver
    import torq.pipeline
    from tests.conftest import tiny_config
    from torq.export import load_quantized

    cfg3 = tiny_config("llama")
    cfg3.num_hidden_layers = 3  # a layer before the stop, the one it stops in, one after
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg3, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    monkeypatch.setattr(driver.progress, "PROGRESS_EVERY_S", 0.0)  # keep every layer

    def config(**kw):
        cfg = _config(folder, data_dir, [method], sequential, hidden_states=hidden)
        if save:
            kw.setdefault("save_dir", str(tmp_path / "saved"))
        return cfg.replace(**kw)

    whole = run(config(save_dir=str(tmp_path / "whole")) if save else config(), progress=False)
    whole = whole["rows"][0]
    resume = tmp_path / "resume"
    real_plan = torq.pipeline.layer_plan
    seen: list[int] = []
    stopping = [True]

    def stopping_plan(method, qconfig, ctx):
        plan = real_plan(method, qconfig, ctx)
        quantize = plan.quantize
        assert quantize is not None

        def stop(li, layer, groups, stats):
            seen.append(li)
            if stopping[0] and li == stop_at + 1:
                raise _Stop
            return quantize(li, layer, groups, stats)

        plan.quantize = stop
        return plan

    monkeypatch.setattr(torq.pipeline, "layer_plan", stopping_plan)
    with pytest.raises(_Stop):
        run(config(resume_dir=str(resume)), progress=False)
    kept = list(resume.rglob("layers-*.pt"))
    assert len(kept) == 1
    if save:  # the parts written so far wait beside the folder, which does not exist yet
        partial = list((tmp_path / "saved").glob(".*.partial"))
        assert len(partial) == 1 and list(partial[0].glob("model-layer-*.safetensors"))
        assert not list((tmp_path / "saved").glob("[!.]*"))
    assert torch.load(kept[0], weights_only=True)["next_layer"] == stop_at + 1
    monkeypatch.setattr(torq.pipeline, "layer_plan", real_plan)
    # another window count is another run: it does not take up this one's progress
    other = run(
        config(resume_dir=str(resume), max_windows=2, save_dir=str(tmp_path / "other")),
        progress=False,
    )["rows"][0]
    assert "resumed_at_layer" not in other["details"]
    seen.clear()
    stopping[0] = False
    monkeypatch.setattr(torq.pipeline, "layer_plan", stopping_plan)  # records the layers it runs
    monkeypatch.setattr(driver.progress, "PROGRESS_EVERY_S", 1e9)  # the last layer is kept anyway
    row = run(config(resume_dir=str(resume), max_windows=3), progress=False)
    again = row["rows"][0]
    assert seen == list(range(stop_at + 1, 3))
    assert again["details"]["resumed_at_layer"] == stop_at + 1
    assert again["ppl"] == whole["ppl"]
    for key in ("layers", "replaced"):  # every record but its times
        assert _untimed(again["details"].get(key)) == _untimed(whole["details"].get(key))
    assert len(again["details"]["streamed"]["per_layer"]) == 3  # every layer's steps
    assert list(resume.rglob("layers-*.pt")) == []  # done: nothing left to continue
    if save:
        assert not list((tmp_path / "saved").glob(".*"))  # the partial folder became the model
        ref, _, _ = load_quantized(whole["details"]["saved"]["path"])
        got, _, _ = load_quantized(again["details"]["saved"]["path"])  # checks its fingerprint
        ids = torch.randint(0, 300, (1, 24))
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, got(ids).logits)


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torq.driver import run_layerwise
    from torq.methods import MethodContext, get_method
    from torq.methods.layers import layer_plan
    from torq.models.streaming import LayerStream
    from torq.surgery.qlinear import QuantConfig

    def status(key):  # kB in /proc/self/status
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder, method = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    plan = layer_plan(get_method(method), QuantConfig.from_names("mxfp4", "mxfp4"), MethodContext())
    windows = torch.randint(0, 1000, (1, 64))
    source = LayerStream(folder)
    # the peak of this run alone: reset the high-water mark after the imports (Linux)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    out = run_layerwise(source, plan, None, windows, progress=False)
    peak = status("VmHWM")
    print(json.dumps({"base": base, "peak": peak, "ppl": out.perplexity.ppl}))
    """
)


def _peak_growth(folder: Path, method: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(folder), method],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["base"] > 0 and out["peak"] >= out["base"]
    return out["peak"] - out["base"]


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="reads /proc (Linux)")
def test_resident_peak_sees_a_step_and_restarts() -> None:
    """A step that holds 256 MiB for a moment has a peak at least that far above where it
    began; after a restart, a step that holds nothing has not."""
    import mmap
    import threading

    from torq.models.streaming import ResidentPeak

    class SlowSampler(ResidentPeak):
        """The watcher thread's samples go stale before they are stored (as on a loaded
        machine): a sample taken before a restart once landed in the stretch after it."""

        def _now(self) -> int:
            value = super()._now()
            if threading.current_thread() is self._thread:
                time.sleep(0.03)
            return value

    rss = SlowSampler(interval=0.001)
    try:
        rss.restart()
        before = rss.peak()
        # an anonymous mapping, touched and unmapped: its pages leave the resident set at
        # close, whatever the allocator would keep (in CI a freed 256 MiB tensor once
        # stayed resident, so the quiet stretch began as high as the step)
        held = mmap.mmap(-1, 256 * 2**20)
        page = b"\x01" * 2**20
        for _ in range(256):
            held.write(page)
        time.sleep(0.1)  # the watcher has sampled it
        held.close()
        step = rss.peak()
        rss.restart()
        time.sleep(0.1)  # the watcher's pending sample (taken while it was held) comes in
        quiet = rss.peak()
    finally:
        rss.close()
    assert before is not None and step is not None and quiet is not None
    assert step - before >= 240 * 2**20
    assert quiet < step - 200 * 2**20


def test_peak_memory_follows_one_layer_not_the_model(tmp_path) -> None:
    """Random llamas of 4 and 8 layers of 16.8M parameters each (the deeper one 136M
    parameters, 0.54 GB in float32), quantized with RTN and evaluated streamed, each in a
    fresh process: the peak resident set grows by a few layers' float32 size, and by the
    same amount at both depths (it follows one layer, not the model: the whole deeper model
    would be 8 layers, and 4 more than the shallower one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    growth = {}
    for depth in (4, 8):
        config = AutoConfig.for_model(
            "llama",
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=depth,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=1024,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        layer_bytes = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
        model_bytes = sum(p.numel() for p in model.parameters()) * 4
        model.save_pretrained(tmp_path / f"m{depth}")
        del model
        growth[depth] = _peak_growth(tmp_path / f"m{depth}", "rtn")
    assert layer_bytes * 8 == pytest.approx(model_bytes, rel=0.05)
    # the layer in float32, its quantized copy and working memory (measured: 2.8 layers)
    assert 0 < growth[8] < 5 * layer_bytes, (growth, layer_bytes, model_bytes)
    assert abs(growth[8] - growth[4]) < layer_bytes, (growth, layer_bytes)


@pytest.mark.parametrize("sequential", [False, True])
def test_hidden_states_on_disk_are_exact_and_bf16_close(
    sequential, tmp_path, data_dir, tiny_tokenizer, monkeypatch
) -> None:
    """``--hidden-states disk`` keeps float32 files, read one batch at a time: the numbers
    of the in-memory states, bit for bit, and no file left after the run; ``bfloat16``
    rounds the states between layers, so its numbers move, a little."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = _save("llama", tmp_path / "m", tiny_tokenizer)
    methods = ["fp", "torq+gptq"]
    rows = {}
    for mode in ("memory", "disk", "bfloat16"):
        cfg = _config(folder, data_dir, methods, sequential, hidden_states=mode)
        rows[mode] = run(cfg, progress=False)["rows"]
    assert [r["ppl"] for r in rows["disk"]] == [r["ppl"] for r in rows["memory"]]
    assert list((tmp_path / "tmp").glob("torq-hidden-*")) == []
    held = rows["disk"][1]["details"]["hidden_states"]
    assert held["calibration_bytes"] == held["evaluation_bytes"] == 0
    half = rows["bfloat16"][1]["details"]["hidden_states"]
    full = rows["memory"][1]["details"]["hidden_states"]
    assert 2 * half["calibration_bytes"] == full["calibration_bytes"] > 0
    for a, b in zip(rows["bfloat16"], rows["memory"], strict=True):
        assert a["ppl"] == pytest.approx(b["ppl"], rel=0.02)


def test_a_setting_added_at_its_default_keeps_the_progress_file_name() -> None:
    """A run's kept progress is found by a name made of its settings: a setting that a later
    torq adds, at its default, does not rename it (TORQ's guard, balancing check and fold,
    GPTQ's scale search, the groups TORQ calibrates, the block-mass permutation, the experts'
    shared down_proj transform, where TORQ's solvers run, the groups left unrotated and their
    balancing, the residual stream's Hadamard, the rotation check)."""
    from dataclasses import asdict

    from torq.driver import _stable_record
    from torq.methods.settings import TorqSettings
    from torq.surgery.gptq import GPTQConfig

    settings = asdict(TorqSettings())
    later = (
        "guard",
        "balance_check",
        "balance_probe",
        "fold",
        "calibrate",
        "unrotated",
        "unrotated_balance",
        "residual",
        "permute",
        "expert_down_shared",
        "solver_device",
        "rotation_check",
    )
    before = {k: v for k, v in settings.items() if k not in later}
    assert _stable_record({"settings": settings}) == {"settings": before}
    gptq = GPTQConfig().__dict__
    later_gptq = ("scale_search", "mse_norm", "asymmetry", "max_shift", "damp_scale", "input_noise")
    older = {k: v for k, v in gptq.items() if k not in later_gptq}
    assert _stable_record({"gptq": dict(gptq)}) == {"gptq": older}
    changed = _stable_record(
        {"settings": {**settings, "guard": 0.25, "fold": True, "calibrate": ("o_proj",)}}
    )
    assert changed["settings"]["guard"] == 0.25 and changed["settings"]["fold"] is True
    assert changed["settings"]["calibrate"] == ("o_proj",)
    assert _stable_record({"settings": {**settings, "permute": True}})["settings"]["permute"]
    checked = {**settings, "balance_check": True}
    assert _stable_record({"settings": checked})["settings"]["balance_check"] is True
    moved = {**settings, "solver_device": "cpu"}
    assert _stable_record({"settings": moved})["settings"]["solver_device"] == "cpu"
    plain = {**settings, "unrotated": ("q_proj",)}
    assert _stable_record({"settings": plain})["settings"]["unrotated"] == ("q_proj",)


def test_a_folded_balancing_streams_and_saves_as_the_whole_model(
    tmp_path, data_dir, tiny_tokenizer
) -> None:
    """``--fold-balance`` changes the norms and v/up rows of each layer as it is quantized:
    streamed, the perplexity is the whole model's bit for bit, and the folder saved while
    streaming loads to the same logits (the folded norms included)."""
    from torq.export import load_quantized

    folder = _save("llama", tmp_path / "llama", tiny_tokenizer)
    runs = {}
    for name, runner in (("whole", whole_model_run), ("streamed", run)):
        cfg = _config(folder, data_dir, ["torq-had32"], fold=True, save_dir=str(tmp_path / name))
        runs[name] = runner(cfg)["rows"][0]
    assert runs["whole"]["ppl"] == runs["streamed"]["ppl"]
    assert "'into': 'self_attn.v_proj'" in str(runs["streamed"]["details"]["layers"][0])
    ids = torch.randint(0, 300, (2, 24))
    (a, _, _), (b, _, _) = (load_quantized(r["details"]["saved"]["path"]) for r in runs.values())
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    float_norm = tiny_model("llama").model.layers[0].input_layernorm.weight
    assert not torch.equal(b.model.layers[0].input_layernorm.weight, float_norm)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gptaq_carries_the_float_states_beside_the_quantized_ones(
    arch, tmp_path, data_dir, tiny_tokenizer
) -> None:
    """``+gptaq``: every layer is calibrated on the quantized model's states with the float
    model's beside them. Streamed from the checkpoint it is the whole model in memory bit
    for bit, in memory or on disk; its weights differ from GPTQ's (each linear's target
    shifted by the cross term; fused experts keep GPTQ's loss)."""
    folder = _save(arch, tmp_path / arch, tiny_tokenizer)
    methods = ["had32+gptq", "had32+gptaq"]
    whole = whole_model_run(_config(folder, data_dir, methods))
    rows = {}
    for mode in ("memory", "disk"):
        rows[mode] = run(_config(folder, data_dir, methods, hidden_states=mode), progress=False)
    for got in rows.values():
        assert [r["ppl"] for r in got["rows"]] == [r["ppl"] for r in whole["rows"]]
    plain, asym = rows["memory"]["rows"]
    assert asym["ppl"] != plain["ppl"] and math.isfinite(asym["ppl"])
    layer = asym["details"]["layers"][1]
    shifts = [
        r["asymmetric_shift"]
        for g in layer.values()
        if isinstance(g, dict)
        for r in g.get("gptq", {}).values()
        if isinstance(r, dict) and "asymmetric_shift" in r
    ]
    assert shifts and all(s > 0 for s in shifts)
    assert asym["details"]["calibration"]["sequential"] is True


def test_gptaq_windows_carry_the_float_states_of_the_first_windows_only(
    tmp_path, data_dir, tiny_tokenizer
) -> None:
    """``--gptaq-windows N``: the float model's states go along on the first N calibration
    windows only. N at least the windows is every window's GPTAQ, bit for bit; fewer give
    another model, streamed as the whole model gives it, with its own settings key."""
    from torq.runs.store import setting_key

    folder = _save("llama", tmp_path / "llama", tiny_tokenizer)

    def with_windows(n: int) -> RunConfig:
        cfg = _config(folder, data_dir, ["had32+gptaq"])
        return replace(cfg, capture=replace(cfg.capture, reference_windows=n))

    every = run(_config(folder, data_dir, ["had32+gptaq"]), progress=False)["rows"][0]
    assert run(with_windows(3), progress=False)["rows"][0]["ppl"] == every["ppl"]
    one = run(with_windows(1), progress=False)
    assert one["rows"][0]["ppl"] == whole_model_run(with_windows(1))["rows"][0]["ppl"]
    assert one["rows"][0]["ppl"] != every["ppl"] and math.isfinite(one["rows"][0]["ppl"])
    keys = {setting_key(r, "had32+gptaq") for r in (with_windows(0).record(), one["config"])}
    assert len(keys) == 2


def test_auto_hidden_states_count_the_float_states_an_asymmetric_plan_carries() -> None:
    """``--hidden-states auto`` keeps the states in memory while they fit; GPTAQ's plan
    carries two sets of calibration states, so it goes to disk sooner."""
    from torq.pipeline import AUTO_HIDDEN_MEMORY_BYTES, hidden_states_mode

    calibration = CalibrationConfig(n_samples=4, seqlen=1024)
    hidden = AUTO_HIDDEN_MEMORY_BYTES // (4 * 1024 * 4) - 1  # one set fits, two do not
    config = RunConfig.of(model="m", seqlen=1024)
    plain = LayerPlan(None, calibration=calibration)
    asymmetric = LayerPlan(None, calibration=calibration, asymmetric=True)
    assert hidden_states_mode(config.evaluation, [plain], hidden, 0) == "memory"
    assert hidden_states_mode(config.evaluation, [plain, asymmetric], hidden, 0) == "disk"
    # the float states of the first window only: five windows' states fit, eight do not
    fewer = LayerPlan(None, calibration=calibration, asymmetric=True, reference_windows=1)
    five = AUTO_HIDDEN_MEMORY_BYTES // (5 * 1024 * 4)
    assert hidden_states_mode(config.evaluation, [fewer], five, 0) == "memory"
    assert hidden_states_mode(config.evaluation, [asymmetric], five, 0) == "disk"
