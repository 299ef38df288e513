"""Quantized checkpoints: save, reload, same logits; packed storage; clear errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_TEXT, TINY_VOCAB, calibrated_context, tiny_model
from torq.cli import main
from torq.driver import apply_method
from torq.errors import TorqError
from torq.export import MANIFEST, is_quantized_checkpoint, load_quantized, save_quantized
from torq.formats import get_format
from torq.kernels.linear import PackedMXFP4Linear
from torq.methods import MethodContext, get_method
from torq.results import read_record
from torq.rotations.transform import BlockRotation
from torq.surgery import QuantConfig, QuantLinear
from torq.surgery.qlinear import QuantExperts

IDS = torch.randint(0, TINY_VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
MX = QuantConfig(get_format("mxfp4"), get_format("mxfp4"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "corpus.txt"
    path.write_text(TINY_TEXT * 30, encoding="utf-8")
    return str(path)


def _ctx(tokenizer, corpus: str | None = None) -> MethodContext:
    if corpus is None:
        return MethodContext(tokenizer=tokenizer, options={"progress": False})
    return calibrated_context(tokenizer, corpus)


def _quantized(arch: str, method: str, qconfig: QuantConfig = MX, tokenizer=None, corpus=None):
    model = tiny_model(arch)
    apply_method(get_method(method), model, qconfig, _ctx(tokenizer, corpus))
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def test_every_architecture_round_trips_bit_for_bit(arch, tmp_path, tiny_tokenizer) -> None:
    """had32 on every supported architecture: the reloaded model computes exactly the saved
    one's logits, with every weight stored packed (4-bit codes and E8M0 scales)."""
    model = _quantized(arch, "had32")
    ref = _logits(model)
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer, method="had32")
    assert is_quantized_checkpoint(out)
    again, tok, manifest = load_quantized(out)
    assert torch.equal(_logits(again), ref)
    assert tok is not None and tok(TINY_TEXT)["input_ids"] == tiny_tokenizer(TINY_TEXT)["input_ids"]
    stats = manifest["stats"]
    stored = sum(1 if e["kind"] == "linear" else 2 for e in manifest["modules"].values())
    assert stats["packed_weights"] == stored > 0
    tensors = load_file(str(out / "model.safetensors"))
    for name, entry in manifest["modules"].items():
        if entry["kind"] == "linear":
            codes = tensors[f"{name}.weight_codes"]
            out_f, in_f = entry["shape"]
            assert codes.dtype == torch.uint8 and tuple(codes.shape) == (out_f, in_f // 2)
            assert tuple(tensors[f"{name}.weight_scales"].shape) == (out_f, in_f // 32)
            assert f"{name}.weight" not in tensors
    # the quantized weights take 4.25 bits: the folder is far smaller than float32 weights
    quantized_params = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, QuantLinear | QuantExperts)
        for n, p in m.named_parameters(recurse=False)
        if n != "bias"
    )
    packed_bytes = sum(t.numel() for k, t in tensors.items() if k.endswith(("_codes", "_scales")))
    assert packed_bytes == pytest.approx(quantized_params * 4.25 / 8, rel=1e-6)


@pytest.mark.parametrize("method", ["rtn", "hadfull", "quarot", "torq", "torq+gptq", "torq-perm"])
def test_methods_round_trip_with_their_transforms(method, tmp_path, tiny_tokenizer, corpus) -> None:
    """The calibrated and fused methods too: transforms (TORQ's inter- and intra-block
    rotations with the channel scale, factored Hadamards, QuaRot's untied and rotated
    embeddings) come back, shared by the same layers as before."""
    model = _quantized("llama", method, tokenizer=tiny_tokenizer, corpus=corpus)
    ref = _logits(model)
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer, method=method)
    again, _, manifest = load_quantized(out)
    assert torch.equal(_logits(again), ref)
    assert manifest["method"] == method

    def sharing(m, attr: str) -> list[int]:  # which layers share one quantizer / transform
        layers = [x for x in m.modules() if isinstance(x, QuantLinear)]
        firsts: dict[int, int] = {}
        return [firsts.setdefault(id(getattr(x, attr)), i) for i, x in enumerate(layers)]

    for attr in ("input_quantizer", "input_transform"):
        assert sharing(again, attr) == sharing(model, attr)
    before = {
        type(m.input_transform).__name__ for m in model.modules() if isinstance(m, QuantLinear)
    }
    after = {
        type(m.input_transform).__name__ for m in again.modules() if isinstance(m, QuantLinear)
    }
    assert before == after
    if method != "rtn":
        assert manifest["transforms"], "a rotated model saves its transforms"
    if method == "torq":
        saved = {n for t in manifest["transforms"] for n in t["tensors"]}
        assert {"r_inter", "r_intra", "channel_scale"} <= saved
    if method == "torq-perm":  # the permutations the guard kept come back as they were
        perms = [
            (m.input_transform.channel_perm, a.input_transform.channel_perm)
            for m, a in zip(model.modules(), again.modules(), strict=True)
            if isinstance(m, QuantLinear) and hasattr(m.input_transform, "channel_perm")
        ]
        assert perms and all(torch.equal(p, q) for p, q in perms)
        saved = {n for t in manifest["transforms"] for n in t["tensors"]}
        assert "channel_perm" in saved


