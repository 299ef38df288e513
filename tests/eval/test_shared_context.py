"""Shared-context scoring gives lm-eval's ``HFLM`` scores, on every architecture."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import tiny_model
from torq.driver import apply_method
from torq.methods.registry import MethodContext, get_method
from torq.surgery.qlinear import QuantConfig


def _requests(vocab: int, seed: int = 0) -> list:
    """Multiple-choice-shaped requests: groups that share a context (one-token and longer
    continuations, unequal lengths), plus unshared contexts."""
    rng = random.Random(seed)
    reqs = []
    for q in range(4):
        context = [rng.randrange(1, vocab) for _ in range(rng.randint(12, 30))]
        for c in range(rng.randint(2, 4)):
            cont = [rng.randrange(1, vocab) for _ in range(1 if c == 0 else rng.randint(1, 6))]
            reqs.append(((f"q{q}", f"c{c}"), context, cont))
    for s in range(3):
        context = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 12))]
        reqs.append(((f"s{s}", "x"), context, [rng.randrange(1, vocab) for _ in range(3)]))
    # a one-token context: nothing to share, scored by HFLM
    reqs += [(("one", "a"), [7], [8, 9]), (("one", "b"), [7], [10])]
    rng.shuffle(reqs)
    return reqs


def _wrappers(model: torch.nn.Module, tokenizer) -> tuple:
    from lm_eval.models.huggingface import HFLM

    from torq.eval.shared_context import SharedContextHFLM

    kw = dict(pretrained=model, tokenizer=tokenizer, batch_size=3, device="cpu", max_length=64)
    return HFLM(**kw), SharedContextHFLM(**kw)


def _compare(
    model: torch.nn.Module, tokenizer, reqs: list, counted: torch.nn.Module, tol: float
) -> float:
    """Score ``reqs`` with both wrappers, assert the same answers (log-likelihoods to
    ``tol``, greedy flags exactly) in request order, and return the ratio of the token
    positions that entered ``counted`` (shared over ``HFLM``)."""
    reference, shared = _wrappers(model, tokenizer)
    positions: list[int] = []
    hook = counted.register_forward_hook(
        lambda _m, args, _out: positions.append(args[0].shape[:2].numel())
    )
    want = reference._loglikelihood_tokens(reqs, disable_tqdm=True)
    n_reference = sum(positions)
    positions.clear()
    got = shared._loglikelihood_tokens(reqs, disable_tqdm=True)
    hook.remove()
    assert len(got) == len(want) == len(reqs)
    for (ll_got, greedy_got), (ll_want, greedy_want) in zip(got, want, strict=True):
        assert ll_got == pytest.approx(ll_want, rel=tol, abs=tol)
        assert greedy_got == greedy_want
    return sum(positions) / n_reference


@pytest.mark.parametrize("quantized", [False, True])
def test_scores_match_hflm(arch, quantized, tiny_tokenizer) -> None:
    """Same log-likelihoods (to float rounding) and the same greedy flags as ``HFLM``, in
    request order, for the float model and a W4A4 (block-Hadamard) fake-quantized one."""
    model = tiny_model(arch).eval()
    if quantized:
        apply_method(
            get_method("had32"),
            model,
            QuantConfig.from_names("mxfp4", "mxfp4"),
            MethodContext(tokenizer=None),
        )
    reqs = _requests(model.config.vocab_size)
    # token positions that entered the model: the shared contexts ran once
    ratio = _compare(model, tiny_tokenizer, reqs, model.get_input_embeddings(), 1e-4)
    assert ratio < 0.8


def test_too_long_groups_fall_back_to_hflm(tiny_tokenizer) -> None:
    """A group that would need lm-eval's left truncation is scored by ``HFLM`` itself."""
    model = tiny_model("llama").eval()
    reference, shared = _wrappers(model, tiny_tokenizer)
    context = list(range(1, 61))
    reqs = [(("q", "a"), context, [5, 6, 7, 8, 9, 10]), (("q", "b"), context, [7])]
    want = reference._loglikelihood_tokens(reqs, disable_tqdm=True)
    got = shared._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert got == want


