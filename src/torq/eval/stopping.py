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
