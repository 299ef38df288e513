"""Each answer of a batch stops at its own stop string (``torq.eval.stopping``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.models.utils_hf import stop_sequences_criteria

from torq.eval.stopping import StopEachSequence

# HumanEval's stop strings, "\n#" swapped for "\n=" (the tiny tokenizer has no "#")
STOPS = ["\nclass", "\ndef", "\n=", "\nif", "\nprint"]


def _batch(tokenizer, prompt: str, answers: list[str]) -> tuple[torch.Tensor, int]:
    """A batch at one step of ``generate``: the prompt, then as many generated tokens in
    every row (each answer after filler tokens); and where the generated part begins."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    a = [tokenizer.encode(x, add_special_tokens=False) for x in answers]
    width = max(len(x) for x in a)
    filler = tokenizer.encode("e", add_special_tokens=False)[0]
    return torch.tensor([p + [filler] * (width - len(x)) + x for x in a]), len(p)


def test_rows_that_end_on_different_stop_strings_are_each_finished(tiny_tokenizer) -> None:
    """Two answers ending on different stop strings are both finished, the third is not;
    lm-eval's criteria (one bool per stop string, true when every row holds it) go on. One
    row alone stops exactly where lm-eval's criteria stop."""
    answers = ["    return a\ndef", "    return b\n=", "    return c"]
    ids, start = _batch(tiny_tokenizer, "def f(a):\n", answers)
    assert StopEachSequence(STOPS, tiny_tokenizer, start, 3)(ids, None).tolist() == [
        True, True, False,
    ]  # fmt: skip
    theirs = stop_sequences_criteria(tiny_tokenizer, STOPS, start, 3)
    assert not any(bool(c(ids, None)) for c in theirs)
    for row, answer in enumerate(answers):
        one = ids[row : row + 1]
        mine = bool(StopEachSequence(STOPS, tiny_tokenizer, start, 1)(one, None)[0])
        criteria = stop_sequences_criteria(tiny_tokenizer, STOPS, start, 1)
        lm_eval = any(bool(c(one, None)) for c in criteria)
        assert mine == lm_eval == answer.endswith(("\ndef", "\n="))


def test_a_finished_row_stays_finished(tiny_tokenizer) -> None:
    """Once a row has held a stop string it stays finished when later tokens (the padding
    ``generate`` appends) push the string out of the look-back window."""
    ids, start = _batch(tiny_tokenizer, "a = 1\n", ["\ndef"])
    stop = StopEachSequence(STOPS, tiny_tokenizer, start, 1)
    assert stop(ids, None).tolist() == [True]
    later = torch.cat([ids, torch.full((1, 12), tiny_tokenizer.eos_token_id)], dim=1)
    assert stop(later, None).tolist() == [True]
    fresh = StopEachSequence(STOPS, tiny_tokenizer, start, 1)
    assert fresh(later, None).tolist() == [False]  # the window alone no longer holds it
