"""The command line: one-line errors, and a full run that records what produced it."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TF32_TINY_REL
from torq.cli import main
from torq.results import read_record


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--format", "mxfp5"], "unknown format 'mxfp5'"),
        (["run", "--max-windows", "0"], "positive integer"),
        (["run", "--scale-mode", "banana"], "invalid choice"),
        (["run", "--balance", "2"], "in [0, 1] or 'none'"),
        (["run", "--rotation-block", "12"], "invalid choice: 12"),
        (["run", "--calib-arithmetic", "bf16"], "invalid choice: 'bf16'"),
        (["run", "--torq-calibrate", "o_proj,1x"], "linear layer names such as o_proj"),
        (["run", "--methods", "torq-perm", "--balance", "none"], "needs the balancing"),
        (["run", "--methods", "torq-perm", "--balance-check"], "use one or the other"),
        (["run", "--balance-check", "gptaq"], "invalid choice: 'gptaq'"),
        (["run", "--methods", "nope", "--model", "x"], "unknown method 'nope'"),
        (["run", "--model", "no-such-model", "--methods", "fp"], "Known defaults: qwen2"),
        (["run", "--device", "banana", "--methods", "fp"], "unknown device 'banana'"),
        (["run", "--device", "meta", "--methods", "fp"], "device 'meta' is not supported"),
        (["generate", "--model", "x", "--device", "cpu", "--cuda-graph"], "needs a CUDA device"),
    ],
)
def test_bad_arguments_give_one_line(argv, needle, capsys) -> None:
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_destinations_and_methods_are_checked_before_any_work(
    tiny_checkpoint, tiny_data_dir, tmp_path, capsys, monkeypatch
) -> None:
    """A file where a folder goes (or the reverse), and a method named twice, are refused
    with one line before the model is loaded, not after the quantization they would waste."""
    import torq.pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(torq.pipeline, "load_model", no_load)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "a-folder").mkdir()
    base = ["run", "--model", str(tiny_checkpoint), "--data-dir", str(tiny_data_dir)]
    cases = [
        (["--methods", "rtn", "--out", str(a_file / "r.json")], f"{a_file} is a file"),
        (["--methods", "rtn", "--out", str(tmp_path / "a-folder")], "is a folder"),
        (["--methods", "rtn", "--save-dir", str(a_file)], "exists and is not a folder"),
        (["--methods", "rtn", "--save-dir", str(a_file / "sub")], f"{a_file} is a file"),
        (["--methods", "fp", "--resume-dir", str(a_file)], "--resume-dir"),
        (["--methods", "fp,rtn,fp"], "'fp' is given twice"),
        (["--methods", "gptq,RTN+gptq"], "'gptq' and 'RTN+gptq' are the same method"),
        # the tiny model has 4096 positions; TORQ's k_top cannot exceed its block of 32
        (["--methods", "rtn", "--seqlen", "5000"], "longer than the model's context (4096"),
        (["--methods", "torq", "--seqlen", "32", "--calib-seqlen", "6000"], "--calib-seqlen 6000"),
        (
            ["--methods", "torq", "--calib-seqlen", "32", "--seqlen", "32", "--k-top", "99"],
            "k_top=99",
        ),
        (  # torq's default (every column, 32) follows the block; a larger k_top is refused
            ["--methods", "torq", "--seqlen", "32", "--rotation-block", "16", "--k-top", "24"],
            "k_top=24 exceeds the block size 16",
        ),
        (
            [
                "--methods",
                "torq-had32",
                "--rotation-block",
                "16",
                "--save-dir",
                str(tmp_path / "ct"),
                "--save-format",
                "compressed-tensors",
                "--fold-balance",
            ],
            "not blocks of 16: drop --rotation-block",
        ),
        (["--methods", "rtn", "--scale-mode", "4over6"], "a rule of NVFP4, not of the formats"),
        (
            [
                *("--methods", "rtn", "--format", "nvfp4", "--act-scale", "static"),
                *("--scale-mode", "4over6", "--save-dir", str(tmp_path / "ct")),
                *("--save-format", "compressed-tensors"),
            ],
            "Four Over Six activations (--scale-mode 4over6) are not exported",
        ),
    ]
    for extra, needle in cases:
        code, _, err = _run([*base, *extra], capsys)
        assert code == 2, (extra, err)
        assert needle in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err
    assert a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder", "tiny-llama"]


def test_missing_data_is_found_before_any_work(
    tiny_checkpoint, tiny_data_dir, tmp_path, capsys, monkeypatch
) -> None:
    """A calibration corpus, WikiText-2 test file or zero-shot file that is not there is
    reported before the model is loaded, not when the method that reads it starts (after
    the methods before it have run)."""
    import torq.eval.zeroshot
    import torq.pipeline

    class Loaded(Exception):
        pass

    def no_load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(torq.pipeline, "load_model", no_load)
    monkeypatch.setattr(torq.pipeline, "model_folder", no_load)
    monkeypatch.setattr(torq.eval.zeroshot, "hub_reachable", lambda timeout=3.0: False)
    # a data folder of its own: other tests add files to the shared tiny one
    data = tmp_path / "data"
    (data / "wikitext-2-raw").mkdir(parents=True)
    test_file = Path("wikitext-2-raw") / "wiki.test.raw"
    (data / test_file).write_bytes((tiny_data_dir / test_file).read_bytes())
    corpus = data / "wikitext-2" / "wiki.valid.tokens"
    empty = tmp_path / "empty-data"
    empty.mkdir()
    base = ["--model", str(tiny_checkpoint), "--data-dir", str(data)]
    no_corpus = f"calibration corpus file not found: expected {corpus}"
    cases = [
        (["run", *base, "--methods", "fp,rtn,torq"], f"method 'torq' calibrates: {no_corpus}"),
        (["run", *base, "--methods", "rtn,gptq"], "method 'gptq' calibrates"),
        (["run", *base, "--methods", "had32+gptq"], "method 'had32+gptq' calibrates"),
        (["run", *base, "--methods", "quarot+gptq"], "method 'quarot+gptq' calibrates"),
        (["run", *base, "--methods", "torq-had32"], "method 'torq-had32' calibrates"),
        (
            ["run", "--model", str(tiny_checkpoint), "--data-dir", str(empty), "--methods", "rtn"],
            "WikiText-2 test file not found",
        ),
        (
            ["eval", *base, "--methods", "fp", "--tasks", "piqa", "--limit", "2"],
            "zero-shot data not found (expected",
        ),
        (
            ["run", *base, "--methods", "fp", "--eval-corpus", "wikipedia-en"],
            "perplexity text file not found: expected",
        ),
        (
            ["run", *base, "--methods", "fp", "--eval-corpus", "wikipedia"],
            "perplexity text file not found: wikipedia (known: wikitext2-test, wikipedia-en)",
        ),
    ]
    for argv, needle in cases:
        code, _, err = _run(argv, capsys)
        assert code == 2, (argv, err)
        assert needle in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    # methods that read no calibration data get past the check to the model
    for methods in ("fp,rtn,had32,quarot", "hadfull"):
        with pytest.raises(Loaded):
            main(["run", *base, "--methods", methods])


def test_lists(capsys) -> None:
    assert _run(["methods"], capsys)[1].count("\n") >= 2
    assert "smollm2-135m" in _run(["models"], capsys)[1]


def test_run_end_to_end_on_a_tiny_checkpoint(
    tiny_checkpoint, tiny_data_dir, tmp_path, capsys
) -> None:
    out = tmp_path / "res.json"
    argv = [
        "run",
        "--model",
        str(tiny_checkpoint),
        "--methods",
        "fp,rtn",
        "--seqlen",
        "64",
        "--max-windows",
        "3",
        "--data-dir",
        str(tiny_data_dir),
        "--out",
        str(out),
        "--no-progress",
    ]
    code, stdout, stderr = _run(argv, capsys)
    assert code == 0
    assert "| fp |" in stdout and "| rtn |" in stdout
    # --no-progress: no bars, transformers' loading bar included, and only for the command
    from transformers.utils import logging as hf_logging

    assert "Loading weights" not in stderr and "it/s]" not in stderr
    assert hf_logging.is_progress_bar_enabled()
    res = read_record(out)
    assert [r["method"] for r in res["rows"]] == ["fp", "rtn"]
    fp, rtn = res["rows"]
    assert math.isfinite(fp["ppl"]) and math.isfinite(rtn["ppl"]) and fp["ppl"] != rtn["ppl"]
    assert (fp["weights"], rtn["weights"], rtn["activations"]) == ("fp", "mxfp4", "mxfp4")
    assert res["eval"] == {
        "dataset": "wikitext-2-raw test",
        "n_windows": 3,
        "window_sample": None,
        "seqlen": 64,
        "zeroshot_tasks": [],
        "zeroshot_limit": None,
        "zeroshot_subset": None,
    }
    # each method with its own settings (none for these two), the run's capture beside them
    assert res["config"]["methods"] == [
        {"name": "fp", "settings": None, "gptq": None},
        {"name": "rtn", "settings": None, "gptq": None},
    ]
    assert "torq" not in res["config"] and res["config"]["capture"]["reservoir_tokens"] == 1024
    assert res["config"]["max_windows"] == 3
    for key in ("command", "versions", "machine", "wall_seconds", "date", "quant_config"):
        assert res[key]
    assert rtn["eval_tokens_per_s"] > 0
    assert out.with_suffix(".md").read_text().startswith("`")


def test_a_window_sample_scores_the_same_windows_for_every_row(
    tiny_checkpoint, tiny_data_dir, tmp_path, capsys
) -> None:
    """``--window-sample``: the record names the windows drawn and of how many; each row's
    per-window NLLs are those windows' of a run over the whole test; ×FP is the paired
    estimate with its interval."""
    common = ["--model", str(tiny_checkpoint), "--seqlen", "64", "--data-dir", str(tiny_data_dir)]
    common += ["--no-progress"]
    whole_out, sample_out = tmp_path / "whole.json", tmp_path / "sample.json"
    assert _run(["run", *common, "--methods", "fp", "--out", str(whole_out)], capsys)[0] == 0
    argv = ["run", *common, "--methods", "fp,rtn", "--window-sample", "3"]
    code, stdout, _ = _run([*argv, "--window-sample-seed", "5", "--out", str(sample_out)], capsys)
    assert code == 0
    whole, sample = read_record(whole_out), read_record(sample_out)
    drawn = sample["eval"]["window_sample"]
    assert drawn["n"] == 3 and drawn["seed"] == 5 and drawn["of"] == whole["eval"]["n_windows"]
    assert drawn["ids"] == sorted(drawn["ids"]) and sample["eval"]["n_windows"] == 3
    all_nll = whole["rows"][0]["details"]["perplexity"]["window_nll"]
    fp, rtn = sample["rows"]
    assert fp["details"]["perplexity"]["window_nll"] == pytest.approx(
        [all_nll[i] for i in drawn["ids"]], rel=1e-9
    )
    assert len(rtn["details"]["perplexity"]["window_nll"]) == 3
    assert "drawn at random (seed 5)" in stdout and re.search(
        r"\| [\d.]+ \([\d.]+–[\d.]+\) \|", stdout
    )
    both = [*argv, "--max-windows", "2", "--out", str(tmp_path / "x.json")]
    code, _, err = _run(both, capsys)
    assert code == 2 and "either --max-windows" in err and len(err.strip().splitlines()) == 1


def test_weight_only_flag(tiny_checkpoint, tiny_data_dir, tmp_path, capsys) -> None:
    out = tmp_path / "w.json"
    argv = [
        "run",
        "--model",
        str(tiny_checkpoint),
        "--methods",
        "rtn",
        "--a-format",
        "none",
        "--format",
        "nvfp4",
        "--seqlen",
        "64",
        "--max-windows",
        "1",
        "--data-dir",
        str(tiny_data_dir),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert _run(argv, capsys)[0] == 0
    row = read_record(out)["rows"][0]
    assert (row["weights"], row["activations"]) == ("nvfp4", "fp")


def test_console_script_module_entry() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torq.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "run" in proc.stdout


def test_a_closed_pipe_ends_quietly() -> None:
    """`torq methods | head`: when the reader has gone, torq stops without a traceback and
    reports what a process ended by SIGPIPE does."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torq.cli", "methods"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before torq writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.slow
