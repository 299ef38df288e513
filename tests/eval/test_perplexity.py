"""Perplexity windows, the loss-equality property and the data-directory rules."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.conftest import tiny_model
from torq.data import DATA_DIR_ENV
from torq.errors import TorqError
from torq.eval import load_wikitext2_test, perplexity, windows_from_text
from torq.eval.perplexity import paired_log_ratio, sample_windows, window_sample_ids
from torq.eval.store import EvalStore, MemoryStore
from torq.runs.store import FolderStore


def test_windows_are_non_overlapping_and_drop_the_tail(tiny_tokenizer, tiny_data_dir) -> None:
    text = load_wikitext2_test(tiny_data_dir)
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    w = windows_from_text(text, tiny_tokenizer, seqlen=64)
    assert w.shape == (len(ids) // 64, 64)
    assert w.flatten().tolist() == ids[: w.numel()]
    assert windows_from_text(text, tiny_tokenizer, 64, max_windows=2).shape == (2, 64)
    with pytest.raises(TorqError, match="fewer than one window"):
        windows_from_text("short", tiny_tokenizer, seqlen=4096)


def test_perplexity_equals_the_models_own_loss(arch: str) -> None:
    model = tiny_model(arch)
    torch.manual_seed(0)
    windows = torch.randint(0, model.config.vocab_size, (3, 48))
    res = perplexity(model, windows, batch_size=2, progress=False)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    assert res.ppl == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-6)
    assert res.n_tokens == 3 * 48 and res.n_windows == 3
    assert res.tokens_per_s > 0


def test_each_windows_nll_is_kept_in_order() -> None:
    model = tiny_model("llama")
    torch.manual_seed(1)
    windows = torch.randint(0, model.config.vocab_size, (4, 40))
    res = perplexity(model, windows, batch_size=3, progress=False)
    one_by_one = [perplexity(model, w[None], progress=False).window_nll[0] for w in windows]
    assert res.window_nll == pytest.approx(one_by_one, rel=1e-5)
    assert res.mean_nll == pytest.approx(sum(res.window_nll) / (4 * 39), rel=1e-12)


def test_a_window_sample_is_seeded_sorted_and_distinct() -> None:
    windows = torch.arange(50 * 4).view(50, 4)
    picked, ids = sample_windows(windows, 7, seed=3)
    assert ids == sorted(set(ids)) and len(ids) == 7 and all(0 <= i < 50 for i in ids)
    assert picked.tolist() == windows[ids].tolist()
    assert window_sample_ids(50, 7, 3) == ids
    assert window_sample_ids(50, 7, 4) != ids
    assert window_sample_ids(5, 9, 0) == [0, 1, 2, 3, 4]
    with pytest.raises(TorqError, match="at least one window"):
        window_sample_ids(5, 0, 0)


def test_the_paired_ratio_is_exact_on_the_whole_test_and_covers_it_from_samples() -> None:
    """On every window the estimate is the whole test's PPL ratio with no error (the finite
    population correction); from random samples its 95 % interval covers that ratio about
    95 % of the time."""
    seqlen, total, n = 101, 120, 24
    gen = torch.Generator().manual_seed(0)
    a = 300.0 + 40.0 * torch.rand(total, generator=gen, dtype=torch.float64)
    b = a * 1.2 + 8.0 * torch.randn(total, generator=gen, dtype=torch.float64)
    truth = math.exp((b.sum() - a.sum()).item() / (total * (seqlen - 1)))
    whole = paired_log_ratio(a.tolist(), b.tolist(), seqlen, population=total)
    assert whole.ratio == pytest.approx(truth, rel=1e-12)
    assert whole.log_se == 0.0 and whole.low == pytest.approx(truth, rel=1e-12)
    covered = 0
    for seed in range(400):
        ids = window_sample_ids(total, n, seed)
        est = paired_log_ratio(a[ids].tolist(), b[ids].tolist(), seqlen, population=total)
        assert est.low < est.ratio < est.high
        covered += est.low <= truth <= est.high
    assert 0.89 <= covered / 400 <= 0.99
    with pytest.raises(TorqError, match="different windows"):
        paired_log_ratio([1.0, 2.0], [1.0], seqlen)
    with pytest.raises(TorqError, match="at least two windows"):
        paired_log_ratio([1.0], [1.0], seqlen)
    with pytest.raises(TorqError, match="from a test of 3"):
        paired_log_ratio([1.0] * 4, [2.0] * 4, seqlen, population=3)


def test_nan_model_is_reported() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(float("nan"))
    with pytest.raises(TorqError, match="non-finite"):
        perplexity(model, torch.zeros(1, 8, dtype=torch.long), progress=False)


def test_missing_file_names_the_expected_path(tmp_path) -> None:
    with pytest.raises(TorqError, match=str(tmp_path / "wikitext-2-raw" / "wiki.test.raw")):
        load_wikitext2_test(tmp_path)
    with pytest.raises(TorqError, match="data directory not found"):
        load_wikitext2_test(tmp_path / "nope")


def test_environment_variable_is_the_default(tiny_data_dir, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tiny_data_dir))
    assert load_wikitext2_test().startswith(" = Valkyria")


def test_without_a_data_dir_the_hub_fallback_fails_clearly(monkeypatch) -> None:
    """No data directory: the hub is the fallback; offline (or without `datasets`) that is
    a one-line error naming both ways to fix it, never a hang or a traceback."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read those variables once, when imported: where another test imported
    # them first, say so to them directly (else each request waits out its retries here)
    for module in ("huggingface_hub.constants", "datasets.config"):
        loaded = sys.modules.get(module)
        if loaded is not None:
            monkeypatch.setattr(loaded, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(TorqError, match="--data-dir"):
        load_wikitext2_test()


def test_checkpoint_resumes_only_the_missing_windows(tmp_path) -> None:
    """A stopped perplexity run keeps its windows: the same call again measures only the
    rest and gives the uninterrupted result; other windows or another model are refused."""
    import json

    model = tiny_model("llama")
    torch.manual_seed(0)
    windows = torch.randint(0, model.config.vocab_size, (5, 32))
    whole = perplexity(model, windows, batch_size=2, progress=False)
    store = FolderStore(tmp_path)
    ckpt = tmp_path / "ppl.json"
    assert perplexity(model, windows, 2, False, store=store, name="ppl").ppl == pytest.approx(
        whole.ppl, rel=1e-9
    )
    saved = json.loads(ckpt.read_text())
    assert sorted(saved["nll"], key=int) == ["0", "1", "2", "3", "4"]
    # a stop after the first batch: windows 2-4 are missing
    saved["nll"] = {k: v for k, v in saved["nll"].items() if k in ("0", "1")}
    ckpt.write_text(json.dumps(saved))
    seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    resumed = perplexity(model, windows, 2, False, store=store, name="ppl")
    hook.remove()
    assert resumed.ppl == pytest.approx(whole.ppl, rel=1e-9)
    assert seen == [1, 2, 1]  # the fingerprint, then windows 2-3 and 4 only
    with pytest.raises(TorqError, match="other perplexity windows"):
        perplexity(model, windows[:4], 2, False, store=store, name="ppl")
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    with pytest.raises(TorqError, match="another model's results"):
        perplexity(model, windows, 2, False, store=store, name="ppl")


def test_the_evaluation_knows_only_its_store() -> None:
    """The same resume through a store in memory: what a stopped call measured is not
    measured again, whatever keeps it."""
    model = tiny_model("llama")
    windows = torch.randint(
        0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1)
    )
    store = MemoryStore()
    first = perplexity(model, windows, 2, False, store=store)
    assert sorted(store.read("perplexity")["nll"], key=int) == ["0", "1", "2", "3"]
    seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    again = perplexity(model, windows, 2, False, store=store)
    hook.remove()
    assert again.ppl == first.ppl and seen == [1]  # the fingerprint only
    assert isinstance(store, EvalStore) and isinstance(FolderStore("x"), EvalStore)
