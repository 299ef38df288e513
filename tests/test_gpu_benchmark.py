"""``benchmarks/gpu.py`` on a CPU with the tiny shape: its parts run and record what they
measure; on a CPU the accelerated model's NLL is the fake-quant model's exactly."""

from __future__ import annotations

from benchmarks.gpu import main

from torq.results import read_record


def test_the_gpu_benchmark_runs_on_a_cpu_with_the_tiny_shape(tmp_path) -> None:
    out = tmp_path / "out"
    args = ["--shape", "tiny", "--device", "cpu", "--windows", "2", "--seqlen", "32"]
    parts = "calibration,calibration-tf32,decode,torq+gptq,torq+gptq-device-solvers,steps"
    args += ["--layers", "2", "--new-tokens", "2", "--parts", parts]
    main([*args, "--dir", str(tmp_path / "ck"), "--out", str(out)])
    rec = read_record(out / "gpu.json")
    cal, fast, torq_cpu, torq_device = rec["calibration"]
    assert cal["method"] == "torq-had32+gptaq" and cal["layers"] == 2 and cal["windows"] == 2
    assert cal["estimate"]["full_model_seconds"] > 0
    # the same recipe with float32 statistics (TF32 on a GPU): a few of GPTQ's rounding
    # choices flip (0.16 % of its loss on these 64 random tokens), so close, not equal
    assert (cal["arithmetic"], fast["arithmetic"]) == ("exact", "tf32")
    assert cal["proxy_loss"] > 0 and fast["proxy_loss"] != cal["proxy_loss"]
    assert abs(fast["proxy_loss"] - cal["proxy_loss"]) <= 1e-2 * cal["proxy_loss"]
    # TORQ's solvers on "the calibration's device": here the CPU too, so the same model
    assert (torq_cpu["solver_device"], torq_device["solver_device"]) == ("cpu", "calibration")
    assert torq_cpu["method"] == torq_device["method"] == "torq+gptq"
    assert torq_cpu["proxy_loss"] == torq_device["proxy_loss"] > 0
    assert "| torq+gptq | exact | the GPU |" in (out / "gpu.md").read_text()
    dec = rec["decode"]
    assert dec["nll_relative_difference"] == 0.0
    assert "28 layers on torq's MXFP4 W4A4 kernels" in dec["accelerate"]
    assert {"bf16 batch 1", "torq W4A4 batch 16", "ratio batch 1"} <= set(dec["tokens_per_s"])
    assert "| generate, batch 1 |" in (out / "gpu.md").read_text()
    steps = rec["steps"]
    assert steps["cpu"]["per_layer"][0]["solve_seconds"] > 0
    assert set(steps["next_layer_load_seconds"]) == {"cpu", "gpu"}
    assert "| load, a layer after the first" in (out / "gpu.md").read_text()


def test_the_arithmetic_part_quantizes_a_checkpoint_both_ways(
    tmp_path, tiny_checkpoint, tiny_calibration_data_dir
) -> None:
    """``--parts arithmetic``: the real-model path of ``torq quantize`` with exact and TF32
    calibration, each folder scored through transformers (on a CPU, "tf32" takes only the
    statistics' products in float32: a perplexity close to the exact one's)."""
    out = tmp_path / "out"
    args = ["--device", "cpu", "--parts", "arithmetic", "--model", str(tiny_checkpoint)]
    args += ["--data-dir", str(tiny_calibration_data_dir), "--calib-samples", "2"]
    args += ["--seqlen", "32", "--eval-windows", "2", "--dir", str(tmp_path / "ck")]
    main([*args, "--out", str(out)])
    rec = read_record(out / "gpu.json")["arithmetic"]
    for how in ("exact", "tf32"):
        assert rec[how]["windows"] == 2 and rec[how]["seconds"] > 0
        assert rec[how]["ppl"] > 1.0
    assert rec["ppl_ratio_tf32_to_exact"] == rec["tf32"]["ppl"] / rec["exact"]["ppl"]
    assert abs(rec["ppl_ratio_tf32_to_exact"] - 1.0) < 0.02
    assert "| tf32 |" in (out / "gpu.md").read_text()
