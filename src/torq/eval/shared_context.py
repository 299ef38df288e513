"""lm-eval's log-likelihood scoring with each shared context run once.

A multiple-choice task asks for ``log p(continuation | context)`` of every choice of a
question, and the choices share the context: HellaSwag's four endings follow one
passage, ARC's answers one question. lm-eval's ``HFLM`` runs ``context + choice`` through
the model once per choice. :class:`SharedContextHFLM` runs the contexts of several
questions once, keeps their key/value cache, and runs the choices on the repeated cache
rows in batches of similar length. The arithmetic per token is the same (causal attention:
a context position never sees a continuation), so the scores agree with ``HFLM``'s to float
rounding; HellaSwag runs 1.8× faster and ARC 2× (``docs/research/zero-shot.md`` §5.1).

Requests whose context is not shared (WinoGrande's partial scoring, LAMBADA), groups whose
continuations are much longer than the shared context (PIQA: the saving is smaller than the
padding it costs), and any that would need lm-eval's left truncation are scored one sequence
each, in ``HFLM``'s own order and batches, except that the vocabulary projection and
log-softmax run only where continuation tokens are predicted (lm-eval computes them at every
position): LAMBADA's one-word continuation follows a paragraph, so most of that work was
thrown away.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm

from torq.models.architecture import cache_argument

Request = tuple[tuple[str, str], list[int], list[int]]


class SharedContextHFLM(HFLM):
    """``HFLM`` whose ``_loglikelihood_tokens`` shares each context's forward pass among the
    continuations that follow it (decoder-only models)."""

    def _loglikelihood_tokens(
        self,
        requests: list[Request],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("a log-likelihood request needs a context and a continuation")
            groups.setdefault(tuple(context), []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        shared: list[tuple[tuple[int, ...], list[int]]] = []
        alone: list[int] = []
        for context, members in groups.items():
            conts = [len(requests[i][2]) for i in members]
            # sharing saves (n − 1) context passes; where the continuations are much longer
            # (PIQA's two solutions after a short question) padding eats that saving
            saved = (len(members) - 1) * (len(context) - 1)
            fits = len(context) + max(conts) <= self.max_length
            if len(members) > 1 and len(context) >= 2 and fits and 2 * saved >= sum(conts):
                shared.append((context, members))
            else:
                alone.extend(members)
        if alone:
            scored = self._score_alone([requests[i] for i in alone], disable_tqdm, override_bs)
            for i, answer in zip(alone, scored, strict=True):
                results[i] = answer
        # longest contexts first, as lm-eval orders its batches (memory trouble shows at
        # once), and similar lengths together, so that little of a batch is padding
        shared.sort(key=lambda g: -len(g[0]))
        per_batch = 4 * (self.batch_size if isinstance(self.batch_size, int) else 8)
        bar = tqdm(
            total=sum(len(m) for _, m in shared),
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood requests (shared contexts)",
        )
        for start in range(0, len(shared), per_batch):
            chunk = shared[start : start + per_batch]
            answers = self._score_groups(
                [(list(c), [requests[i][2] for i in members]) for c, members in chunk]
            )
            for (_, members), group_answers in zip(chunk, answers, strict=True):
                for i, answer in zip(members, group_answers, strict=True):
                    results[i] = answer
                    if requests[i][0] is not None:  # rolling windows have no cache key
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(members))
        bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _autocast(self) -> AbstractContextManager[Any]:
        """lm-eval's mixed-precision context for model calls (none unless it was asked for)."""
        dtype = getattr(self, "mixed_precision_dtype", None)
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=dtype)

    @torch.no_grad()
    def _score_alone(
        self, requests: list[Request], disable_tqdm: bool, override_bs: int | None
    ) -> list[tuple[float, bool]]:
        """``HFLM._loglikelihood_tokens`` for requests that share no context, with logits
        kept only for the positions that predict a continuation token.

        Same order, batches, right padding and left truncation as lm-eval (its ``Collator``,
        one-token-continuation reuse included), so the transformer body computes exactly
        what ``HFLM`` computes; the vocabulary projection then runs on the batch's window
        ``[min(start), max(end))`` of continuation positions (``logits_to_keep``), not on
        every position of every row.
        """
        size = override_bs if self.batch_size == "auto" else self.batch_size
        if not isinstance(size, int):  # automatic batch size: lm-eval's own search
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        order = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts" if getattr(self, "logits_cache", True) else None,
            group_fn=lambda r: r[1] + r[2][:-1],
        )
        bar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood requests",
        )
        answers: list[tuple[float, bool]] = []
        dev = self.device
        for chunk in order.get_batched(n=size):
            inputs = []
            for _, context, continuation in chunk:
                if not 0 < len(continuation) <= self.max_length:
                    raise ValueError(
                        f"a continuation of {len(continuation)} tokens cannot be scored "
                        f"within {self.max_length} positions"
                    )
                # as lm-eval: the last max_length + 1 tokens, the final one only predicted
                inputs.append((context + continuation)[-(self.max_length + 1) :][:-1])
            width = max(len(x) for x in inputs)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)  # lm-eval pads with 0
            for b, x in enumerate(inputs):
                ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            starts = [len(x) - len(r[2]) for x, r in zip(inputs, chunk, strict=True)]
            lo, hi = min(starts), max(len(x) for x in inputs)
            with self._autocast():
                logits = self.model(
                    input_ids=ids.to(dev), logits_to_keep=torch.arange(lo, hi, device=dev)
                ).logits
            if logits.shape[1] != hi - lo:
                raise RuntimeError(
                    f"{type(self.model).__name__} ignored logits_to_keep "
                    f"({logits.shape[1]} positions, {hi - lo} asked for)"
                )
            logp = F.log_softmax(logits, dim=-1, dtype=getattr(self, "softmax_dtype", None))
            for b, (key, context, continuation) in enumerate(chunk):
                rows = logp[b, starts[b] - lo : starts[b] - lo + len(continuation)][None]
                greedy = rows.argmax(dim=-1)
                # requests that differ only in a one-token continuation share these logits
                for key_i, cont_i, rows_i in order.get_cache(
                    req_str=key, cxt_toks=context, cont_toks=continuation, logits=rows
                ):
                    target = torch.tensor(cont_i, dtype=torch.long, device=rows_i.device)
                    n = len(cont_i)
                    answer = (
                        float(rows_i[0, -n:].gather(1, target[:, None]).sum()),
                        bool((greedy[0, -n:] == target).all()),
                    )
                    answers.append(answer)
                    if key_i is not None:
                        self.cache_hook.add_partial("loglikelihood", key_i, answer)
                    bar.update(1)
        bar.close()
        return order.get_original(answers)

    @torch.no_grad()
    def _score_groups(
        self, groups: list[tuple[list[int], list[list[int]]]]
    ) -> list[list[tuple[float, bool]]]:
        """``(Σ log p(cont_t | context, cont_<t), greedy)`` for each continuation of each
        ``(context, continuations)`` group.

        Pass 1 runs every context but its last token (right-padded, masked) and keeps the
        key/value cache. The cache rows are then repeated, one per continuation, and pass 2
        runs ``[last context token] + continuation[:-1]`` on them: its logits predict every
        continuation token, with positions and mask that skip the padding of pass 1.
        """
        model: Any = self.model
        dev = self.device
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else int(pad)
        heads = [ctx[:-1] for ctx, _ in groups]
        width = max(len(h) for h in heads)
        ids = torch.full((len(groups), width), pad, dtype=torch.long)
        mask = torch.zeros((len(groups), width), dtype=torch.long)
        for g, head in enumerate(heads):
            ids[g, : len(head)] = torch.tensor(head, dtype=torch.long)
            mask[g, : len(head)] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        with self._autocast():
            cache = _returned_cache(
                model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            )

        owner = [g for g, (_, conts) in enumerate(groups) for _ in conts]
        rows = [[ctx[-1], *cont[:-1]] for ctx, conts in groups for cont in conts]
        targets = [cont for _, conts in groups for cont in conts]
        # pass 2 in batches of similar length (as lm-eval sorts its own), each on its own
        # selection of the cache rows it needs
        order = sorted(range(len(rows)), key=lambda r: -len(rows[r]))
        cache_name = cache_argument(model)  # the forward's own name for the cache
        per_batch = 2 * (self.batch_size if isinstance(self.batch_size, int) else 8)
        scored: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(order), per_batch):
            batch = order[start : start + per_batch]
            length = len(rows[batch[0]])
            q_ids = torch.full((len(batch), length), pad, dtype=torch.long)
            q_mask = torch.zeros((len(batch), length), dtype=torch.long)
            positions = torch.zeros((len(batch), length), dtype=torch.long)
            for b, r in enumerate(batch):
                q_ids[b, : len(rows[r])] = torch.tensor(rows[r], dtype=torch.long)
                q_mask[b, : len(rows[r])] = 1
                positions[b] = len(heads[owner[r]]) + torch.arange(length)
            index = torch.tensor([owner[r] for r in batch], dtype=torch.long, device=dev)
            rows_cache = _select_rows(cache, index)
            with self._autocast():
                logits = model(
                    input_ids=q_ids.to(dev),
                    attention_mask=torch.cat([mask[index], q_mask.to(dev)], dim=1),
                    position_ids=positions.to(dev),
                    use_cache=True,
                    **{cache_name: rows_cache},
                ).logits
            for b, r in enumerate(batch):
                cont = targets[r]
                logp = F.log_softmax(
                    logits[b, : len(cont)], dim=-1, dtype=getattr(self, "softmax_dtype", None)
                )
                target = torch.tensor(cont, dtype=torch.long, device=logp.device)
                total = float(logp.gather(1, target[:, None]).sum())
                scored[r] = (total, bool((logp.argmax(dim=-1) == target).all()))
        answers: list[list[tuple[float, bool]]] = [[] for _ in groups]
        for r in range(len(rows)):  # in request order within each group
            answers[owner[r]].append(scored[r])
        return answers


def _select_rows(cache: Any, index: torch.Tensor) -> Any:
    """A cache holding ``cache``'s batch rows ``index`` (repeats allowed), ``cache`` intact:
    the layer objects are copied shallowly, then each copy's tensors are re-indexed."""
    rows = copy.copy(cache)
    rows.layers = [copy.copy(layer) for layer in cache.layers]
    rows.batch_select_indices(index)
    return rows


def _returned_cache(output: Any) -> Any:
    """The key/value cache of a forward's output, under its new name or its old one."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
