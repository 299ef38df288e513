"""Greedy decoding over a static cache (:func:`torq.models.decoding.greedy_decode`): the
tokens of transformers' own greedy ``generate``, eagerly on any device and with the step
replayed as a CUDA graph on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.conftest import tiny_model
from torq.models.decoding import compiled_cache_length, greedy_decode

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


def test_a_compiled_step_compiles_once_for_prompts_of_many_lengths() -> None:
    """With the cache's length from :func:`compiled_cache_length`, a step compiled with
    ``fullgraph`` and ``dynamic=False`` serves ten prompt lengths (past dynamo's recompile
    limit of 8, where a cache sized to each prompt failed) from one compilation, with the
    tokens of a cache sized to the prompt."""
    model = tiny_model("llama").eval()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    step = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    torch.manual_seed(1)
    for n in range(3, 13):
        ids = torch.randint(0, 100, (1, n))
        length = compiled_cache_length(n + 4, model.config)
        got = greedy_decode(model, ids, 4, step_forward=step, cache_length=length)
        assert torch.equal(got, greedy_decode(model, ids, 4)), n
    assert len(graphs) == 1
    with pytest.raises(ValueError, match="cannot hold 5 prompt and 4 new tokens"):
        greedy_decode(model, PROMPT, 4, cache_length=8)


def test_compiled_cache_lengths_are_powers_of_two_within_the_models_positions() -> None:
    class Config:
        max_position_embeddings = 3000

    assert [compiled_cache_length(n) for n in (1, 256, 257, 4096, 4097)] == [
        256,
        256,
        512,
        4096,
        8192,
    ]
    assert compiled_cache_length(2100, Config()) == 3000  # not past what the model holds
    assert compiled_cache_length(3001, Config()) == 4096  # unless the tokens need it
    assert compiled_cache_length(100, Config()) == 256


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
