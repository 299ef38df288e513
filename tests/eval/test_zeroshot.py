"""Zero-shot tasks through lm-evaluation-harness, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torq.cli import main
from torq.errors import TorqError
from torq.eval import zeroshot as zs
from torq.results import read_record
from torq.runs.store import FolderStore

pytest.importorskip("lm_eval")

ARC = {
    "id": "q1",
    "question": "Which of these is a liquid at room temperature?",
    "choices": {"text": ["water", "iron", "salt", "wood"], "label": ["A", "B", "C", "D"]},
    "answerKey": "A",
}
PIQA = {"goal": "Open a jar.", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0}


def _zeroshot_dir(root: Path) -> Path:
    (root / "zeroshot").mkdir(parents=True, exist_ok=True)
    # distinct questions: identical requests would share one answer in a request cache
    rows = [
        json.dumps({**ARC, "id": f"q{i}", "question": f"{ARC['question']} ({i})"}) for i in range(6)
    ]
    (root / "zeroshot" / "arc_easy_test.jsonl").write_text("\n".join(rows) + "\n")
    piqa = [json.dumps({**PIQA, "goal": f"Open jar number {i}."}) for i in range(6)]
    (root / "zeroshot" / "piqa_validation.jsonl").write_text("\n".join(piqa) + "\n")
    return root


def test_parse_tasks() -> None:
    assert zs.parse_tasks("all") == list(zs.PAPER_TASKS)
    assert zs.parse_tasks("piqa, arc_easy") == ["piqa", "arc_easy"]
    with pytest.raises(TorqError, match="unknown zero-shot task"):
        zs.parse_tasks("arc_easy,mmlu")


def test_generated_config_includes_the_builtin_task(tmp_path) -> None:
    data = _zeroshot_dir(tmp_path / "data")
    names = zs.prepare_tasks(["arc_easy", "piqa"], str(data), tmp_path)
    assert names == {"arc_easy": "torq_arc_easy", "piqa": "torq_piqa"}
    text = (tmp_path / "torq_arc_easy.yaml").read_text()
    assert "include: " in text and text.split("include: ")[1].split("\n")[0].endswith(
        "arc/arc_easy.yaml"
    )
    assert "dataset_path: json" in text
    assert f"test: {(data / 'zeroshot' / 'arc_easy_test.jsonl').resolve()}" in text
    assert "validation: " in (tmp_path / "torq_piqa.yaml").read_text()


def test_missing_file_without_hub_is_a_clear_error(tmp_path, monkeypatch) -> None:
    data = _zeroshot_dir(tmp_path / "data")
    monkeypatch.setattr(zs, "hub_reachable", lambda timeout=3.0: False)
    expected = data / "zeroshot" / "hellaswag_validation.jsonl"
    with pytest.raises(TorqError, match=f"expected {expected}.*hub is not reachable"):
        zs.prepare_tasks(["arc_easy", "hellaswag"], str(data), tmp_path)


def test_headline_scores_prefer_acc_norm() -> None:
    results = {
        "torq_arc_easy": {"acc,none": 0.5, "acc_norm,none": 0.6, "acc_norm_stderr,none": 0.1},
        "torq_winogrande": {"acc,none": 0.7, "acc_stderr,none": 0.05},
    }
    s = zs.headline_scores(results, {"arc_easy": "torq_arc_easy", "winogrande": "torq_winogrande"})
    assert s["tasks"]["arc_easy"] == {"metric": "acc_norm", "value": 0.6, "stderr": 0.1}
    assert s["tasks"]["winogrande"]["metric"] == "acc"
    assert s["average"] == pytest.approx(0.65)


def test_eval_command_on_a_tiny_checkpoint(tiny_checkpoint, tiny_data_dir, tmp_path, capsys):
    """The whole offline plumbing: local task configs, lm-eval on the in-process quantized
    model, scores and the full lm-eval output in the result JSON, the paper's columns."""
    _zeroshot_dir(tiny_data_dir)
    out = tmp_path / "zs.json"
    code = main(
        [
            "eval", "--model", str(tiny_checkpoint), "--methods", "fp,rtn",
            "--tasks", "arc_easy,piqa", "--limit", "4", "--seqlen", "64", "--max-windows", "2",
            "--data-dir", str(tiny_data_dir), "--no-progress", "--out", str(out),
        ]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == 0
    assert "| ARC-E | PIQA | Avg |" in stdout
    res = read_record(out)
    for row in res["rows"]:
        z = row["zeroshot"]
        assert set(z["tasks"]) == {"arc_easy", "piqa"}
        assert all(0.0 <= t["value"] <= 1.0 for t in z["tasks"].values())
        assert z["limit"] == 4
        lm = row["details"]["lm_eval"]
        assert lm["n-samples"]["torq_arc_easy"]["effective"] == 4
        assert "acc_norm,none" in lm["results"]["torq_piqa"]
        assert row["ppl"] is not None
    # the Figure-1-style plot is written next to the result
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streamed_methods_run_their_tasks_on_their_quantized_checkpoint(
    tiny_checkpoint, tiny_data_dir, tmp_path, monkeypatch
) -> None:
    """``--tasks``: each method is quantized layer by layer and written as it goes (to a
    temporary folder, removed after its tasks, or to ``--save-dir``), then its tasks run on
    that checkpoint: the same scores either way; with ``--packed`` the weights stay packed
    (4-bit) in memory; with ``--offload-dir`` its layers stay on disk (the same scores; the
    scratch folder goes); with ``--resume-dir`` its answers are kept as they come, beside
    its checkpoint. The float model runs its tasks loaded whole."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _zeroshot_dir(tiny_data_dir)
    common = [
        "eval", "--model", str(tiny_checkpoint), "--methods", "quarot",
        "--tasks", "piqa", "--limit", "3", "--seqlen", "64", "--max-windows", "2",
        "--data-dir", str(tiny_data_dir), "--no-progress",
    ]  # fmt: skip
    runs = {}
    off = tmp_path / "scratch" / "offload"
    kept = tmp_path / "resume"
    for name, extra in {
        "plain": [],
        "saved": ["--save-dir", str(tmp_path / "s")],
        "packed": ["--save-dir", str(tmp_path / "p"), "--packed"],
        "offloaded": ["--save-dir", str(tmp_path / "o"), "--offload-dir", str(off)],
        "kept": ["--resume-dir", str(kept)],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main([*common, *extra, "--out", str(out)]) == 0
        runs[name] = read_record(out)["rows"]
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary checkpoints are gone
    for plain, saved, packed, offloaded, with_kept in zip(*runs.values(), strict=True):
        assert plain["ppl"] == saved["ppl"] == packed["ppl"] == offloaded["ppl"]
        assert with_kept["ppl"] == plain["ppl"]
        assert plain["zeroshot"]["tasks"] == saved["zeroshot"]["tasks"], plain["method"]
        assert "saved" not in plain["details"]
        # with --resume-dir the answers are kept as they come, in the method's folder
        assert with_kept["zeroshot"]["tasks"] == plain["zeroshot"]["tasks"]
        assert with_kept["zeroshot"]["request_cache"] is not None
        model_dir = Path(with_kept["details"]["zeroshot_model"]["loaded_from"])
        assert model_dir.parent.parent.parent == kept and model_dir.is_dir()
        assert saved["zeroshot"]["request_cache"] is None
        assert offloaded["zeroshot"]["tasks"] == saved["zeroshot"]["tasks"]
        assert Path(offloaded["details"]["zeroshot_model"]["offload_dir"]).parent.parent == off
        assert set(packed["zeroshot"]["tasks"]) == {"piqa"}
        assert saved["details"]["zeroshot_model"]["packed_layers"] == 0
        assert packed["details"]["zeroshot_model"]["packed_layers"] == 14  # 7 linears × 2
        assert Path(packed["details"]["saved"]["path"]).is_dir()
    assert not off.exists()  # the run's scratch folder, and the folder it made for it
    out = tmp_path / "fp.json"
    assert main([*common, "--methods", "fp", "--out", str(out)]) == 0  # the last --methods
    fp = read_record(out)["rows"][0]
    assert fp["method"] == "fp" and set(fp["zeroshot"]["tasks"]) == {"piqa"}
    assert "zeroshot_model" not in fp["details"]


@pytest.mark.slow
def test_fp_model_is_above_chance_on_arc_easy(shared_data) -> None:
    """The real SmolLM2-135M through the offline task: ARC-Easy acc_norm on its first 40
    questions must be clearly above chance (0.25; measured 0.44 on the first 50)."""
    from torq.models import load

    lm = load("smollm2-135m")
    res = zs.evaluate_zeroshot(
        lm.model, lm.tokenizer, ["arc_easy"], data_dir=str(shared_data), limit=40,
        batch_size=8, progress=False,
    )  # fmt: skip
    score = res["scores"]["tasks"]["arc_easy"]
    assert score["metric"] == "acc_norm"
    assert score["value"] > 0.32
    assert res["lm_eval"]["n-samples"]["torq_arc_easy"]["effective"] == 40


def test_request_cache_resumes_and_refuses_another_model(
    tiny_checkpoint, tiny_data_dir, tmp_path, monkeypatch
) -> None:
    """A stopped evaluation keeps its answers: the same call with more examples scores only
    the new ones and gives the scores of a run without the cache; another model's answers
    are refused, not mixed in."""
    import torch

    from torq.models import load

    data = str(_zeroshot_dir(tiny_data_dir))
    lm = load(str(tiny_checkpoint))
    cache = tmp_path / "requests"

    def score(limit: int, model: torch.nn.Module, request_cache: Path | None) -> dict:
        return zs.evaluate_zeroshot(
            model, lm.tokenizer, ["arc_easy", "piqa"], data_dir=data, limit=limit,
            progress=False, store=None if request_cache is None else FolderStore(request_cache),
        )  # fmt: skip

    monkeypatch.setattr(zs, "HEARTBEAT_SECONDS", 0.01)  # a killed session still has its time
    first = score(2, lm.model, cache)["request_cache"]
    assert first["entries_before"] == 0
    beat = first["sessions"][-1]
    assert 0 < beat["seconds_so_far"] <= beat["seconds"]
    assert first["entries_after"] == 2 * 4 + 2 * 2  # ARC-E: 4 choices, PIQA: 2
    resumed = score(5, lm.model, cache)
    info = resumed["request_cache"]
    assert info["entries_before"] == first["entries_after"]
    assert info["entries_after"] == 5 * 4 + 5 * 2
    assert [s["entries_before"] for s in info["sessions"]] == [0, 12]
    # the row's time is both sessions', not the last one's alone
    both = zs.sessions_seconds(info["sessions"])
    assert both == pytest.approx(beat["seconds"] + info["sessions"][-1]["seconds"])
    # a session stopped between heartbeats counts up to its last heartbeat
    stopped = [{"seconds_so_far": 2.5}, {"seconds": 1.0, "seconds_so_far": 0.5}]
    assert zs.sessions_seconds(stopped) == 3.5
    plain = score(5, lm.model, None)
    assert plain["request_cache"] is None
    assert resumed["lm_eval"]["results"] == plain["lm_eval"]["results"]

    other = load(str(tiny_checkpoint)).model
    with torch.no_grad():
        other.lm_head.weight.mul_(3.0)
    with pytest.raises(TorqError, match="holds another model's results"):
        score(5, other, cache)


def test_eval_command_keeps_one_cache_per_method(tiny_checkpoint, tiny_data_dir, tmp_path) -> None:
    _zeroshot_dir(tiny_data_dir)
    cache = tmp_path / "requests"
    args = [
        "eval", "--model", str(tiny_checkpoint), "--methods", "fp,rtn", "--tasks", "piqa",
        "--limit", "2", "--skip-ppl", "--data-dir", str(tiny_data_dir), "--no-progress",
        "--resume-dir", str(cache), "--out", str(tmp_path / "zs.json"),
    ]  # fmt: skip
    assert main(args) == 0
    dirs = sorted(p.name.split("-")[0] for p in cache.glob("*/*") if p.is_dir())
    assert dirs == ["fp", "rtn"]
    rows = read_record(tmp_path / "zs.json")["rows"]
    assert [r["zeroshot"]["request_cache"]["entries_after"] for r in rows] == [4, 4]
    assert main(args) == 0  # again: each finished row is taken as it was kept
    again = read_record(tmp_path / "zs.json")["rows"]
    assert all(r["details"].get("finished_row") for r in again)
    assert [r["zeroshot"]["tasks"] for r in again] == [r["zeroshot"]["tasks"] for r in rows]


def test_seeded_subset_draws_the_same_questions_for_a_seed(tiny_data_dir, monkeypatch) -> None:
    """The same seed draws the same sorted questions of each task, another seed others; a
    subset larger than a task takes all of it; a task without its local file, or a size
    under one, is a clear error."""
    data = str(_zeroshot_dir(tiny_data_dir))
    first = zs.seeded_subset(["arc_easy", "piqa"], 3, 0, data)
    assert first == zs.seeded_subset(["arc_easy", "piqa"], 3, 0, data)
    for ids in first.values():
        assert len(ids) == 3 and ids == sorted(set(ids)) and all(0 <= i < 6 for i in ids)
    assert any(zs.seeded_subset(["arc_easy"], 3, s, data) != {"arc_easy": first["arc_easy"]}
               for s in range(1, 6))  # fmt: skip
    assert zs.seeded_subset(["piqa"], 50, 0, data) == {"piqa": list(range(6))}
    with pytest.raises(TorqError, match="at least one question"):
        zs.seeded_subset(["piqa"], 0, 0, data)
    monkeypatch.setattr(zs, "hub_reachable", lambda timeout=3.0: True)  # the hub copy's size
    with pytest.raises(TorqError, match="needs its local file"):
        zs.seeded_subset(["hellaswag"], 3, 0, data)


def test_eval_command_with_a_seeded_subset(tiny_checkpoint, tiny_data_dir, tmp_path, capsys):
    """``torq eval --subset N --subset-seed S``: N drawn questions per task, recorded and
    named under the table; with ``--limit`` it is refused before any model is loaded."""
    _zeroshot_dir(tiny_data_dir)
    out = tmp_path / "zs.json"
    args = [
        "eval", "--model", str(tiny_checkpoint), "--methods", "fp", "--tasks", "arc_easy,piqa",
        "--seqlen", "64", "--max-windows", "1", "--skip-ppl", "--data-dir", str(tiny_data_dir),
        "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert main([*args, "--subset", "4", "--subset-seed", "2"]) == 0
    assert "4 questions per task drawn with seed 2" in capsys.readouterr().out
    res = read_record(out)
    assert res["eval"]["zeroshot_subset"] == {"n": 4, "seed": 2}
    row = res["rows"][0]
    assert row["zeroshot"]["subset"]["questions"] == {"arc_easy": 4, "piqa": 4}
    assert row["details"]["lm_eval"]["n-samples"]["torq_piqa"]["effective"] == 4
    assert main([*args, "--subset", "4", "--limit", "2"]) == 2  # they exclude each other
    assert "--limit and --subset" in capsys.readouterr().err