def test_packed_layers_compute_the_same_on_cpu(tmp_path, tiny_tokenizer, corpus) -> None:
    """``packed=True`` swaps in the kernel layer (packed weights only); on a CPU it runs the
    reference arithmetic, so the logits are those of the saved model."""
    model = _quantized("llama", "torq", tokenizer=tiny_tokenizer, corpus=corpus)
    ref = _logits(model)
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer, method="torq")
    packed, _, manifest = load_quantized(out, packed=True)
    layers = [m for m in packed.modules() if isinstance(m, PackedMXFP4Linear)]
    assert len(layers) == manifest["load"]["packed_layers"] == 14
    assert not any(isinstance(m, QuantLinear) for m in packed.modules())
    assert torch.allclose(_logits(packed), ref, rtol=0, atol=1e-5)
    with pytest.raises(TorqError, match="packed kernel layer"):
        save_quantized(packed, tmp_path / "again")


@pytest.mark.parametrize(
    ("arch", "method", "packed"),
    [
        ("llama", "torq", False),
        ("llama", "torq", True),
        ("llama", "quarot", True),
        ("gemma3_text", "had32", False),
        ("qwen3_moe", "had32", False),
    ],
)
def test_disk_offload_computes_the_same_one_layer_at_a_time(
    arch, method, packed, tmp_path, tiny_tokenizer, corpus
) -> None:
    """``offload_dir``: every decoder layer is written to disk as it is built and read back
    only while it computes (accelerate's ``device_map`` offload), with the logits of the
    model loaded whole, bit for bit; the online transforms, shared by several layers, stay
    in memory, once; a folder that is not empty is refused."""
    from torq.models.architecture import decoder_layers

    model = _quantized(arch, method, tokenizer=tiny_tokenizer, corpus=corpus)
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer, method=method)
    whole, _, _ = load_quantized(out, packed=packed)
    folder = tmp_path / "offload"
    again, _, manifest = load_quantized(out, packed=packed, offload_dir=folder)
    assert manifest["load"]["offload_dir"] == str(folder)
    assert torch.equal(_logits(again), _logits(whole))
    layers = decoder_layers(again)
    for layer in layers:  # between forwards, no layer holds a tensor that was offloaded
        held = [n for n, t in layer.state_dict().items() if t.device.type != "meta"]
        assert held == [], held
    assert again.get_input_embeddings().weight.device.type == "cpu"
    index = json.loads((folder / "index.json").read_text())
    n = len(layers)
    assert {k.split(".")[2] for k in index} == {str(i) for i in range(n)}
    assert {f.stem for f in folder.glob("*.dat")} == set(index)
    assert not any(".transform." in k for k in index)
    kept = {id(t): t for t in again.modules() if isinstance(t, BlockRotation)}
    assert len(kept) == len(manifest["transforms"])
    assert all(b.device.type == "cpu" for t in kept.values() for b in t.buffers())
    assert bool(kept) == (method != "rtn")
    with pytest.raises(TorqError, match="not empty"):
        load_quantized(out, offload_dir=folder)


@pytest.mark.parametrize(
    ("w", "a"), [("nvfp4", "nvfp4"), ("mxint4", "mxint4"), ("mxfp4", None), (None, "mxfp4")]
)
def test_formats_and_float_weights(w, a, tmp_path) -> None:
    """Other formats pack too; weight-only keeps activations in float; a weight the method
    left in float (activation-only) is stored in float, and the manifest says so."""
    qconfig = QuantConfig(w and get_format(w), a and get_format(a))
    model = _quantized("qwen2", "rtn", qconfig)
    ref = _logits(model)
    out = save_quantized(model, tmp_path / "ck", method="rtn")
    again, tok, manifest = load_quantized(out)
    assert tok is None
    assert torch.equal(_logits(again), ref)
    storages = {e["storage"] for e in manifest["modules"].values()}
    assert storages == ({"float"} if w is None else {"packed"})


