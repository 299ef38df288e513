"""Generation in batches that stops each answer at its own stop string.

lm-eval's ``HFLM`` builds one stopping criterion per stop string
(``MultiTokenEOSCriteria``), each returning a single ``bool``: true once *every* sequence of
the batch contains *that* string. HumanEval has five stop strings (``\\nclass``, ``\\ndef``,
``\\n#``, ``\\nif``, ``\\nprint``) and answers end on different ones, so a batch of several
problems runs to ``max_gen_toks`` (1024 here) almost always; the answers come out right (each
is cut at its first stop string afterwards) but batching buys nothing, on a CPU it costs.

:class:`StopEachSequence` checks the same strings over the same look-back windows, row by
row, and returns a tensor with one flag per row, which ``transformers``' ``generate`` reads as
"this row is finished": the row is padded from then on and the batch ends with its last
answer. With one problem per batch it stops exactly where lm-eval's criteria stop.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from lm_eval.models.huggingface import HFLM

from torq.errors import TorqError


class StopEachSequence(transformers.StoppingCriteria):
    """Row ``i`` is finished once the tokens it generated end with a window holding any of
    ``stops`` (each string's window: its own token count + 2, as lm-eval's)."""

    def __init__(self, stops: list[str], tokenizer: Any, prompt_length: int, batch: int) -> None:
        self.stops = [
            (s, len(tokenizer.encode(s, add_special_tokens=False)) + 2) for s in stops if s
        ]
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length
        self.done = torch.zeros(batch, dtype=torch.bool)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.prompt_length :]
        for stop, window in self.stops:
            texts = self.tokenizer.batch_decode(new[:, -window:])
            for i, text in enumerate(texts):
                if stop in text:
                    self.done[i] = True
        return self.done.to(input_ids.device).clone()


class StopEachSequenceHFLM(HFLM):
    """lm-eval's ``HFLM`` whose batched ``generate`` stops each answer at its own stop
    string (:class:`StopEachSequence`); everything else as ``HFLM``."""

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        # greedy unless asked otherwise, as HFLM: temperature 0 means do_sample=False
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if (temp := generation_kwargs.get("temperature")) == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and temp == 0.0:
            generation_kwargs.pop("temperature", None)
        criteria = transformers.StoppingCriteriaList(
            [StopEachSequence(stop, self.tokenizer, context.shape[1], context.shape[0])]
        )
        with torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        ):
            return self.model.generate(
                input_ids=context,
                max_length=max_length,
                stopping_criteria=criteria,
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=True,
                **generation_kwargs,
            )


# The orders in which a run generates its problems. lm-eval's ``HFLM`` takes the longest
# prompt first; "shortest-first" is its reverse, for a second process on the same row: the
# two meet in the middle and neither generates what the other already has (with one problem
# at a time an answer does not depend on the order, so the row's answers are the same).
ORDERS = ("longest-first", "shortest-first")


class OneAtATime:
    """Mixin for lm-eval's ``HFLM`` (and :class:`StopEachSequenceHFLM`), one problem at a
    time: ``generate_until`` takes the requests in ``generation_order`` (:data:`ORDERS`;
    "longest-first" is ``HFLM``'s own order, longest prompt first, ties by the prompt's
    text) and hands each to ``HFLM`` alone, so that each answer reaches the request cache as
    soon as it is made, as in ``HFLM``'s own loop. Before each, an answer that
    ``partner`` (a :class:`torq.eval.portable.PartnerCopy`: another process making the same
    row) already holds is taken from it instead of generated; ``partner_answers`` counts
    them."""

    generation_order: str = "longest-first"
    partner: Any = None
    partner_answers: int = 0

    def generate_until(  # type: ignore[no-untyped-def]
        self, requests, disable_tqdm: bool = False
    ) -> list[str]:
        from tqdm import tqdm

        from torq.eval.portable import answer_key

        if getattr(self, "batch_size", 1) != 1:
            raise TorqError("one-at-a-time generation runs one problem at a time (batch size 1)")
        encode = self.tok_encode  # type: ignore[attr-defined]
        sign = -1 if self.generation_order == "longest-first" else 1
        order = sorted(
            range(len(requests)),
            key=lambda i: (sign * len(encode(requests[i].args[0])), requests[i].args[0]),
        )
        results: list[str] = [""] * len(requests)
        desc = f"Running generate_until requests, {self.generation_order}"
        for i in tqdm(order, disable=disable_tqdm, desc=desc):
            args = requests[i].args
            made = None
            if self.partner is not None:
                made = self.partner.get(answer_key(args, "generate_until"))
            if made is not None:
                self.cache_hook.add_partial("generate_until", args, made)  # type: ignore[attr-defined]
                self.partner_answers += 1
            else:
                made = super().generate_until([requests[i]], disable_tqdm=True)[0]  # type: ignore[misc]
            results[i] = made
        return results


def ordered_class(base: type, order: str, partner: Any = None) -> type:
    """``base`` (an lm-eval ``HFLM`` class) generating its problems in ``order``
    (:data:`ORDERS`), taking what ``partner`` holds from it (:class:`OneAtATime`);
    ``base`` itself for lm-eval's own order without a partner."""
    if order not in ORDERS:
        raise TorqError(f"unknown generation order {order!r}: one of {', '.join(ORDERS)}")
    if order == "longest-first" and partner is None:
        return base
    attrs = {"generation_order": order, "partner": partner}
    return type(f"OneAtATime{base.__name__}", (OneAtATime, base), attrs)