def test_real_model_fp_and_rtn(shared_data, tmp_path, capsys) -> None:
    """SmolLM2-135M, one 512-token window: FP equals its own loss; W4A4 RTN is worse."""
    from torq.eval import load_wikitext2_test, windows_from_text
    from torq.models import load

    out = tmp_path / "real.json"
    argv = [
        "run",
        "--model",
        "smollm2-135m",
        "--methods",
        "fp,rtn",
        "--seqlen",
        "512",
        "--max-windows",
        "1",
        "--data-dir",
        str(shared_data),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert _run(argv, capsys)[0] == 0
    fp, rtn = read_record(out)["rows"]
    lm = load("smollm2-135m")
    w = windows_from_text(load_wikitext2_test(shared_data), lm.tokenizer, 512, 1)
    with torch.no_grad():
        loss = lm.model(input_ids=w, labels=w).loss.item()
    assert fp["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert rtn["ppl"] > 1.2 * fp["ppl"]


def test_partial_results_are_saved_after_each_method(tiny_checkpoint, tiny_data_dir) -> None:
    """A long comparison loses nothing that already ran: ``on_row`` gets the record after
    each method but the last, marked incomplete."""
    from torq.pipeline import run
    from torq.runs.config import RunConfig

    seen = []
    cfg = RunConfig.of(
        model=str(tiny_checkpoint),
        methods=["fp", "rtn", "had32"],
        seqlen=64,
        max_windows=1,
        data_dir=str(tiny_data_dir),
    )
    final = run(cfg, progress=False, on_row=lambda rec: seen.append(rec))
    assert [len(r["rows"]) for r in seen] == [1, 2]
    assert not any(r["complete"] for r in seen) and final["complete"]
    assert [r["method"] for r in final["rows"]] == ["fp", "rtn", "had32"]


def test_balance_check_takes_the_weights_it_scores_with() -> None:
    """``--balance-check`` alone scores with RTN's weights, ``--balance-check gptq`` with
    GPTQ's; without it no group is checked."""
    from torq.cli import build_parser, torq_settings_from_args

    parser = build_parser(show_all=True)
    for extra, check, probe in (
        ([], False, "rtn"),
        (["--balance-check"], True, "rtn"),
        (["--balance-check", "gptq"], True, "gptq"),
        (["--balance-check", "--fold-balance"], True, "rtn"),
    ):
        settings = torq_settings_from_args(parser.parse_args(["run", *extra]))
        assert (settings.balance_check, settings.balance_probe) == (check, probe)


@pytest.mark.parametrize("paper", [False, True])
def test_torq_defaults_and_paper_flag_are_recorded(
    paper, tiny_checkpoint, tiny_data_dir, tmp_path, capsys
) -> None:
    """``torq`` runs with torq's balancing and Hadamard start by default; ``--paper`` gives
    the paper's method; either way the settings that ran are in the JSON."""
    corpus = tmp_path / "calib.txt"
    corpus.write_text((tiny_data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text())
    out = tmp_path / "t.json"
    argv = [
        "run", "--model", str(tiny_checkpoint), "--methods", "torq", "--seqlen", "64",
        "--max-windows", "1", "--data-dir", str(tiny_data_dir), "--calib-corpus", str(corpus),
        "--calib-samples", "2", "--calib-seqlen", "32", "--max-iter", "1", "--reservoir", "16",
        "--out", str(out), "--no-progress",
    ] + (["--paper"] if paper else [])  # fmt: skip
    assert _run(argv, capsys)[0] == 0
    row = read_record(out)["rows"][0]
    settings = row["details"]["settings"]
    if paper:
        assert settings["balance"] is None
        assert (settings["intra"]["init"], settings["intra"]["k_top"]) == ("identity", None)
    else:
        assert settings["balance"] == 0.5
        assert (settings["intra"]["init"], settings["intra"]["k_top"]) == ("hadamard", 32)
    assert math.isfinite(row["ppl"])


def test_a_rotation_block_of_16_for_nvfp4(tiny_checkpoint, tiny_data_dir, tmp_path, capsys) -> None:
    """``--rotation-block 16`` (NVFP4's block): TORQ's rotations and ``torq-had32``'s
    Hadamard act on blocks of 16, every column of a block a candidate (``k_top`` 16), beside
    the plain ``had16``; the settings that ran are recorded, and the run's quantized models
    reload with them (the kept model's transforms are of 16)."""
    corpus = tmp_path / "calib.txt"
    corpus.write_text((tiny_data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text())
    out = tmp_path / "k16.json"
    argv = [
        "run", "--model", str(tiny_checkpoint), "--methods", "had16,torq-had32,torq",
        "--format", "nvfp4", "--rotation-block", "16", "--seqlen", "64", "--max-windows", "1",
        "--data-dir", str(tiny_data_dir), "--calib-corpus", str(corpus), "--calib-samples", "2",
        "--calib-seqlen", "32", "--max-iter", "1", "--reservoir", "16", "--out", str(out),
        "--save-dir", str(tmp_path / "saved"), "--no-progress",
    ]  # fmt: skip
    assert _run(argv, capsys)[0] == 0
    rows = {r["method"]: r for r in read_record(out)["rows"]}
    assert rows["had16"]["details"]["group_by_width"] == {"64": 16, "128": 16}
    for method in ("torq-had32", "torq"):
        settings = rows[method]["details"]["settings"]
        assert (settings["block_size"], settings["intra"]["k_top"]) == (16, 16)
        assert math.isfinite(rows[method]["ppl"])
    from torq.export import load_quantized
    from torq.rotations.transform import BlockRotation

    for method in ("had16", "torq"):
        (folder,) = (tmp_path / "saved").glob(f"*-{method}")
        model = load_quantized(folder)[0]
        blocks = {m.block_size for m in model.modules() if isinstance(m, BlockRotation)}
        assert blocks == {16}, (method, blocks)


def test_cuda_asked_for_without_cuda_is_an_error(tiny_checkpoint, monkeypatch, capsys) -> None:
    """``--device cuda`` never falls back to a silent CPU run; ``auto`` does. (A model of its
    own: where the default model's package is missing, that is said first.)"""
    from torq.runs.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["run", "--model", str(tiny_checkpoint), "--device", "cuda", "--methods", "fp"]
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert "torch sees no CUDA device" in err and "Traceback" not in err
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def _cpu_and_gpu_perplexities(
    checkpoint: Path,
    data_dir: Path,
    methods: list[str],
    fold: bool = False,
    gpu_arithmetic: str = "exact",
    solver_device: str = "cpu",
    **formats: str,
) -> dict[str, dict[str, float]]:
    """Each method's perplexity from the same run on the CPU and on the GPU (small
    calibration, two windows; ``fold``: torq's balancing folded into the producers;
    ``gpu_arithmetic``: the GPU run's calibration arithmetic, the CPU's being exact;
    ``solver_device``: where the GPU run's TORQ solvers run)."""
    from torq.calibration.data import CalibrationConfig, CaptureSettings
    from torq.methods.registry import method_specs
    from torq.methods.settings import TorqSettings
    from torq.pipeline import run
    from torq.runs.config import RunConfig

    corpus = data_dir / "wikitext-2-raw" / "wiki.test.raw"
    calibration = CalibrationConfig(corpus=str(corpus), n_samples=2, seqlen=32)
    rows = {}
    for device in ("cpu", "cuda"):
        cfg = RunConfig.of(
            model=str(checkpoint),
            methods=method_specs(
                methods,
                TorqSettings(fold=fold, solver_device=solver_device if device == "cuda" else "cpu"),
            ),
            seqlen=64,
            max_windows=2,
            data_dir=str(data_dir),
            capture=CaptureSettings(
                calibration,
                reservoir_tokens=16,
                arithmetic=gpu_arithmetic if device == "cuda" else "exact",
            ),
            device=device,
            **formats,
        )
        rows[device] = {r["method"]: r["ppl"] for r in run(cfg, progress=False)["rows"]}
    return rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_matches_cpu_run(tiny_checkpoint, tiny_data_dir) -> None:
    """The same comparison on the GPU and on the CPU: every method's transforms move with
    the model (calibration forward, statistics and GPTQ on the GPU, solvers on the CPU),
    same perplexities."""
    methods = ["fp", "rtn", "had32", "quarot+gptq", "torq", "torq+gptq", "torq-had32+gptaq"]
    methods += ["wush+gptq"]
    rows = _cpu_and_gpu_perplexities(tiny_checkpoint, tiny_data_dir, methods)
    for method, ppl in rows["cpu"].items():
        assert math.isfinite(rows["cuda"][method])
        assert rows["cuda"][method] == pytest.approx(ppl, rel=0.02), method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_solvers_match_cpu_solvers(tiny_checkpoint, tiny_data_dir) -> None:
    """TORQ's two solvers on the GPU (``solver_device="calibration"``, the angle search's
    batched sweeps): the quantized models score as the CPU's solvers make them, within 2 %."""
    methods = ["torq", "torq+gptaq", "torq-had32+gptaq"]
    rows = _cpu_and_gpu_perplexities(
        tiny_checkpoint, tiny_data_dir, methods, solver_device="calibration"
    )
    for method, ppl in rows["cpu"].items():
        assert rows["cuda"][method] == pytest.approx(ppl, rel=0.02), method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tf32_calibration_matches_cpu_exact(tiny_checkpoint, tiny_data_dir) -> None:
    """The calibration's forwards and statistics in TF32 on the GPU: the quantized models
    score as the CPU's exact calibration does, within what a new calibration seed moves
    them (:data:`tests.conftest.TF32_TINY_REL`)."""
    methods = ["had32+gptq", "torq-had32+gptaq", "torq+gptq"]
    rows = _cpu_and_gpu_perplexities(tiny_checkpoint, tiny_data_dir, methods, gpu_arithmetic="tf32")
    for method, ppl in rows["cpu"].items():
        assert rows["cuda"][method] == pytest.approx(ppl, rel=TF32_TINY_REL), method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_static_activation_scales_match_cpu(tiny_checkpoint, tiny_data_dir) -> None:
    """NVFP4 W4A4 with static activation tensor scales on the GPU: observed there (the
    amax taken off the device), the perplexities the CPU gives."""
    rows = _cpu_and_gpu_perplexities(
        tiny_checkpoint,
        tiny_data_dir,
        ["rtn", "had32", "torq-had32"],
        weight_format="nvfp4",
        act_format="nvfp4",
        act_scale="static",
    )
    for method, ppl in rows["cpu"].items():
        assert math.isfinite(rows["cuda"][method])
        assert rows["cuda"][method] == pytest.approx(ppl, rel=0.02), method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_folded_balance_matches_cpu(tiny_checkpoint, tiny_data_dir) -> None:
    """``--fold-balance`` on the GPU: the balancing scales (computed on the CPU) are folded
    into the norms and rows of layers that live on the GPU, giving the CPU's perplexities."""
    rows = _cpu_and_gpu_perplexities(
        tiny_checkpoint, tiny_data_dir, ["torq-had32", "torq-had32+gptq"], fold=True
    )
    for method, ppl in rows["cpu"].items():
        assert math.isfinite(rows["cuda"][method])
        assert rows["cuda"][method] == pytest.approx(ppl, rel=0.02), method


def test_default_methods_are_fp_and_the_default_recipe(
    tiny_checkpoint, tiny_calibration_data_dir, tmp_path, capsys
) -> None:
    """Without ``--methods`` a float model is evaluated in FP and quantized with the
    ``default`` recipe, with its settings: its method, its balancing folded and its MXFP4
    scale rule; the same numbers as the recipe's method named with those flags."""
    from torq.methods.recipes import get_recipe

    recipe = get_recipe("default")
    base = [
        "run", "--model", str(tiny_checkpoint), "--seqlen", "64", "--max-windows", "2",
        "--calib-samples", "2", "--calib-seqlen", "32", "--data-dir",
        str(tiny_calibration_data_dir), "--no-progress",
    ]  # fmt: skip
    out = tmp_path / "res.json"
    code, _, _ = _run([*base, "--out", str(out)], capsys)
    assert code == 0
    record = read_record(out)
    rows = record["rows"]
    assert [r["method"] for r in rows] == ["fp", recipe.method]
    assert math.isfinite(rows[1]["ppl"]) and rows[1]["ppl"] != rows[0]["ppl"]
    named = tmp_path / "named.json"
    flags = ["--methods", recipe.method, "--fold-balance", "--scale-mode", recipe.scale_mode]
    code, _, _ = _run([*base, *flags, "--out", str(named)], capsys)
    assert code == 0
    assert read_record(named)["rows"][0]["ppl"] == rows[1]["ppl"]
    code, listing, _ = _run(["methods"], capsys)
    assert code == 0 and "without it, fp and the default recipe" in listing
    # the help names the recipe literally (the parser does not import the methods): keep it so
    from torq.cli import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    (methods,) = [a for a in run._actions if "--methods" in a.option_strings]
    assert f"recipe ({recipe.method}," in methods.help


class _Stop(Exception):
    pass


def test_a_restart_reuses_each_finished_row(
    tiny_checkpoint, tiny_data_dir, tmp_path, monkeypatch
) -> None:
    """With ``--resume-dir`` each method's finished row is kept: a run stopped in its third
    method keeps the first two rows (saved as it went), and the same command again
    quantizes only the third; every row is the row of a run never stopped."""

    import torq.pipeline

    calls: list[str] = []
    stop = ["torq"]
    original = torq.pipeline._stream_method

    def counted(config, method, *args, **kwargs):
        calls.append(method.name)
        if method.name in stop:
            raise _Stop
        return original(config, method, *args, **kwargs)

    monkeypatch.setattr(torq.pipeline, "_stream_method", counted)
    corpus = tmp_path / "calib.txt"
    corpus.write_text((tiny_data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text())
    args = [
        "run", "--model", str(tiny_checkpoint), "--methods", "fp,had32,torq",
        "--seqlen", "64", "--max-windows", "2", "--data-dir", str(tiny_data_dir),
        "--calib-corpus", str(corpus), "--calib-samples", "2", "--calib-seqlen", "32",
        "--max-iter", "1", "--reservoir", "16", "--no-progress",
    ]  # fmt: skip
    keep = ["--resume-dir", str(tmp_path / "keep")]
    with pytest.raises(_Stop):
        main([*args, *keep, "--out", str(tmp_path / "a.json")])
    partial = read_record(tmp_path / "a.json")  # saved after each method
    assert not partial["complete"]
    assert [r["method"] for r in partial["rows"]] == ["fp", "had32"]
    calls.clear()
    stop.clear()
    assert main([*args, *keep, "--out", str(tmp_path / "b.json")]) == 0
    assert calls == ["torq"]
    again = read_record(tmp_path / "b.json")["rows"]
    assert [r["details"].get("finished_row") is not None for r in again] == [True, True, False]
    assert main([*args, "--out", str(tmp_path / "c.json")]) == 0
    never = read_record(tmp_path / "c.json")["rows"]
    assert [r["ppl"] for r in again] == [r["ppl"] for r in never]
    # another window count is another row: measured, not taken from the kept one
    calls.clear()
    other = list(args)
    other[other.index("--max-windows") + 1] = "1"
    assert main([*other, *keep, "--out", str(tmp_path / "d.json")]) == 0
    assert calls == ["fp", "had32", "torq"]


def test_the_command_line_shows_no_library_noise(tiny_checkpoint, tiny_data_dir, tmp_path) -> None:
    """A run prints torq's lines and its table; not torchao's note that its GPU extensions
    do not load on this machine, nor torch's advice to library authors (both printed by
    every run before, in a fresh process)."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "torq.cli", "run", "--model", str(tiny_checkpoint),
            "--methods", "rtn", "--seqlen", "32", "--max-windows", "1", "--no-progress",
            "--data-dir", str(tiny_data_dir), "--out", str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr
    assert "rtn" in proc.stdout


def test_perplexity_on_another_text(tiny_checkpoint, tiny_data_dir, tmp_path) -> None:
    """``--eval-corpus wikipedia-en`` measures the first windows of the held-out Wikipedia
    text (the number a direct evaluation of those windows gives), records which text, keeps
    its windows apart from WikiText-2's in a resume folder, and streams to the same numbers."""

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import TINY_TEXT
    from torq.eval import perplexity, windows_from_text

    data = tmp_path / "data"
    for rel in ("wikitext-2-raw/wiki.test.raw",):
        (data / rel).parent.mkdir(parents=True)
        (data / rel).write_bytes((tiny_data_dir / rel).read_bytes())
    other = " ".join(reversed(TINY_TEXT.split())) + " \n"
    (data / "wikipedia-en").mkdir()
    (data / "wikipedia-en" / "bigbench_paragraph_segmentation.txt").write_text(other * 40)
    args = [
        "run", "--model", str(tiny_checkpoint), "--methods", "fp,rtn", "--seqlen", "64",
        "--max-windows", "3", "--data-dir", str(data), "--no-progress",
        "--resume-dir", str(tmp_path / "keep"),
    ]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "wiki2.json")]) == 0
    assert main([*args, "--eval-corpus", "wikipedia-en", "--out", str(tmp_path / "wp.json")]) == 0
    results = {name: read_record(tmp_path / f"{name}.json") for name in ("wiki2", "wp")}
    assert results["wiki2"]["eval"]["dataset"] == "wikitext-2-raw test"
    assert results["wp"]["eval"]["dataset"] == "wikipedia-en"
    ppl = {name: {r["method"]: r["ppl"] for r in res["rows"]} for name, res in results.items()}
    assert ppl["wp"]["fp"] != ppl["wiki2"]["fp"] and ppl["wp"]["rtn"] != ppl["wiki2"]["rtn"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), torch_dtype="float32")
    windows = windows_from_text(other * 40, tokenizer, 64, 3)
    assert perplexity(model.eval(), windows, progress=False).ppl == ppl["wp"]["fp"]
    # each text's finished row kept in a file of its own (named by its windows' tokens),
    # beside the other's, and each holds its own perplexity
    kept = sorted((tmp_path / "keep").glob("*/fp-*/row-*.json"))
    assert len(kept) == 2
    assert sorted(read_record(p)["ppl"] for p in kept) == sorted(
        [ppl["wp"]["fp"], ppl["wiki2"]["fp"]]
    )


def test_moe_checkpoint_experts_calibrated(tiny_tokenizer, tiny_data_dir, tmp_path) -> None:
    """A Qwen3-MoE folder through ``torq run``: TORQ + GPTQ transform and quantize its
    experts (recorded per layer), ``--expert-down shared`` gives one down_proj transform
    and is recorded, and the streamed run gives the same numbers."""

    from tests.conftest import tiny_model

    folder = tmp_path / "tiny-moe"
    tiny_model("qwen3_moe").save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    corpus = tmp_path / "calib.txt"
    corpus.write_text((tiny_data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text())
    args = [
        "run", "--model", str(folder), "--methods", "torq+gptq", "--seqlen", "64",
        "--max-windows", "2", "--data-dir", str(tiny_data_dir), "--calib-corpus", str(corpus),
        "--calib-samples", "2", "--calib-seqlen", "32", "--max-iter", "1", "--reservoir", "16",
        "--expert-down", "shared", "--no-progress",
    ]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a.json")]) == 0
    rows = [read_record(tmp_path / "a.json")["rows"][0]]
    assert rows[0]["details"]["settings"]["expert_down_shared"] is True
    layers = [r for r in rows[0]["details"]["layers"] if "experts" in r]
    assert len(layers) == 2
    for r in layers:
        assert "down_proj" in r["experts"] and "down_proj_own_transform" not in r["experts"]
        assert r["experts"]["gptq_rtn_fallback"] == []