def test_nvfp4_gptq_weights_are_stored_packed(tmp_path, tiny_tokenizer, corpus) -> None:
    """GPTQ's NVFP4 weights pack from the tensor scale their linear keeps (quantizing them
    again would take another); reloaded, the model computes the same logits and packs again."""
    qconfig = QuantConfig(get_format("nvfp4"), get_format("nvfp4"))
    model = _quantized("llama", "gptq", qconfig, tokenizer=tiny_tokenizer, corpus=corpus)
    ref = _logits(model)
    out = save_quantized(model, tmp_path / "ck", method="gptq")
    again, _, manifest = load_quantized(out)
    assert torch.equal(_logits(again), ref)
    assert {e["storage"] for e in manifest["modules"].values()} == {"packed"}
    _, _, manifest = load_quantized(save_quantized(again, tmp_path / "ck2", method="gptq"))
    assert {e["storage"] for e in manifest["modules"].values()} == {"packed"}


def test_tied_embeddings_are_stored_once_and_stay_tied(tmp_path) -> None:
    model = _quantized("gemma3_text", "rtn")
    assert model.config.tie_word_embeddings
    out = save_quantized(model, tmp_path / "ck")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    again, _, _ = load_quantized(out)
    head, emb = again.get_output_embeddings().weight, again.get_input_embeddings().weight
    assert torch.equal(head, emb)
    assert torch.equal(_logits(again), _logits(model))


def test_save_is_all_or_nothing(tmp_path, tiny_tokenizer) -> None:
    model = _quantized("llama", "rtn")
    out = save_quantized(model, tmp_path / "ck", tiny_tokenizer)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(TorqError, match="not empty"):
        save_quantized(model, out, tiny_tokenizer)

    class Broken:
        def __call__(self, *args, **kwargs):
            return tiny_tokenizer(*args, **kwargs)

        def save_pretrained(self, path: str) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, out, Broken(), overwrite=True)
    # the earlier checkpoint is untouched, and no temporary folder is left behind
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, tmp_path / "new", Broken())
    assert not (tmp_path / "new").exists()
    with pytest.raises(TorqError, match="no quantized layers"):
        save_quantized(tiny_model("llama"), tmp_path / "float")


