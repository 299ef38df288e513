"""Generation tasks through lm-eval offline: HumanEval's completions, GSM8K on a seeded subset."""

from __future__ import annotations

import torch

from tests.eval.test_sandbox import needs_isolation


@needs_isolation
def test_humaneval_completions_are_the_models_greedy_continuations(tiny_tokenizer) -> None:
    """lm-eval generates each completion offline (torq's own config of its humaneval task):
    the model's greedy continuation of the prompt, cut at the task's first stop sequence;
    the completions are then scored in the sandbox."""
    from tests.conftest import SHARED_DATA, tiny_model
    from torq.eval.generation import STOP, evaluate_humaneval
    from torq.eval.humaneval import load_humaneval

    model = tiny_model("llama")
    result = evaluate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), limit=2, max_gen_toks=8)
    assert result["problems"] == 2 and result["pass@1"] == 0.0  # a random tiny model
    for problem in load_humaneval(SHARED_DATA)[:2]:
        ids = tiny_tokenizer(problem.prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(ids.input_ids, max_new_tokens=8, do_sample=False)
        text = tiny_tokenizer.decode(out[0, ids.input_ids.shape[1] :])
        for stop in STOP:
            text = text.split(stop)[0]
        got = result["tasks"][problem.task_id]
        assert got["completion"] == text
        assert got["first_failure"] is not None


def test_gsm8k_runs_offline_on_a_seeded_subset(tiny_tokenizer, monkeypatch) -> None:
    """GSM8K through lm-eval with its data from the local files: the seed picks the
    problems (the same for every method), lm-eval's own filters and exact match score them.
    A model that answers each problem with its reference's final line scores 1 on both
    filters; the tiny random model scores 0."""
    from lm_eval.models.huggingface import HFLM

    from tests.conftest import SHARED_DATA, tiny_model
    from torq.eval.generation import evaluate_gsm8k

    model = tiny_model("llama")
    run = evaluate_gsm8k(model, tiny_tokenizer, str(SHARED_DATA), n=3, gen_kwargs="max_gen_toks=4")
    assert run["n"] == 3 and sorted(run["answers"]) == run["problems"]
    assert run["strict-match"]["exact_match"] == 0.0
    again = evaluate_gsm8k(
        model, tiny_tokenizer, str(SHARED_DATA), n=3, gen_kwargs="max_gen_toks=4"
    )
    assert again["problems"] == run["problems"]
    other = evaluate_gsm8k(
        model, tiny_tokenizer, str(SHARED_DATA), n=3, seed=1, gen_kwargs="max_gen_toks=4"
    )
    assert other["problems"] != run["problems"]

    def oracle(self, requests, disable_tqdm=False):
        return [f"So: #### {r.doc['answer'].split('#### ')[-1].strip()}" for r in requests]

    monkeypatch.setattr(HFLM, "generate_until", oracle)
    right = evaluate_gsm8k(model, tiny_tokenizer, str(SHARED_DATA), n=3)
    assert right["strict-match"]["exact_match"] == 1.0
    assert right["flexible-extract"]["exact_match"] == 1.0


def _count_generations(monkeypatch, stop_after: int | None = None) -> list[int]:
    """Count the generations of torq's generating class (one entry each, its prompt's
    length); with
    ``stop_after`` the next one after that many raises, as a run stopped there would."""
    from torq.eval.stopping import StopEachSequenceHFLM as HFLM  # the class torq generates with

    # the class's own method, not an earlier call's counter
    real = getattr(HFLM._model_generate, "__wrapped__", HFLM._model_generate)
    calls: list[int] = []  # each generation's prompt length, in tokens

    def counted(self, *args, **kwargs):
        if stop_after is not None and len(calls) >= stop_after:
            raise RuntimeError("stopped")
        context = args[0] if args else kwargs["context"]
        calls.append(int(context.shape[1]))
        return real(self, *args, **kwargs)

    counted.__wrapped__ = real  # type: ignore[attr-defined]
    monkeypatch.setattr(HFLM, "_model_generate", counted)
    return calls


def test_generation_goes_on_where_a_stopped_run_stopped(tiny_tokenizer, tmp_path, monkeypatch):
    """With a request cache each completion is kept as it is generated: a run stopped after
    its first answer keeps it, the same call again generates only the rest, and the
    completions are those of a run that never stopped. The directory belongs to its model:
    another model is refused."""
    import pytest

    from tests.conftest import SHARED_DATA, tiny_model
    from torq.errors import TorqError
    from torq.eval.generation import generate_humaneval
    from torq.eval.store import MemoryStore

    model = tiny_model("llama")
    whole, none = generate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), 3, 6)
    assert none is None and len(whole) == 3

    # the answers kept in memory: the evaluation knows only the store, not where it keeps them
    cache = MemoryStore()
    _count_generations(monkeypatch, stop_after=1)
    with pytest.raises(RuntimeError, match="stopped"):
        generate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), 3, 6, store=cache)

    calls = _count_generations(monkeypatch)
    again, info = generate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), 3, 6, store=cache)
    assert again == whole
    assert len(calls) == 2  # the answer kept before the stop was not generated again
    assert info is not None and info["entries_before"] == 1 and info["entries_after"] == 3
    assert len(info["sessions"]) == 2

    with pytest.raises(TorqError, match="another model"):
        generate_humaneval(
            tiny_model("llama", seed=1), tiny_tokenizer, str(SHARED_DATA), 3, 6, store=cache
        )


