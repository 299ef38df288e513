"""Carrying a part-done evaluation to another machine (``torq.eval.portable``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from torq.cli import main
from torq.errors import TorqError
from torq.eval import zeroshot as zs
from torq.eval.portable import (
    answer_key,
    carried_cpus,
    carry_summary,
    check_carried_cpu,
    check_sessions_cpu,
    describe_setting,
    export_portable,
    load_portable,
    merge_portable,
    seed_resume_dir,
)
from torq.eval.resume import (
    MODEL_INFO,
    fingerprint_ids,
    logits_fingerprint,
    record_setting,
    recorded_setting,
)

pytest.importorskip("lm_eval")

from tests.eval.test_zeroshot import _zeroshot_dir


def _fake_resume(root: Path, fingerprint: list[float], answers: dict[tuple[str, str], tuple]):
    from lm_eval.api.model import hash_args
    from sqlitedict import SqliteDict

    root.mkdir(parents=True)
    db = SqliteDict(str(root / "requests_rank0.db"), autocommit=True)
    for args, answer in answers.items():
        db[hash_args("loglikelihood", args)] = answer
    db.close()
    meta = {"fingerprint": fingerprint, "sessions": [{"started": "t0", "seconds": 5.0}]}
    (root / "meta.json").write_text(json.dumps(meta))
    ppl = {"windows_sha256": "abc", "fingerprint": fingerprint, "nll": [1.5, 2.5], "seconds": 3.0}
    (root / "ppl-4x8.json").write_text(json.dumps(ppl))


def test_export_and_load_round_trip(tmp_path) -> None:
    answers = {("ctx a", " x"): (-1.25, True), ("ctx b", " y"): (-3.5, False)}
    _fake_resume(tmp_path / "r", [0.1, 0.2], answers)
    out = tmp_path / "carry" / "m.npz"
    assert export_portable(tmp_path / "r", out) == {
        "answers": 2,
        "ppl_windows": 2,
        "generations": 0,
    }
    assert not list(out.parent.glob("*.tmp.npz"))
    data = load_portable(out)
    assert data["answers"] == {answer_key(a): v for a, v in answers.items()}
    assert data["meta"]["fingerprint"] == [0.1, 0.2]
    assert data["meta"]["sessions"] == [{"started": "t0", "seconds": 5.0}]
    assert data["meta"]["ppl"]["ppl-4x8.json"]["nll"] == [1.5, 2.5]
    # 17 bytes an answer before compression: a key prefix, a float64, a flag
    with np.load(out) as z:
        assert z["keys"].dtype == np.uint64 and z["loglik"].dtype == np.float64

    assert data["meta"]["setting"] is None  # none recorded in the directory

    # answers the file holds but a (new) directory does not yet are not dropped
    _fake_resume(tmp_path / "r2", [0.1, 0.2], {("ctx c", " z"): (-0.5, True)})
    assert export_portable(tmp_path / "r2", out)["answers"] == 3


def test_the_copy_says_which_setting_made_it(tmp_path) -> None:
    """The settings key whose hash names a resume directory goes into its portable copy,
    so that a carried file says its method and format itself; a directory made before the
    key was recorded gives its kept model's; a new directory without one keeps the file's."""
    setting = json.dumps(["rtn", {"act_format": "nvfp4", "model": "m"}])
    _fake_resume(tmp_path / "r", [0.1, 0.2], {("ctx a", " x"): (-1.0, True)})
    record_setting(tmp_path / "r", setting)
    assert recorded_setting(tmp_path / "r") == setting
    out = tmp_path / "m.npz"
    export_portable(tmp_path / "r", out)
    assert load_portable(out)["meta"]["setting"] == setting

    _fake_resume(tmp_path / "r2", [0.1, 0.2], {("ctx c", " z"): (-0.5, True)})
    assert recorded_setting(tmp_path / "r2") is None
    export_portable(tmp_path / "r2", out)
    assert load_portable(out)["meta"]["setting"] == setting

    older = json.dumps(["torq", {"act_format": "mxfp4"}])
    (tmp_path / "r2" / MODEL_INFO).write_text(json.dumps({"setting_key": older}))
    assert recorded_setting(tmp_path / "r2") == older


def test_generated_answers_are_carried_as_text(tmp_path) -> None:
    """A generation task's answers (strings in lm-eval's cache) go into the copy by the
    same key prefix, beside the log-likelihood ones, and are kept when a new directory
    does not hold them yet."""
    from lm_eval.api.model import hash_args
    from sqlitedict import SqliteDict

    gen = ("def f():\n", {"until": ["\ndef"], "do_sample": False})
    _fake_resume(tmp_path / "r", [0.1], {("ctx a", " x"): (-1.0, True)})
    db = SqliteDict(str(tmp_path / "r" / "requests_rank0.db"), autocommit=True)
    db[hash_args("generate_until", gen)] = "    return 1\n"
    db.close()
    out = tmp_path / "m.npz"
    assert export_portable(tmp_path / "r", out) == {
        "answers": 1,
        "ppl_windows": 2,
        "generations": 1,
    }
    data = load_portable(out)
    assert data["generations"] == {answer_key(gen, "generate_until"): "    return 1\n"}
    assert data["answers"] == {answer_key(("ctx a", " x")): (-1.0, True)}
    assert "generations" not in data["meta"]
    _fake_resume(tmp_path / "r2", [0.1], {})
    assert export_portable(tmp_path / "r2", out)["generations"] == 1


def test_a_copy_describes_its_row(tmp_path) -> None:
    """``carry_summary`` reads both settings-key shapes (a zero-shot row's list, a
    generation row's object), counts the answers and sums the sessions' seconds as a
    record does (a stopped session's last heartbeat, a finished one's ``seconds``)."""
    zs_key = json.dumps(
        [
            "torq",
            {
                "act_format": "nvfp4",
                "model": "m",
                "torq": {"calibration": {"corpus": "c", "seed": 1}},
            },
        ]
    )
    assert describe_setting(zs_key) == {
        "method": "torq",
        "task": "zero-shot",
        "format": "nvfp4",
        "model": "m",
        "calib_corpus": "c",
        "calib_seed": 1,
    }
    gen_key = json.dumps({"method": "rtn", "task": "gsm8k", "format": "mxfp4", "model": "m"})
    assert describe_setting(gen_key)["task"] == "gsm8k"
    assert describe_setting(gen_key)["calib_corpus"] is None
    assert describe_setting(None) == {}
    with pytest.raises(TorqError, match="unrecognised settings key"):
        describe_setting(json.dumps(3))
    with pytest.raises(TorqError, match="unrecognised settings key"):
        describe_setting("[not json")
    no_recipe = json.dumps({"method": "fp", "task": "humaneval", "recipe": None})
    assert describe_setting(no_recipe)["calib_corpus"] is None

    _fake_resume(
        tmp_path / "r", [0.1], {("ctx a", " x"): (-1.0, True), ("ctx b", " y"): (-2.0, False)}
    )
    record_setting(tmp_path / "r", zs_key)
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    meta["sessions"] = [{"seconds_so_far": 7.0}, {"seconds_so_far": 1.0, "seconds": 2.5}]
    (tmp_path / "r" / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "m.npz"
    export_portable(tmp_path / "r", out)
    summary = carry_summary(out)
    assert summary["file"] == "m.npz"
    assert (summary["method"], summary["format"], summary["calib_seed"]) == ("torq", "nvfp4", 1)
    assert (summary["answers"], summary["generations"], summary["ppl_windows"]) == (2, 0, 2)
    assert summary["sessions"] == 2 and summary["seconds"] == 9.5
    assert summary["cpus"] == []  # sessions from before the CPU was recorded name none


def test_a_quantized_row_goes_on_only_on_the_cpu_it_was_made_on(tmp_path) -> None:
    """A copy whose sessions ran on another CPU is refused for a quantized method (the same
    W4A4 model answers otherwise there, RESULTS §12.5), before any model is loaded; an FP
    row's, a copy of this CPU's, one that names no CPU and an absent one pass."""
    _fake_resume(tmp_path / "r", [0.1], {("ctx a", " x"): (-1.0, True)})
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    meta["sessions"] = [{"seconds": 1.0}, {"seconds": 1.0, "cpu": "Xeon"}]
    meta["sessions"] += [{"seconds": 1.0, "cpu": "EPYC"}, {"seconds": 1.0, "cpu": "Xeon"}]
    (tmp_path / "r" / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "m.npz"
    export_portable(tmp_path / "r", out)
    assert carried_cpus(out) == ["Xeon", "EPYC"]
    assert carry_summary(out)["cpus"] == ["Xeon", "EPYC"]
    with pytest.raises(TorqError, match=r"m\.npz holds W4A4 answers made on EPYC; this Xeon"):
        check_carried_cpu(out, quantized=True, cpu="Xeon")
    with pytest.raises(TorqError, match="made on Xeon; this Opteron would answer otherwise"):
        check_carried_cpu(out, quantized=True, cpu="Opteron")
    check_carried_cpu(out, quantized=False, cpu="Opteron")
    check_carried_cpu(tmp_path / "absent.npz", quantized=True, cpu="Opteron")
    with pytest.raises(TorqError, match="r holds W4A4 answers made on Xeon"):
        check_sessions_cpu(meta["sessions"][:2], tmp_path / "r", quantized=True, cpu="EPYC")
    meta["sessions"] = [{"seconds": 1.0, "cpu": "Xeon"}, {"seconds": 1.0}]
    (tmp_path / "r" / "meta.json").write_text(json.dumps(meta))
    export_portable(tmp_path / "r", out)
    check_carried_cpu(out, quantized=True, cpu="Xeon")
    meta["sessions"] = [{"seconds": 1.0}]
    (tmp_path / "r" / "meta.json").write_text(json.dumps(meta))
    export_portable(tmp_path / "r", out)
    check_carried_cpu(out, quantized=True, cpu="Opteron")


def _generation_copy(
    path: Path,
    texts: dict[str, str],
    cpu: str,
    started: str,
    method: str = "torq",
    entries_before: int = 0,
) -> None:
    """A generation row's portable copy: ``texts`` (prompt → answer), one session."""
    from lm_eval.api.model import hash_args
    from sqlitedict import SqliteDict

    root = path.parent / f"{path.stem}-resume"
    _fake_resume(root, [0.1, 0.2], {})
    db = SqliteDict(str(root / "requests_rank0.db"), autocommit=True)
    for prompt, text in texts.items():
        db[hash_args("generate_until", (prompt, {"until": ["\ndef"]}))] = text
    db.close()
    session = {"started": started, "cpu": cpu, "entries_before": entries_before}
    meta = {"fingerprint": [0.1, 0.2], "sessions": [session]}
    (root / "meta.json").write_text(json.dumps(meta))
    record_setting(root, json.dumps({"method": method, "task": "humaneval", "format": "mxfp4"}))
    export_portable(root, path)


def test_two_copies_of_one_row_merge_and_others_are_refused(tmp_path) -> None:
    """A second process's copy of a row adds its answers and sessions to the row's copy;
    answers both hold must be the same text. Another row, another model, another CPU for
    a quantized row, or one differing answer: refused, the row's copy left as it was. A
    float row's copies merge across CPUs (the float model answers alike on both)."""
    row, helper = tmp_path / "row.npz", tmp_path / "helper.npz"
    _generation_copy(row, {"a": "1", "b": "2"}, "EPYC", "t1")
    _generation_copy(helper, {"b": "2", "c": "3", "d": "4"}, "EPYC", "t2")
    assert merge_portable(helper, row) == {"added": 2, "shared": 1, "answers": 4}
    merged = load_portable(row)
    assert sorted(merged["generations"].values()) == ["1", "2", "3", "4"]
    assert [s["started"] for s in merged["meta"]["sessions"]] == ["t1", "t2"]
    assert merge_portable(helper, row)["added"] == 0  # merging again changes nothing
    assert len(load_portable(row)["meta"]["sessions"]) == 2
    # a second process started in the same second as the row's own: both sessions kept
    same_second = tmp_path / "same-second.npz"
    _generation_copy(same_second, {"b": "2"}, "EPYC", "t1", entries_before=7)
    merge_portable(same_second, row)
    assert len(load_portable(row)["meta"]["sessions"]) == 3

    before = row.read_bytes()
    cases = (
        ({"e": "5"}, "Xeon", "torq", "made on Xeon; this EPYC would answer otherwise"),
        ({"a": "9"}, "EPYC", "torq", "1 answers of .* differ"),
        ({"e": "5"}, "EPYC", "rtn", "another row"),
    )
    for i, (texts, cpu, method, needle) in enumerate(cases):
        other = tmp_path / f"other{i}.npz"
        _generation_copy(other, texts, cpu, f"u{i}", method)
        with pytest.raises(TorqError, match=needle):
            merge_portable(other, row)
        assert row.read_bytes() == before
    moved = tmp_path / "moved.npz"
    _generation_copy(moved, {"e": "5"}, "EPYC", "u9")
    data = np.load(moved)
    meta = json.loads(str(data["meta"]))
    meta["fingerprint"] = [0.1, 0.9]
    np.savez(moved, keys=data["keys"], loglik=data["loglik"], greedy=data["greedy"],
             meta=np.asarray(json.dumps(meta)))  # fmt: skip
    with pytest.raises(TorqError, match="logits differ"):
        merge_portable(moved, row)

    fp_row, fp_other = tmp_path / "fp.npz", tmp_path / "fp-xeon.npz"
    _generation_copy(fp_row, {"a": "1"}, "EPYC", "v1", "fp")
    _generation_copy(fp_other, {"b": "2"}, "Xeon", "v2", "fp")
    assert merge_portable(fp_other, fp_row)["added"] == 1


def test_bad_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(TorqError, match="no portable"):
        load_portable(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TorqError, match="not a portable"):
        load_portable(tmp_path / "junk.npz")
    np.savez(tmp_path / "old.npz", keys=np.zeros(0, np.uint64), loglik=np.zeros(0),
             greedy=np.zeros(0, bool), meta=np.asarray(json.dumps({"version": 0})))  # fmt: skip
    with pytest.raises(TorqError, match="version"):
        load_portable(tmp_path / "old.npz")


def test_seeding_checks_the_model_and_fills_a_new_directory(tiny_checkpoint, tmp_path) -> None:
    from torq.models import load

    lm = load(str(tiny_checkpoint))
    fp = logits_fingerprint(lm.model, fingerprint_ids(lm.tokenizer))
    _fake_resume(tmp_path / "r", fp, {("ctx", " a"): (-2.0, False)})
    carry = tmp_path / "m.npz"
    export_portable(tmp_path / "r", carry)
    new = tmp_path / "elsewhere"
    seeds = seed_resume_dir(carry, new, lm.model, lm.tokenizer)
    assert seeds == {answer_key(("ctx", " a")): (-2.0, False)}
    meta = json.loads((new / "meta.json").read_text())
    assert meta["fingerprint"] == fp and meta["sessions"][0]["started"] == "t0"
    assert json.loads((new / "ppl-4x8.json").read_text())["nll"] == [1.5, 2.5]
    # seeding twice does not repeat the sessions
    seed_resume_dir(carry, new, lm.model, lm.tokenizer)
    assert len(json.loads((new / "meta.json").read_text())["sessions"]) == 1
    assert seed_resume_dir(tmp_path / "absent.npz", new, lm.model, lm.tokenizer) == {}

    other = load(str(tiny_checkpoint)).model
    with torch.no_grad():
        other.lm_head.weight.mul_(3.0)
    with pytest.raises(TorqError, match="another model"):
        seed_resume_dir(carry, tmp_path / "third", other, lm.tokenizer)


def test_a_seeded_evaluation_scores_only_what_is_missing(
    tiny_checkpoint, tiny_data_dir, tmp_path
) -> None:
    """Two questions' answers scored on "machine A", carried; "machine B" (a new resume
    directory) gets them without running the model, with the same scores, and scores only
    the questions it lacks."""
    from torq.models import load

    data = str(_zeroshot_dir(tiny_data_dir))
    lm = load(str(tiny_checkpoint))
    carry = tmp_path / "carry.npz"

    def score(limit: int, cache: Path | None, seeds=None, portable=None) -> dict:
        return zs.evaluate_zeroshot(
            lm.model, lm.tokenizer, ["arc_easy", "piqa"], data_dir=data, limit=limit,
            progress=False, request_cache=cache, seeds=seeds, portable=portable,
        )  # fmt: skip

    with pytest.raises(TorqError, match="request cache"):
        score(2, None, portable=carry)
    first_run = score(2, tmp_path / "a", portable=carry)
    first = first_run["request_cache"]
    assert first["entries_after"] == 12 and first["seeded_answers"] == 0
    assert len(load_portable(carry)["answers"]) == 12
    shutil.rmtree(tmp_path / "a")  # the first machine is gone

    b = tmp_path / "b"
    seeds = seed_resume_dir(carry, b, lm.model, lm.tokenizer)
    calls: list[int] = []
    original = lm.model.forward

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    lm.model.forward = counting
    again = score(2, b, seeds=seeds, portable=carry)
    lm.model.forward = original
    info = again["request_cache"]
    assert info["seeded_answers"] == 12 and info["entries_after"] == 12
    # only the fingerprint check ran the model, no request did
    assert len(calls) == 1
    assert [s["entries_before"] for s in info["sessions"]] == [0, 0]
    assert again["lm_eval"]["results"] == first_run["lm_eval"]["results"]

    more = score(5, b, seeds=seeds, portable=carry)
    assert more["request_cache"]["seeded_answers"] == 0  # already in b's cache
    assert more["request_cache"]["entries_after"] == 30
    assert len(load_portable(carry)["answers"]) == 30


@pytest.mark.parametrize("stream", [False, True])
def test_eval_command_carries_answers_to_a_new_resume_dir(
    stream, tiny_checkpoint, tiny_data_dir, tmp_path
) -> None:
    """The answers of a run carried to another machine's new resume directory: used
    there instead of scoring again; with ``--stream`` the tasks run on the saved
    checkpoint, and the carried answers are checked against it the same way."""
    _zeroshot_dir(tiny_data_dir)
    carry = tmp_path / "carry"

    def run(resume: str) -> list[dict]:
        args = [
            "eval", "--model", str(tiny_checkpoint), "--methods", "rtn", "--tasks", "piqa",
            "--limit", "2", "--seqlen", "64", "--max-windows", "2",
            "--data-dir", str(tiny_data_dir), "--no-progress", "--resume-dir", resume,
            "--portable-dir", str(carry), "--out", str(tmp_path / "zs.json"),
        ]  # fmt: skip
        if stream:
            args += ["--stream", "--save-dir", resume + "-saved"]
        assert main(args) == 0
        return json.loads((tmp_path / "zs.json").read_text())["rows"]

    first = run(str(tmp_path / "a"))
    files = sorted(p.name for p in carry.glob("*.npz"))
    assert len(files) == 1 and "-rtn-" in files[0]
    # the copy names its setting: the key whose hash is in its name
    setting = load_portable(carry / files[0])["meta"]["setting"]
    name, key = json.loads(setting)
    assert name == "rtn" and key["act_format"] == "mxfp4"
    assert hashlib.sha1(setting.encode()).hexdigest()[:10] in files[0]
    second = run(str(tmp_path / "b"))
    for r1, r2 in zip(first, second, strict=True):
        assert r2["zeroshot"]["request_cache"]["seeded_answers"] == 4
        assert r2["details"]["portable"]["answers_carried"] == 4
        assert r2["zeroshot"]["tasks"] == r1["zeroshot"]["tasks"]
        assert r2["ppl"] == r1["ppl"]
    if not stream:  # the perplexity windows came along too (streamed: not kept by window)
        for ckpt in (tmp_path / "b").glob("*/*/ppl-*.json"):
            assert len(json.loads(ckpt.read_text())["nll"]) == 2
        assert len(list((tmp_path / "b").glob("*/*/ppl-*.json"))) == 1
    args = ["run", "--model", str(tiny_checkpoint), "--methods", "fp", "--portable-dir", "x"]
    assert main(args) == 2  # a portable copy needs --resume-dir: a clear error


def test_perplexity_reports_each_checkpoint_write(tiny_checkpoint, tmp_path) -> None:
    """The hook the pipeline uses to refresh the portable copy while perplexity runs."""
    from torq.eval.perplexity import perplexity
    from torq.models import load
    from torq.runs.store import every

    lm = load(str(tiny_checkpoint))
    windows = torch.randint(0, lm.model.config.vocab_size, (3, 16))
    calls: list[int] = []
    perplexity(lm.model, windows, progress=False, checkpoint=tmp_path / "p.json",
               on_checkpoint=lambda: calls.append(1))  # fmt: skip
    assert len(calls) == 3
    throttled: list[int] = []
    hook = every(3600.0, lambda: throttled.append(1))
    for _ in range(5):
        hook()
    assert throttled == [1]
