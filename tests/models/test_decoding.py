"""Greedy decoding over a static cache (:func:`torq.models.decoding.greedy_decode`): the
tokens of transformers' own greedy ``generate``, eagerly on any device and with the step
replayed as a CUDA graph on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.conftest import tiny_model
from torq.models.decoding import greedy_decode

PROMPT = torch.tensor([[5, 17, 33, 2, 9]])


def _generate(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_over_a_static_cache_gives_generates_tokens(arch) -> None:
    torch.manual_seed(0)
    model = tiny_model(arch).eval()
    calls: list[int] = []
    with warnings.catch_warnings(record=True) as caught:  # the cache by the model's own name
        warnings.simplefilter("always")
        got = greedy_decode(model, PROMPT, 12, on_token=lambda: calls.append(1))
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert torch.equal(got, _generate(model, PROMPT, 12))
    assert len(calls) == got.shape[1] == 12
    assert torch.equal(greedy_decode(model, PROMPT, 1), got[:, :1])
    # a batch of prompts, and the steps through another callable (torch.compile's, say):
    # called once before the first token's clock (a compilation is not decoding time), and
    # the tokens are the same (that warm-up writes what the first step writes)
    two = torch.cat([PROMPT, PROMPT.flip(1)])
    events: list[str] = []

    def forward(**kwargs: object) -> object:
        events.append("step")
        return model(**kwargs)

    batch = greedy_decode(
        model, two, 6, step_forward=forward, on_token=lambda: events.append("token")
    )
    assert torch.equal(batch, _generate(model, two, 6))
    assert events == ["step", "token"] + ["step", "token"] * 5


def test_greedy_decoding_ends_after_the_end_of_text_token() -> None:
    model = tiny_model("llama").eval()
    full = greedy_decode(model, PROMPT, 12)
    eos = int(full[0, 3])
    first = next(i for i in range(12) if int(full[0, i]) == eos)
    got = greedy_decode(model, PROMPT, 12, eos_token_id=eos)
    assert torch.equal(got, full[:, : first + 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_graph_replays_give_the_eager_tokens_on_cuda() -> None:
    model = tiny_model("llama").eval().cuda()
    ids = PROMPT.cuda()
    eager = greedy_decode(model, ids, 16)
    graphed = greedy_decode(model, ids, 16, cuda_graph=True)
    assert torch.equal(graphed, eager)
    assert torch.equal(eager.cpu(), _generate(model, ids, 16).cpu())
