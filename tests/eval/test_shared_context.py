"""Shared-context scoring gives lm-eval's ``HFLM`` scores, on every architecture."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import tiny_model
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


@pytest.mark.parametrize("quantized", [False, True])
def test_scores_match_hflm(arch, quantized, tiny_tokenizer) -> None:
    """Same log-likelihoods (to float rounding) and the same greedy flags as ``HFLM``, in
    request order, for the float model and a W4A4 (block-Hadamard) fake-quantized one."""
    model = tiny_model(arch).eval()
    if quantized:
        get_method("had32").apply(
            model, QuantConfig.from_names("mxfp4", "mxfp4"), MethodContext(tokenizer=None)
        )
    reference, shared = _wrappers(model, tiny_tokenizer)
    reqs = _requests(model.config.vocab_size)
    tokens = []  # token positions that entered the model, per call
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: tokens.append(args[0].numel())
    )
    want = reference._loglikelihood_tokens(reqs, disable_tqdm=True)
    n_reference = sum(tokens)
    tokens.clear()
    got = shared._loglikelihood_tokens(reqs, disable_tqdm=True)
    hook.remove()
    assert sum(tokens) < 0.8 * n_reference  # the shared contexts ran once
    assert len(got) == len(want) == len(reqs)
    for (ll_got, greedy_got), (ll_want, greedy_want) in zip(got, want, strict=True):
        assert ll_got == pytest.approx(ll_want, rel=1e-4, abs=1e-4)
        assert greedy_got == greedy_want


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