def test_empty_context_is_refused(tiny_tokenizer) -> None:
    model = tiny_model("llama").eval()
    _, shared = _wrappers(model, tiny_tokenizer)
    with pytest.raises(ValueError, match="needs a context"):
        shared._loglikelihood_tokens([(("", "x"), [], [3])], disable_tqdm=True)


def test_unshared_requests_project_only_continuation_positions(tiny_tokenizer) -> None:
    """LAMBADA-shaped requests (a long context each, a short continuation) and one-token
    continuations after the same one-token context (lm-eval's logits reuse): ``HFLM``'s
    scores, with the vocabulary projection run on each batch's window of continuation
    positions only, not on every position."""
    model = tiny_model("llama").eval()
    rng = random.Random(3)
    vocab = model.config.vocab_size
    # lengths as dense as a real task's: lm-eval's batches (sorted by length) then span a
    # few positions, and the projected window is about the continuations' own length
    reqs = [
        (
            (f"p{i}", "w"),
            [rng.randrange(1, vocab) for _ in range(40 + i // 2)],
            [rng.randrange(1, vocab) for _ in range(rng.randint(1, 2))],
        )
        for i in range(9)
    ]
    reqs += [(("one", "a"), [7], [10]), (("one", "b"), [7], [11]), (("one", "c"), [7], [8, 9])]
    rng.shuffle(reqs)
    # positions that reached the vocabulary projection
    assert _compare(model, tiny_tokenizer, reqs, model.get_output_embeddings(), 1e-5) < 0.25


def test_continuation_longer_than_the_window_is_refused(tiny_tokenizer) -> None:
    model = tiny_model("llama").eval()
    _, shared = _wrappers(model, tiny_tokenizer)
    with pytest.raises(ValueError, match="cannot be scored within 64 positions"):
        shared._loglikelihood_tokens([(("", "x"), [1, 2], list(range(1, 70)))], disable_tqdm=True)


def test_mixed_precision_is_honoured_on_every_path(tiny_tokenizer) -> None:
    """lm-eval's ``mixed_precision_dtype`` runs every model call under autocast, shared
    contexts and unshared requests alike, as ``HFLM`` does."""
    from torq.eval.shared_context import SharedContextHFLM

    model = tiny_model("llama").eval()
    shared = SharedContextHFLM(
        pretrained=model,
        tokenizer=tiny_tokenizer,
        batch_size=3,
        device="cpu",
        max_length=64,
        mixed_precision_dtype=torch.bfloat16,
    )
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a: seen.append(torch.is_autocast_enabled("cpu"))
    )
    shared._loglikelihood_tokens(_requests(model.config.vocab_size), disable_tqdm=True)
    hook.remove()
    assert len(seen) >= 3 and all(seen)  # pass 1, pass 2 and the unshared batches


def test_the_cache_goes_by_the_name_the_model_takes(tiny_tokenizer) -> None:
    """The shared contexts' key/value cache is handed to the model under the name its
    forward takes (``cache`` in transformers 5.x, where ``past_key_values`` is deprecated;
    ``past_key_values`` before), so scoring raises no deprecation warning."""
    import warnings
    from types import SimpleNamespace

    from torq.eval.shared_context import _returned_cache
    from torq.models.architecture import cache_argument

    class Old(torch.nn.Module):
        def forward(
            self, input_ids: object = None, past_key_values: object = None
        ) -> SimpleNamespace:
            return SimpleNamespace(past_key_values="old")

    model = tiny_model("llama").eval()
    assert cache_argument(Old()) == "past_key_values"
    assert _returned_cache(Old()(input_ids=None)) == "old"
    assert cache_argument(model) in ("cache", "past_key_values")
    _, shared = _wrappers(model, tiny_tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared._loglikelihood_tokens(_requests(model.config.vocab_size), disable_tqdm=True)
    deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert deprecated == []