def test_damaged_checkpoints_are_refused(tmp_path) -> None:
    model = _quantized("llama", "had32")
    out = save_quantized(model, tmp_path / "ck")

    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(TorqError, match="not a torq quantized checkpoint"):
        load_quantized(broken)

    def damaged(edit) -> str:
        target = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        save_quantized(model, target)
        edit(target)
        with pytest.raises(TorqError) as info:
            load_quantized(target)
        return str(info.value)

    assert "no model.safetensors" in damaged(lambda p: (p / "model.safetensors").unlink())

    def bump_version(p):
        m = json.loads((p / MANIFEST).read_text())
        m["version"] = 99
        (p / MANIFEST).write_text(json.dumps(m))

    assert "checkpoint version 99" in damaged(bump_version)
    assert "could not be read" in damaged(
        lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 64)
    )

    def edit_tensors(fn):
        def edit(p):
            tensors = load_file(str(p / "model.safetensors"))
            fn(tensors)
            save_file(tensors, str(p / "model.safetensors"))

        return edit

    def flip_codes(t):
        key = next(k for k in t if k.endswith("q_proj.weight_codes"))
        t[key] = t[key] ^ 0x11

    assert "does not compute what was saved" in damaged(edit_tensors(flip_codes))
    assert "lacks the tensor" in damaged(
        edit_tensors(lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scales"))
    )
    assert "does not match the model" in damaged(edit_tensors(lambda t: t.pop("model.norm.weight")))
    # the undamaged original still loads
    again, _, _ = load_quantized(out)
    assert torch.equal(_logits(again), _logits(model))


def test_cli_saves_and_evaluates_a_saved_model(
    tiny_checkpoint, tiny_data_dir, tmp_path, capsys
) -> None:
    """``torq run --save-dir`` writes each quantized model; ``--model <that folder>``
    evaluates it as saved (same perplexity, its method's name, no quantization)."""
    common = ["--seqlen", "64", "--max-windows", "2", "--data-dir", str(tiny_data_dir)]
    common += ["--no-progress"]
    save_dir = tmp_path / "saved"
    first = tmp_path / "a.json"
    argv = ["run", "--model", str(tiny_checkpoint), "--methods", "fp,rtn,had32"]
    assert main([*argv, *common, "--save-dir", str(save_dir), "--out", str(first)]) == 0
    rows = {r["method"]: r for r in read_record(first)["rows"]}
    assert sorted(p.name for p in save_dir.iterdir()) == ["tiny-llama-had32", "tiny-llama-rtn"]
    saved = save_dir / "tiny-llama-had32"
    assert rows["had32"]["details"]["saved"]["path"] == str(saved)
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["info"]["command"] and manifest["info"]["model"] == str(tiny_checkpoint)

    second = tmp_path / "b.json"
    assert main(["run", "--model", str(saved), *common, "--out", str(second)]) == 0
    res = read_record(second)
    (row,) = res["rows"]
    assert row["method"] == "had32" and (row["weights"], row["activations"]) == ("mxfp4",) * 2
    assert row["ppl"] == pytest.approx(rows["had32"]["ppl"], rel=1e-6)
    assert row["details"]["loaded_from"]["path"] == str(saved)
    assert res["model"]["source"].startswith("torq-quantized:")
    capsys.readouterr()
    code = main(["run", "--model", str(saved), "--methods", "fp,rtn", *common])
    assert code == 2
    assert "already quantized with 'had32'" in capsys.readouterr().err
    # its formats are its own: a flag that asks for others is refused, one that agrees is not
    code = main(["run", "--model", str(saved), "--format", "nvfp4", *common])
    assert code == 2
    err = capsys.readouterr().err
    assert "weights mxfp4, activations mxfp4, scale rule ocp" in err and "--format" in err
    code = main(["run", "--model", str(saved), "--scale-mode", "nearest", *common])
    assert code == 2 and "--scale-mode" in capsys.readouterr().err
    # its evaluation data is checked before it is loaded, as for a float model
    no_data = tmp_path / "no-data"
    no_data.mkdir()
    code = main(["run", "--model", str(saved), "--data-dir", str(no_data), "--no-progress"])
    assert code == 2 and "WikiText-2 test file not found" in capsys.readouterr().err
    third = tmp_path / "c.json"
    assert (
        main(["run", "--model", str(saved), "--w-format", "mxfp4", *common, "--out", str(third)])
        == 0
    )
    assert read_record(third)["rows"][0]["ppl"] == row["ppl"]
    # its layers kept on disk while it is evaluated: the same perplexity, bit for bit, and
    # the scratch folder removed after; a float model has nothing to offload
    off = tmp_path / "off"
    fourth = tmp_path / "d.json"
    argv = ["run", "--model", str(saved), *common, "--offload-dir", str(off), "--out", str(fourth)]
    assert main(argv) == 0
    offloaded = read_record(fourth)["rows"][0]
    assert offloaded["ppl"] == row["ppl"]
    assert Path(offloaded["details"]["loaded_from"]["offload_dir"]).parent == off
    assert not off.exists()
    code = main(["run", "--model", str(tiny_checkpoint), *common, "--offload-dir", str(off)])
    assert code == 2 and "--offload-dir keeps a saved" in capsys.readouterr().err
    assert not off.exists()


def test_model_copy_is_unaffected_by_saving(tmp_path) -> None:
    """Saving reads the model only: its logits before and after are the same."""
    model = _quantized("mistral", "had32")
    snapshot = copy.deepcopy(model)
    save_quantized(model, tmp_path / "ck")
    assert torch.equal(_logits(model), _logits(snapshot))


@pytest.mark.slow
def test_real_model_round_trip(shared_data, tmp_path) -> None:
    """SmolLM2-135M with RTN: the saved folder is a third of the float checkpoint, and
    ``torq.export.load_model`` of it gives back the same logits."""
    from torq.export import load_model as load

    lm = load("smollm2-135m")
    float_bytes = sum(f.stat().st_size for f in Path(lm.path).glob("*.safetensors"))
    apply_method(get_method("rtn"), lm.model, MX, _ctx(lm.tokenizer))
    ids = lm.tokenizer(TINY_TEXT, return_tensors="pt").input_ids[:, :48]
    with torch.no_grad():
        ref = lm.model(input_ids=ids).logits
    out = save_quantized(lm.model, tmp_path / "smollm2-rtn", lm.tokenizer, method="rtn")
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 0.35 * float_bytes
    again = load(str(out))
    assert again.quantized is not None and again.quantized["method"] == "rtn"
    assert again.tokenizer(TINY_TEXT)["input_ids"] == lm.tokenizer(TINY_TEXT)["input_ids"]
    with torch.no_grad():
        assert torch.equal(again.model(input_ids=ids).logits, ref)
