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

import time
from collections.abc import Callable
from typing import Any

import torch

from torq.errors import TorqError
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
    cache_length: int | None = None,
) -> torch.Tensor:
    """The greedy continuation of unpadded prompts ``ids`` (``[b, n]``, on the model's
    device): at most ``max_new_tokens`` new tokens each (``[b, m]``), ending after
    ``eos_token_id`` (of the first sequence). ``step_forward``: what runs a step in place
    of the model (the model through ``torch.compile``, say); the prompt goes through the
    model. ``cuda_graph``: each step after the first replays one CUDA graph of
    the model's forward (CUDA only; :class:`GraphCaptureError` where it cannot be captured).
    ``on_token`` is called for the first new token once the step is ready (the prompt's
    forward pass, a ``step_forward``'s first call and the capture done), then after each
    new token. ``cache_length``: the static cache's length (at least the prompt's and the
    new tokens' together, their sum by default; a compiled step is specialised to it:
    :func:`compiled_cache_length`)."""
    from transformers import StaticCache

    n = ids.shape[1]
    device = ids.device
    length = n + max_new_tokens if cache_length is None else cache_length
    if length < n + max_new_tokens:
        raise ValueError(
            f"a static cache of {length} positions cannot hold {n} prompt and "
            f"{max_new_tokens} new tokens"
        )
    cache = {cache_argument(model): StaticCache(config=model.config, max_cache_len=length)}
    logits = model(
        input_ids=ids, cache_position=torch.arange(n, device=device), use_cache=True, **cache
    ).logits
    token = logits[:, -1:].argmax(-1)
    position = torch.tensor([n], device=device)
    new = [token.clone()]

    forward = model if step_forward is None else step_forward

    def step() -> torch.Tensor:
        return forward(input_ids=token, cache_position=position, use_cache=True, **cache).logits

    def warm_up(steps: int) -> None:
        """Run the step ``steps`` times, then put the cache's counters back: each run writes
        the first step's token at its position (the same keys and values), but a cache that
        counts what it holds (transformers' static layers write where their count says)
        counted them."""
        counters = _counters(cache)
        for _ in range(steps):
            step()
        _restore(counters)

    replay: Callable[[], torch.Tensor] = step
    if cuda_graph and max_new_tokens > 1:
        # warm-ups on a side stream before the capture (kernels compiled, allocations made)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            warm_up(2)
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
    elif step_forward is not None and max_new_tokens > 1:
        warm_up(1)  # a compiled step compiles at its first call: not the decoding's time
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


def compiled_cache_length(needed: int, config: Any = None, smallest: int = 256) -> int:
    """The static cache's length for a compiled step that must hold ``needed`` positions: the
    power of two at or above it, at least ``smallest``, and no longer than the model's
    ``max_position_embeddings`` where that holds ``needed``. ``torch.compile`` specialises
    the step to the cache's shape, so a cache sized to each prompt recompiled the step for
    every new prompt length, and under ``fullgraph`` failed at dynamo's recompile limit (8):
    with these lengths 8 compilations reach 32,768 positions. The positions past the
    tokens are masked, so they change no logit."""
    length = max(smallest, 1 << max(needed - 1, 0).bit_length())
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and needed <= limit < length:
        length = limit
    return length


def _counters(cache: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """What a static cache keeps besides its keys and values (counters of what it holds), per
    layer: ``(layer, name, a copy)``."""
    (held,) = cache.values()
    kept = []
    for layer in getattr(held, "layers", []):
        for name, value in vars(layer).items():
            if name in ("keys", "values"):
                continue
            if isinstance(value, torch.Tensor):
                kept.append((layer, name, value.clone()))
            elif isinstance(value, int) and not isinstance(value, bool):
                kept.append((layer, name, value))
    return kept


def _restore(counters: list[tuple[Any, str, Any]]) -> None:
    """Put the counters :func:`_counters` copied back (tensors in place: a compiled or captured
    step holds their addresses)."""
    for layer, name, value in counters:
        if isinstance(value, torch.Tensor):
            getattr(layer, name).copy_(value)
        else:
            setattr(layer, name, value)


def timed_generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    cuda_graph: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """Greedy text after ``prompt`` and its timing (:func:`torq.api.generate`, which
    checks the arguments): transformers' ``generate``, or :func:`greedy_decode` over a
    static cache (``cuda_graph``: the step as a CUDA graph; ``compiled``: through
    ``torch.compile``)."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] == 0:
        raise TorqError("the prompt is empty")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    class Clock:  # transformers' streamer interface: the prompt, then each new token
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(now())

        def end(self) -> None:
            pass

    clock = Clock()
    t0 = now()
    if cuda_graph or compiled:
        clock.put(ids)  # as generate's streamer: the prompt first
        step = None
        dynamo_errors: tuple[type[Exception], ...] = ()  # (none caught without compiling)
        if compiled:  # (compiled once: a later call on the same model reuses it)
            # imported here: dynamo takes a second to import, for plain decoding
            from torch._dynamo.exc import TorchDynamoException

            dynamo_errors = (TorchDynamoException,)
            step = torch.compile(model, fullgraph=True, dynamic=False)
        try:
            new = greedy_decode(
                model,
                ids,
                max_new_tokens,
                cuda_graph=cuda_graph,
                eos_token_id=tokenizer.eos_token_id,
                on_token=lambda: clock.put(None),
                step_forward=step,
                cache_length=(
                    compiled_cache_length(ids.shape[1] + max_new_tokens, model.config)
                    if compiled
                    else None
                ),
            )[0]
        except GraphCaptureError as exc:
            raise TorqError(
                f"the decoding step could not be captured as a CUDA graph: {exc}"
            ) from None
        except dynamo_errors as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TorqError(f"torch.compile could not compile the decoding step: {first}") from None
    else:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                streamer=clock,
            )
        new = out[0, ids.shape[1] :]
    seconds = now() - t0
    tokens = clock.times[1:]  # the first put is the prompt
    decode = None
    if len(tokens) >= 2 and tokens[-1] > tokens[0]:
        decode = (len(tokens) - 1) / (tokens[-1] - tokens[0])
    return {
        "text": tokenizer.decode(new, skip_special_tokens=True),
        "new_tokens": int(new.numel()),
        "seconds": seconds,
        "tokens_per_s": int(new.numel()) / seconds if seconds > 0 else float("inf"),
        "prefill_seconds": (tokens[0] - t0) if tokens else seconds,
        "decode_tokens_per_s": decode,
    }