def test_problems_by_index_ask_only_those(tiny_tokenizer):
    """``problems`` asks only the problems given by index, and each gets the completion
    the whole run gives it (a prompt does not depend on the others)."""
    from tests.conftest import SHARED_DATA, tiny_model
    from torq.eval.generation import generate_humaneval
    from torq.eval.humaneval import load_humaneval

    model = tiny_model("llama")
    data = str(SHARED_DATA)
    whole, _ = generate_humaneval(model, tiny_tokenizer, data, 4, 6)
    asked = [3, 1]
    some, _ = generate_humaneval(model, tiny_tokenizer, data, None, 6, problems=asked)
    ids = [load_humaneval(data)[i].task_id for i in asked]
    assert set(some) == set(ids)
    assert all(some[t] == whole[t] for t in ids)


CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}"
)


@needs_isolation
def test_the_instruct_prompt_asks_in_the_chat_template_and_cuts_at_the_fence(
    tiny_tokenizer, monkeypatch
) -> None:
    """``prompt="instruct"`` (lm-eval's ``humaneval_instruct``): the request goes through the
    tokenizer's chat template, the answer begins with the problem's prompt in a code fence,
    and the completion is the model's greedy continuation of that, cut at the task's stop
    sequences and at the closing fence. A program answered in a fence with prose after it
    passes with this prompt and fails as a plain completion; a tokenizer without a chat
    template is refused before any generation."""
    import copy

    import pytest
    from lm_eval.models.huggingface import HFLM

    from tests.conftest import SHARED_DATA, tiny_model
    from torq.errors import TorqError
    from torq.eval.generation import (
        INSTRUCT_PREFIX,
        INSTRUCT_REQUEST,
        STOP,
        evaluate_humaneval,
        generate_humaneval,
    )
    from torq.eval.humaneval import load_humaneval

    model = tiny_model("llama")
    with pytest.raises(TorqError, match="chat template"):
        generate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), 1, 4, prompt="instruct")
    chat = copy.deepcopy(tiny_tokenizer)
    chat.chat_template = CHAT
    got, _ = generate_humaneval(model, chat, str(SHARED_DATA), 2, 8, prompt="instruct")
    for problem in load_humaneval(SHARED_DATA)[:2]:
        messages = [
            {"role": "user", "content": INSTRUCT_REQUEST.format(prompt=problem.prompt)},
            {"role": "assistant", "content": INSTRUCT_PREFIX.format(prompt=problem.prompt)},
        ]
        context = chat.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert context.startswith("<|user|>\nWrite a solution") and problem.prompt in context
        assert "<|assistant|>\nHere is the completed function:\n```python\n" in context
        ids = chat(context, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        text = chat.decode(out[0, ids.shape[1] :])
        for stop in [*STOP, "```"]:
            text = text.split(stop)[0]
        assert got[problem.task_id] == text

    first = load_humaneval(SHARED_DATA)[0]

    def fenced(self, requests, disable_tqdm=False):
        return [first.canonical_solution + "```\nThis returns the answer." for _ in requests]

    monkeypatch.setattr(HFLM, "generate_until", fenced)
    instruct = evaluate_humaneval(model, chat, str(SHARED_DATA), 1, 8, prompt="instruct")
    plain = evaluate_humaneval(model, chat, str(SHARED_DATA), 1, 8)
    assert (instruct["pass@1"], plain["pass@1"]) == (1.0, 0.0)
    assert (instruct["prompt"], plain["prompt"]) == ("instruct", "completion")


def test_a_problem_count_outside_the_data_is_refused(tiny_tokenizer) -> None:
    """lm-eval reads a count of 0, or one past the end, as every problem: a GSM8K subset or
    a HumanEval limit outside ``1..total`` is refused in one line before the model runs."""
    import pytest

    from tests.conftest import SHARED_DATA
    from torq.errors import TorqError
    from torq.eval.generation import evaluate_gsm8k, generate_humaneval, gsm8k_test_size

    data = str(SHARED_DATA)
    total = gsm8k_test_size(data)
    assert total == 1319  # the released test split
    for n in (0, -1, total + 1):
        with pytest.raises(TorqError, match=f"between 1 and {total}"):
            evaluate_gsm8k(None, tiny_tokenizer, data, n=n)  # type: ignore[arg-type]
    with pytest.raises(TorqError, match="between 1 and 164"):
        generate_humaneval(None, tiny_tokenizer, data, limit=0)  # type: ignore[arg-type]
