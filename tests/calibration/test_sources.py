"""Calibration data a user brings (:mod:`torq.calibration.sources`): text files, JSON
lines of text or chat messages, dataset folders, several mixed; bad data refused in one
line before any work."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_TEXT
from torq.calibration.data import CalibrationConfig, calibration_data, calibration_windows
from torq.calibration.sources import (
    check_source,
    packed_windows,
    parse_sources,
    window_counts,
)
from torq.errors import TorqError

# the tiny tokenizer spells letters and spaces only
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
_WORDS = TINY_TEXT.split()
SENTENCES = [" ".join(_WORDS[i : i + 4]) for i in range(0, len(_WORDS), 4)]  # short documents


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_tokenizer(tiny_tokenizer):
    tok = tiny_tokenizer.__class__(
        tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<eos>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_sources_parse_with_columns_and_counts() -> None:
    a, b, c = parse_sources("a.jsonl#question:3, wikitext2-valid, d.txt:2")
    assert (a.name, a.column, a.windows) == ("a.jsonl", "question", 3)
    assert (b.name, b.column, b.windows, b.is_text) == ("wikitext2-valid", None, None, True)
    assert (c.name, c.windows, c.is_text) == ("d.txt", 2, True)
    assert window_counts([a, b, c], 8) == [3, 3, 2]
    assert window_counts(parse_sources("x.jsonl,y.jsonl,z.txt"), 8) == [3, 3, 2]


@pytest.mark.parametrize(
    ("spec", "n", "message"),
    [
        ("a.jsonl:3,b.jsonl:2", 8, r"windows \(3 \+ 2 = 5\) must add to --calib-samples \(8\)"),
        ("a.jsonl:8,b.jsonl", 8, "leaves 0 windows for 1 calibration sources"),
    ],
)
def test_counts_that_do_not_add_up_are_refused(spec: str, n: int, message: str) -> None:
    with pytest.raises(TorqError, match=message):
        window_counts(parse_sources(spec), n)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("stdlib", "unknown calibration data 'stdlib'"),
        ("a.txt#text", "is read as one text: it has no column 'text'"),
        ("a.jsonl,,b.txt", "empty calibration source"),
    ],
)
def test_a_malformed_source_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(corpus=spec)


def test_short_documents_are_packed_into_windows(tmp_path: Path, tiny_tokenizer) -> None:
    """Every document is tokenized whole and followed by the end of sequence token; the
    windows are the documents end to end in a seeded order."""
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": s, "id": i} for i, s in enumerate(SENTENCES)])
    config = CalibrationConfig(corpus=str(path), n_samples=2, seqlen=16)
    windows = calibration_windows(tiny_tokenizer, config)
    assert windows.shape == (2, 16)
    eos = tiny_tokenizer.eos_token_id
    order = torch.randperm(len(SENTENCES), generator=torch.Generator().manual_seed(0)).tolist()
    stream = [t for i in order for t in [*tiny_tokenizer(SENTENCES[i]).input_ids, eos]]
    assert windows.flatten().tolist() == stream[:32]
    assert (windows == eos).any()
    again = calibration_windows(tiny_tokenizer, config)
    assert torch.equal(windows, again)
    other = calibration_windows(tiny_tokenizer, CalibrationConfig(str(path), 2, 16, seed=1))
    assert not torch.equal(windows, other)


def test_chat_messages_are_rendered_with_the_model_template(tmp_path: Path, chat_tokenizer) -> None:
    chats = [
        {"messages": [{"role": "user", "content": s}, {"role": "assistant", "content": "ok ."}]}
        for s in SENTENCES
    ]
    path = _jsonl(tmp_path / "chats.jsonl", chats)
    windows = calibration_windows(chat_tokenizer, CalibrationConfig(str(path), 1, 24))
    first = torch.randperm(len(SENTENCES), generator=torch.Generator().manual_seed(0))[0]
    rendered = f"user {SENTENCES[first]} assistant ok . "
    expected = chat_tokenizer(rendered, add_special_tokens=False).input_ids
    assert windows[0, : len(expected)].tolist() == expected
    (entry,) = calibration_data(CalibrationConfig(str(path), 1, 24))
    assert entry["read_as"] == "chat" and entry["column"] == "messages"
    assert entry["documents"] == len(SENTENCES) and entry["windows"] == 1
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entry["bytes"] == path.stat().st_size


def test_chats_for_a_model_without_a_template_are_refused(tmp_path: Path, tiny_tokenizer) -> None:
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(
        TorqError, match="holds chat messages, but the model's tokenizer has no chat"
    ):
        calibration_windows(tiny_tokenizer, CalibrationConfig(str(path), 1, 8))


def test_a_dataset_folder_and_a_parquet_file_are_read(tmp_path: Path, tiny_tokenizer) -> None:
    import datasets

    data = datasets.Dataset.from_dict({"body": SENTENCES})
    data.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "files").mkdir()
    data.to_parquet(str(tmp_path / "files" / "part-0.parquet"))
    expected = None
    for spec in (f"{tmp_path / 'saved'}#body", f"{tmp_path / 'files'}#body"):
        windows = calibration_windows(tiny_tokenizer, CalibrationConfig(spec, 2, 16))
        expected = windows if expected is None else expected
        assert torch.equal(windows, expected)  # the same documents, the same windows
    single = f"{tmp_path / 'files' / 'part-0.parquet'}#body"
    assert torch.equal(
        calibration_windows(tiny_tokenizer, CalibrationConfig(single, 2, 16)), expected
    )


def test_sources_mix_with_their_counts(tmp_path: Path, tiny_tokenizer) -> None:
    docs = _jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES])
    text = tmp_path / "t.txt"
    text.write_text(TINY_TEXT * 4)
    config = CalibrationConfig(f"{docs}:1,{text}:2", n_samples=3, seqlen=16)
    windows = calibration_windows(tiny_tokenizer, config)
    alone = calibration_windows(tiny_tokenizer, CalibrationConfig(str(docs), 1, 16))
    assert windows.shape == (3, 16) and torch.equal(windows[:1], alone)
    described = calibration_data(config)
    assert [e["windows"] for e in described] == [1, 2]
    assert [e["read_as"] for e in described] == ["documents", "text"]


@pytest.mark.parametrize(
    ("content", "spec_suffix", "message"),
    [
        ("", "", "no records"),
        ('{"text": ""}\n', "", "is empty"),
        ('{"body": "x"}\n', "", "has neither a 'messages' nor a 'text' column \\(it has: body\\)"),
        ('{"text": "x"}\n', "#prompt", "has no column 'prompt' \\(it has: text\\)"),
        ("not json\n", "", "not JSON lines"),
        ('{"messages": "hello"}\n', "", "messages are not a list of"),
        ('{"text": 3}\n', "", "record 1 has no text in 'text'"),
    ],
)
def test_bad_data_is_refused_in_one_line(
    tmp_path: Path, content: str, spec_suffix: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    (source,) = parse_sources(str(path) + spec_suffix)
    with pytest.raises(TorqError, match=message) as info:
        check_source(source, None)
    assert "\n" not in str(info.value)


def test_too_little_data_for_the_windows_is_refused(tmp_path: Path, tiny_tokenizer) -> None:
    with pytest.raises(TorqError, match="too few for 50 windows of 64; lower --calib-samples"):
        packed_windows(tiny_tokenizer, SENTENCES, 50, 64, 0, "calibration data x")


def test_a_run_refuses_bad_calibration_data_before_loading_the_model(
    tmp_path: Path, tiny_checkpoint: Path, tiny_data_dir: Path, capsys
) -> None:
    from torq.cli import main

    bad = tmp_path / "empty.jsonl"
    bad.write_text("")
    code = main([
        "quantize", str(tiny_checkpoint), "--out", str(tmp_path / "q"),
        "--calib-data", str(bad), "--data-dir", str(tiny_data_dir),
    ])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "empty.jsonl: no records" in err and "\n" not in err
    assert not (tmp_path / "q").exists()


def test_a_quantized_folder_records_its_calibration_data(
    tmp_path: Path, tiny_checkpoint: Path, tiny_data_dir: Path
) -> None:
    """``torq quantize --calib-data`` of documents: the folder's record names the data by
    its path, size and sha256, with how it was read."""
    from torq.cli import main
    from torq.results import read_record

    docs = _jsonl(tmp_path / "docs.jsonl", [{"text": s} for s in SENTENCES * 4])
    out = tmp_path / "q"
    assert main([
        "quantize", str(tiny_checkpoint), "--out", str(out), "--calib-data", str(docs),
        "--calib-samples", "2", "--calib-seqlen", "32", "--data-dir", str(tiny_data_dir),
        "--no-progress",
    ]) == 0  # fmt: skip
    record = read_record(out / "torq_quantize.json")["record"]
    (entry,) = record["rows"][0]["details"]["calibration_data"]
    assert entry["sha256"] == hashlib.sha256(docs.read_bytes()).hexdigest()
    assert (entry["read_as"], entry["documents"], entry["windows"]) == (
        "documents",
        4 * len(SENTENCES),
        2,
    )
