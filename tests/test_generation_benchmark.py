"""``benchmarks/humaneval.py --resume-dir``: a method's quantized model and its answers are
kept, so the same command again neither calibrates nor generates what it already has."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import SHARED_DATA
from torq.results import read_record

ROOT = Path(__file__).resolve().parents[1]
# `python -m benchmarks.NAME` finds the package from anywhere
RUN_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _gsm8k_rtn(checkpoint: Path) -> list[str]:
    """The benchmark's command line for RTN on two GSM8K problems of ``checkpoint``."""
    return [
        "-m", "benchmarks.humaneval",
        "--task", "gsm8k", "--n", "2",
        "--model", str(checkpoint),
        "--methods", "rtn",
        "--data-dir", str(SHARED_DATA),
    ]  # fmt: skip


def test_the_same_command_again_reuses_the_kept_model_and_answers(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    out, resume = tmp_path / "gsm8k.json", tmp_path / "resume"
    args = [*_gsm8k_rtn(tiny_checkpoint), "--resume-dir", str(resume), "--batch-size", "2"]
    args += ["--out", str(out)]
    rows = []
    for _ in range(2):
        out.unlink(missing_ok=True)  # the record would skip the method: run it again
        done = subprocess.run(
            [sys.executable, *args], env=RUN_ENV, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        rows.append(read_record(out)["rows"][0])
    first, again = rows
    (kept,) = resume.glob("gsm8k-rtn-*")
    assert (kept / "quantized-model.pt").is_file()
    # reloaded, not quantized again: the row reports the first session's calibration time
    assert again["quantize_seconds"] == first["quantize_seconds"]
    assert first["request_cache"]["entries_before"] == 0
    assert first["request_cache"]["entries_after"] == 2
    assert again["request_cache"]["entries_before"] == 2  # nothing generated again
    assert again["answers"] == first["answers"]
    # the two problems were generated together; the session says so
    assert first["batch_size"] == 2
    assert [s["batch_size"] for s in again["request_cache"]["sessions"]] == [2, 2]
    # a row is not continued with another batch size (it would change W4A4 answers)
    out.unlink()
    other = [*args[:-2], "--batch-size", "1", *args[-2:]]
    done = subprocess.run(
        [sys.executable, *other], env=RUN_ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    assert "holds answers generated with --batch-size 2" in done.stderr
    assert not out.exists()


def _record(path: Path, method: str, passed: list[int], calib_seed: int = 0) -> Path:
    tasks = {f"HumanEval/{i}": {"pass@1": float(p)} for i, p in enumerate(passed)}
    row = {"method": method, "pass@1": sum(passed) / len(passed), "problems": len(passed)}
    record = {"task": "humaneval", "model": "m", "rows": [{**row, "tasks": tasks}]}
    record["calib_seed"] = calib_seed
    path.write_text(json.dumps(record))
    return path


def test_humaneval_rows_are_compared_problem_by_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row against the reference (FP) on the same problems: the paired difference,
    the problems only one of the two solves and McNemar's p; a method in two records is
    refused."""
    bench_paired = _benchmark(monkeypatch, "humaneval_paired")
    fp = _record(tmp_path / "fp.json", "fp", [1, 1, 1, 0, 1, 0])
    q = _record(tmp_path / "q.json", "q", [1, 0, 0, 0, 1, 1])
    out = tmp_path / "paired.json"
    script = "-m", "benchmarks.humaneval_paired"
    done = subprocess.run(
        [sys.executable, *script, str(fp), str(q), "--out", str(out)],
        env=RUN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (pair,) = read_record(out)["pairs"]
    assert (pair["a"], pair["b"], pair["n"]) == ("q", "fp", 6)
    assert (pair["only_a"], pair["only_b"]) == (1, 2)
    assert abs(pair["diff"] - (3 / 6 - 4 / 6)) < 1e-12
    assert abs(pair["p_mcnemar"] - 1.0) < 1e-12  # 1 against 2: binomial, two-sided
    twice = subprocess.run(
        [sys.executable, *script, str(fp), str(fp), "--out", str(out)],
        env=RUN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert twice.returncode != 0 and "more than one record" in twice.stderr
    # a second calibration seed of one method is another row, named by its seed
    again = _record(tmp_path / "q-seed1.json", "q", [0, 0, 0, 0, 1, 1], calib_seed=1)
    seeds = subprocess.run(
        [sys.executable, *script, str(fp), str(q), str(again), "--out", str(out)],
        env=RUN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seeds.returncode == 0, seeds.stderr[-2000:]
    pairs = {(p["a"], p["b"]): p for p in read_record(out)["pairs"]}
    assert set(pairs) == {("q", "fp"), ("q (seed 1)", "fp"), ("q", "q (seed 1)")}
    assert (pairs["q", "q (seed 1)"]["only_a"], pairs["q", "q (seed 1)"]["only_b"]) == (1, 0)
    names = [
        bench_paired.row_name(record, {"method": method})
        for method, record in (
            ("torq", {"calib_seed": 1, "calib_corpus": "python-stdlib"}),
            ("fp", {"calib_seed": 1, "prompt": "instruct"}),
            ("torq", {"prompt": "instruct", "calib_corpus": "wikitext2-valid"}),
            ("torq", {}),
        )
    ]
    assert names == [
        "torq (python-stdlib, seed 1)",
        "fp (instruct prompt)",
        "torq (instruct prompt)",
        "torq",
    ]


def _gsm8k_record(path: Path, method: str, flexible: list[int], n: int, batch: int = 8) -> Path:
    answers = {
        str(7 * i): {
            "strict-match": {"exact_match": 0.0},
            "flexible-extract": {"exact_match": float(f)},
        }
        for i, f in enumerate(flexible)
    }
    row = {"method": method, "n": n, "seed": 0, "batch_size": batch, "answers": answers}
    path.write_text(json.dumps({"task": "gsm8k", "model": "m", "rows": [row]}))
    return path


def test_gsm8k_rows_compare_only_within_one_subset_and_batch(tmp_path: Path) -> None:
    """GSM8K rows are compared per problem under the chosen answer filter; rows of another
    subset size (other 5-shot prompts), another batch size or another task are refused."""
    script = "-m", "benchmarks.humaneval_paired"
    fp = _gsm8k_record(tmp_path / "fp.json", "fp", [1, 1, 0, 1, 0], n=5)
    q = _gsm8k_record(tmp_path / "q.json", "q", [1, 0, 0, 0, 1], n=5)
    out = tmp_path / "paired.json"

    def paired(*records: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *script, *map(str, records), "--out", str(out), *extra],
            env=RUN_ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    done = paired(fp, q)
    assert done.returncode == 0, done.stderr[-2000:]
    record = read_record(out)
    (pair,) = record["pairs"]
    assert (pair["a"], pair["b"], pair["n"]) == ("q", "fp", 5)
    assert (pair["only_a"], pair["only_b"]) == (1, 2)
    assert record["subset"] == {"n": 5, "seed": 0, "batch_size": 8}
    assert record["rows"]["fp"]["score"] == 3 / 5
    assert "GSM8K (5 problems, seed 0, batch 8) exact match, flexible-extract" in (
        out.with_suffix(".md").read_text()
    )
    strict = paired(fp, q, extra=("--filter", "strict-match"))
    assert strict.returncode == 0, strict.stderr[-2000:]
    assert read_record(out)["rows"]["fp"]["score"] == 0.0
    other_n = _gsm8k_record(tmp_path / "r.json", "r", [1, 1, 0, 1, 0], n=50)
    refused = paired(fp, other_n)
    assert refused.returncode != 0 and "5-shot" in refused.stderr
    other_batch = _gsm8k_record(tmp_path / "s.json", "s", [1, 1, 0, 1, 0], n=5, batch=1)
    assert "batch 1" in paired(fp, other_batch).stderr
    humaneval = _record(tmp_path / "he.json", "q2", [1, 0, 1, 0, 1])
    assert "different tasks" in paired(fp, humaneval).stderr


def _seed_means(monkeypatch: pytest.MonkeyPatch, out: Path, *records: Path) -> dict:
    """``humaneval_paired.py RECORDS --seed-means --out OUT`` (its ``main``, in this
    process); the record it wrote."""
    paired = _benchmark(monkeypatch, "humaneval_paired")
    paired.main([*map(str, records), "--seed-means", "--out", str(out)])
    return read_record(out)


def test_seed_means_compare_methods_rather_than_calibration_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--seed-means``: a method's seeds become one row scored per problem by their mean,
    its seeds' own pass@1 listed; a method with one seed stays as it is."""
    fp = _record(tmp_path / "fp.json", "fp", [1, 1, 1, 0, 1, 0])
    q0 = _record(tmp_path / "q0.json", "q", [1, 0, 0, 0, 1, 1])
    q1 = _record(tmp_path / "q1.json", "q", [0, 0, 1, 0, 1, 1], calib_seed=1)
    r0 = _record(tmp_path / "r0.json", "r", [1, 1, 0, 0, 0, 0])
    out = tmp_path / "means.json"
    record = _seed_means(monkeypatch, out, fp, q1, q0, r0)
    mean = "q (mean of seeds 0, 1)"
    assert set(record["rows"]) == {"fp", mean, "r"}
    assert record["rows"][mean]["seeds"] == {"0": 0.5, "1": 0.5}
    assert record["rows"][mean]["score"] == 0.5 and record["rows"][mean]["problems"] == 6
    pairs = {(p["a"], p["b"]): p for p in record["pairs"]}
    assert set(pairs) == {(mean, "fp"), ("r", "fp"), (mean, "r")}
    # per problem q's mean is 0.5, 0, 0.5, 0, 1, 1 against r's 1, 1, 0, 0, 0, 0
    against_r = pairs[mean, "r"]
    assert abs(against_r["diff"] - (3 / 6 - 2 / 6)) < 1e-12
    assert (against_r["only_a"], against_r["only_b"]) == (3, 2)
    # both seeds score 50 %: the calibration draw adds nothing to the problems' error
    assert record["rows"][mean]["seed_stderr"] == 0.0
    assert against_r["stderr_with_seeds"] == pytest.approx(against_r["stderr"])
    table = out.with_suffix(".md").read_text()
    assert (
        f"- {mean}: 50.0 % (seed 0 50.0 %, seed 1 50.0 %; the seeds' error ± 0.0 points)" in table
    )
    assert "sign-test p" in table and "± with the seeds" in table


def test_the_seed_error_adds_the_calibration_draws_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With seeds that score differently, a seed mean's pairs carry the problems' paired
    error combined with its seeds' error, the standard deviation of their scores over √S."""
    fp = _record(tmp_path / "fp.json", "fp", [1, 1, 1, 1, 0, 0])
    q0 = _record(tmp_path / "q0.json", "q", [1, 1, 1, 0, 0, 0])
    q1 = _record(tmp_path / "q1.json", "q", [1, 0, 0, 0, 0, 0], calib_seed=1)
    q2 = _record(tmp_path / "q2.json", "q", [1, 1, 0, 0, 0, 0], calib_seed=2)
    record = _seed_means(monkeypatch, tmp_path / "means.json", fp, q0, q1, q2)
    mean = "q (mean of seeds 0, 1, 2)"
    # seeds 3/6, 1/6, 2/6: sample standard deviation 1/6, over √3
    expected = (1 / 6) / 3**0.5
    assert record["rows"][mean]["seed_stderr"] == pytest.approx(expected)
    (pair,) = record["pairs"]
    assert pair["stderr_with_seeds"] == pytest.approx((pair["stderr"] ** 2 + expected**2) ** 0.5)
    assert pair["stderr_with_seeds"] > pair["stderr"]


def _benchmark(monkeypatch: pytest.MonkeyPatch, name: str = "humaneval") -> ModuleType:
    """One of the benchmark modules (``benchmarks.NAME``), imported."""
    return importlib.import_module(f"benchmarks.{name.replace('/', '.')}")


def test_a_calibration_seed_reaches_every_draw_and_names_its_own_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--calib-seed`` seeds the calibration windows and the solver, as ``torq run``'s does,
    and a second seed is kept apart from the first; seed 0 names the directories the rows
    measured before the option was added (RTN's partial row on Qwen resumes from one)."""
    bench = _benchmark(monkeypatch)
    base = ["--model", "qwen2.5-coder-0.5b", "--calib-samples", "16", "--out", "x.json"]
    first = bench.parser().parse_args(base)
    second = bench.parser().parse_args([*base, "--calib-seed", "1"])
    settings = bench.torq_settings(second)
    assert (bench.capture(second).calibration.seed, settings.intra.seed) == (1, 1)
    settings = bench.torq_settings(first)
    assert (bench.capture(first).calibration.seed, settings.intra.seed) == (0, 0)
    digest = hashlib.sha1(bench._identity(first, "rtn").encode()).hexdigest()[:10]
    assert digest == "e79dfe421a"  # the directory of the partial RTN row measured before
    assert bench._identity(second, "rtn") != bench._identity(first, "rtn")
    assert bench._quantization_identity(second, "torq") != bench._quantization_identity(
        first, "torq"
    )
    instruct = bench.parser().parse_args([*base, "--prompt", "instruct"])
    assert bench._identity(instruct, "fp") != bench._identity(first, "fp")
    # the prompt does not change how a method quantizes: the same draws
    assert bench._quantization_identity(instruct, "torq") == bench._quantization_identity(
        first, "torq"
    )


def test_the_benchmarks_torq_is_torq_runs_and_names_its_recipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows of ``benchmarks/humaneval.py`` calibrate with ``torq run``'s TORQ: the same
    settings for the same seed and calibration (a bare ``IntraBlockConfig``, the paper's
    identity start with K/2 candidates, was used instead for a while). What the transform
    reads names the resume directory, so a model kept with other settings is not reloaded;
    RTN's and ``had32``'s directories (and carried copies) keep their names."""
    from torq.cli import build_parser, capture_from_args, torq_settings_from_args

    bench = _benchmark(monkeypatch)
    base = ["--model", "qwen2.5-coder-0.5b", "--calib-samples", "16", "--out", "x.json"]
    for seed in ("0", "1"):
        args = bench.parser().parse_args([*base, "--calib-seed", seed])
        run = build_parser().parse_args(
            ["run", "--model", "m", "--calib-samples", "16", "--calib-seed", seed]
        )
        assert bench.torq_settings(args) == torq_settings_from_args(run)
        assert bench.capture(args) == capture_from_args(run)
        assert bench.torq_settings(args).intra.init == "hadamard"
    args = bench.parser().parse_args(base)
    kept = bench._identity(args, "torq")
    paper = bench.torq_settings(args).paper()
    monkeypatch.setattr(bench, "torq_settings", lambda _args: paper)
    assert bench._identity(args, "torq") != kept
    for method, digest in (("rtn", "e79dfe421a"), ("had32", "31e3ebbad6")):
        assert hashlib.sha1(bench._identity(args, method).encode()).hexdigest()[:10] == digest


def test_bad_arguments_are_refused_before_any_work(
    tmp_path: Path,
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--prompt instruct`` without a chat template or on GSM8K, a problem count or index
    outside the data, the other task's option, an unknown method: one line, before any
    quantization or generation, and no record written; a model that cannot be loaded too
    (the script as a user runs it: its error in one line, no traceback)."""
    bench = _benchmark(monkeypatch)
    out = tmp_path / "he.json"
    base = ["--model", str(tiny_checkpoint), "--out", str(out)]
    data = ["--data-dir", str(SHARED_DATA)]
    cases = (
        (["--methods", "rtn", "--prompt", "instruct", *data], "no chat template"),
        (["--task", "gsm8k", "--prompt", "instruct"], "HumanEval only"),
        # what lm-eval would read as "every problem", and what the other task takes
        (["--task", "gsm8k", "--n", "0", *data], "--n must be between 1 and 1319"),
        (["--task", "gsm8k", "--n", "5000", *data], "--n must be between 1 and 1319"),
        (["--limit", "165", *data], "--limit must be between 1 and 164"),
        (["--task", "gsm8k", "--limit", "3", *data], "--limit applies to HumanEval"),
        (["--n", "3", *data], "--n applies to GSM8K"),
        (["--methods", "rtn,nosuch", *data], "unknown method 'nosuch'"),
        (["--problems", "160-164", *data], "problem index 164 is outside 0..163"),
        (["--problems", "3,1-4", *data], "a problem index is given twice"),
        (["--problems", "5-2", *data], "not a list of problem indices"),
        (["--problems", "1,x", *data], "not a list of problem indices"),
        (["--limit", "3", "--problems", "1", *data], "--limit or --problems, not both"),
        (["--task", "gsm8k", "--problems", "1", *data], "--problems applies to HumanEval"),
    )
    for extra, needle in cases:
        with pytest.raises(SystemExit) as stop:
            bench.main([*base, *extra])
        assert stop.value.code == 2
        assert needle in capsys.readouterr().err
        assert not out.exists()
    no_model = ["-m", "benchmarks.humaneval", "--model", str(tmp_path / "none"), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, *no_model, "--methods", "fp", *data],
        env=RUN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "humaneval.py: error: unknown model" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_problem_lists_read_as_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _benchmark(monkeypatch)
    assert bench.parse_problems("3,7,10-12") == [3, 7, 10, 11, 12]
    assert bench.parse_problems("163") == [163]


def test_the_table_title_names_only_the_quantization_its_rows_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An FP-only record's title names no format and no calibration; a record of
    uncalibrated methods names the format only; a calibrated method adds the corpus and
    seed."""
    bench = _benchmark(monkeypatch)
    args = bench.parser().parse_args(
        ["--model", "m", "--out", "x.json", "--format", "nvfp4", "--calib-seed", "1"]
    )
    row = {"pass@1": 0.5, "problems": 2, "generate_seconds": 1.0}

    def title(*methods: str) -> str:
        return bench._table(args, [{**row, "method": m} for m in methods]).splitlines()[0]

    assert title("fp").endswith("pass@1, float weights and activations")
    assert "nvfp4" not in title("fp") and "calibrated" not in title("fp")
    assert title("fp", "rtn").endswith("pass@1, W4A4 nvfp4")
    assert title("rtn", "torq").endswith("W4A4 nvfp4, calibrated on wikitext2-valid (seed 1)")
    assert "calibrated on" in title("rtn+gptq")  # GPTQ reads calibration data too


def test_batched_generation_gives_the_answers_of_one_at_a_time(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """``benchmarks/generation_batch.py``: a W4A4 model with online transforms (``had32``)
    generates with several problems per batch (left padding through the quantized layers)
    and the record counts the answers identical to one-at-a-time generation: on the tiny
    model all of them (a quantizer that mixed the rows of a batch, or read the padding,
    would change them)."""
    out = tmp_path / "batch.json"
    args = [
        "-m", "benchmarks.generation_batch",
        "--task", "gsm8k", "--n", "3",
        "--model", str(tiny_checkpoint),
        "--method", "had32",
        "--batch-sizes", "1,3",
        "--data-dir", str(SHARED_DATA),
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args], env=RUN_ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = read_record(out)
    one, three = record["runs"]
    assert (one["batch_size"], three["batch_size"], record["problems"]) == (1, 3, 3)
    assert set(one["texts"]) == set(three["texts"]) and len(one["texts"]) == 3
    same = sum(one["texts"][k] == three["texts"][k] for k in one["texts"])
    assert (one["identical"], three["identical"]) == (3, same)
    assert same == 3
    assert out.with_suffix(".md").read_text().startswith("`generation_batch.py")


def test_a_resumed_rows_time_counts_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row made over three sessions shows their sum, not the last session's seconds."""
    bench = _benchmark(monkeypatch)
    args = bench.parser().parse_args(["--model", "m", "--out", "x.json", "--task", "gsm8k"])
    score = {"exact_match": 0.1, "stderr": 0.02}
    sessions = [{"seconds_so_far": 8405.0}, {"seconds_so_far": 960.0}, {"seconds": 705.0}]
    row = {"method": "fp", "strict-match": score, "flexible-extract": score, "n": 200}
    resumed = {**row, "seconds": 705.0, "request_cache": {"sessions": sessions}}
    one_go = {**row, "seconds": 42.0, "request_cache": None}
    lines = bench._table(args, [resumed, one_go]).splitlines()
    assert lines[-2].endswith("| 200 | 10070 |")
    assert lines[-1].endswith("| 200 | 42 |")


def test_the_gsm8k_answer_forms_separate_the_format_from_the_arithmetic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``benchmarks/diagnostics/gsm8k_answers.py`` counts, per row, the answers in
    ``#### N`` form and the right ones among them, from the answers the record keeps."""
    forms = _benchmark(monkeypatch, "diagnostics/gsm8k_answers")

    def answer(response: str, strict: str, right: float, flexible: float) -> dict:
        return {
            "response": response,
            "strict-match": {"answer": strict, "exact_match": right},
            "flexible-extract": {"answer": strict, "exact_match": flexible},
        }

    row = {
        "method": "m",
        "answers": {
            "0": answer("so 2\n#### 2", "2", 1.0, 1.0),
            "1": answer("so 3\n#### 4", "4", 0.0, 0.0),
            "2": answer("the answer is 5", forms.INVALID, 0.0, 1.0),
            "3": answer("", forms.INVALID, 0.0, 0.0),
        },
    }
    counts = forms.answer_forms(row)
    assert counts == {
        "answers": 4,
        "formatted": 2,
        "strict": 1.0,
        "flexible": 2.0,
        "mean_chars": (11 + 11 + 15 + 0) / 4,
    }
    assert "| m | 4 | 2 | 1 | 2 | 50.0 % | 9 |" in forms.table({"rows": [row]})


def test_humaneval_failures_are_sorted_by_what_went_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``benchmarks/diagnostics/humaneval_failures.py`` sorts the sandbox's verdicts: a
    failed test, a program that is not Python, another error, a limit reached."""
    failures = _benchmark(monkeypatch, "diagnostics/humaneval_failures")
    verdicts = {
        None: "passed",
        "AssertionError": "wrong result",
        "SyntaxError: invalid syntax": "not Python",
        "IndentationError: unexpected indent": "not Python",
        "NameError: name 'x' is not defined": "other error",
        "timed out": "a limit",
        "killed (a limit was reached)": "a limit",
    }
    for verdict, kind in verdicts.items():
        assert failures.failure_kind(verdict) == kind
    row = {
        "method": "m",
        "tasks": {
            f"HumanEval/{i}": {"first_failure": v, "completion": "x" * (i + 1)}
            for i, v in enumerate(verdicts)
        },
    }
    counts = failures.failure_counts(row)
    assert counts == {
        "passed": 1,
        "wrong result": 1,
        "not Python": 2,
        "other error": 1,
        "a limit": 2,
        "in a loop": 0,
        "problems": 7,
        "mean_chars": 4.0,
    }
    assert "| m | 7 | 1 | 1 | 2 | 1 | 2 | 0 | 4 |" in failures.table([{"rows": [row]}])
    # a line repeated to the token cap, a loop that drifts, and a long program that is not
    body = "\n".join(f"    x{i} = {i}" for i in range(30))
    assert failures.in_a_loop("    return 5\n" * 40)
    assert failures.in_a_loop("\n".join(f"    return {min(i, 5)}" for i in range(40)))
    assert not failures.in_a_loop(body)
    assert not failures.in_a_loop("    return 5\n" * 10)  # too short to call
