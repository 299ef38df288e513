"""Greedy decoding over a static key-value cache, optionally with the step captured as a CUDA
graph.

transformers' ``generate`` launches every kernel of every decoding step from Python, which
on a GPU bounds one sequence's speed by Python rather than by the weights' memory traffic
(an 8B model: ~15 tokens/s where the memory allows ~270). A serving engine captures the
step once as a CUDA graph and replays it; :func:`greedy_decode` does the same for any
transformers causal LM: the prompt through the model into a ``StaticCache``, then each new
token by one step whose inputs (the token, its position) are tensors updated in place, so
the captured graph stays valid from one token to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torq.models.architecture import cache_argument


class GraphCaptureError(RuntimeError):
    """The decoding step could not be captured as a CUDA graph (the message says why)."""


@torch.no_grad()
def greedy_decode(
    model: Any,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    cuda_graph: bool = False,
    eos_token_id: int | None = None,
    on_token: Callable[[], None] | None = None,
    step_forward: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """The greedy continuation of unpadded prompts ``ids`` (``[b, n]``, on the model's
    device): at most ``max_new_tokens`` new tokens each (``[b, m]``), ending after
    ``eos_token_id`` (of the first sequence). ``step_forward``: what runs a step in place
    of the model (the model through ``torch.compile``, say); the prompt goes through the
    model. ``cuda_graph``: each step after the first replays one CUDA graph of
    the model's forward (CUDA only; :class:`GraphCaptureError` where it cannot be captured).
    ``on_token`` is called for the first new token once the step is ready (the prompt's
    forward pass, and the capture, done), then after each new token."""
    from transformers import StaticCache

    n = ids.shape[1]
    device = ids.device
    cache = {
        cache_argument(model): StaticCache(config=model.config, max_cache_len=n + max_new_tokens)
    }
    logits = model(
        input_ids=ids, cache_position=torch.arange(n, device=device), use_cache=True, **cache
    ).logits
    token = logits[:, -1:].argmax(-1)
    position = torch.tensor([n], device=device)
    new = [token.clone()]

    forward = model if step_forward is None else step_forward

    def step() -> torch.Tensor:
        return forward(input_ids=token, cache_position=position, use_cache=True, **cache).logits

    replay: Callable[[], torch.Tensor] = step
    if cuda_graph and max_new_tokens > 1:
        # warm-ups on a side stream before the capture (kernels compiled, allocations made);
        # each writes the same token's keys and values at the same position as the first
        # replay will, so they leave the cache as that replay finds it
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = step()
        except RuntimeError as exc:  # e.g. a copy from the CPU inside the step
            raise GraphCaptureError((str(exc).strip().splitlines() or [repr(exc)])[0]) from exc

        def replayed() -> torch.Tensor:
            graph.replay()
            return out

        replay = replayed
    if on_token is not None:  # the first token, once the step is ready to run
        on_token()
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None and int(new[-1][0, 0]) == eos_token_id:
            break
        token.copy_(replay()[:, -1:].argmax(-1))
        position.add_(1)
        new.append(token.clone())
        if on_token is not None:
            on_token()
    return torch.cat(new, dim=1)
