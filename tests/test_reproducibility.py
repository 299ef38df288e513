"""A method's result depends only on its own settings: not on the other methods of the run,
their order, the global random state, or how the threads split the work (issue 31)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model
from torq.calibration.capture import BlockStatistics
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.methods import METHODS, get_method
from torq.methods.registry import method_specs
from torq.methods.settings import TorqSettings
from torq.pipeline import run
from torq.rotations.intra_block import IntraBlockConfig
from torq.runs.config import RunConfig
from torq.runs.store import setting_key
from torq.seeding import derive_seed, method_rng

# Every method that draws at random or calibrates, and the composition with GPTQ.
RANDOM_OR_CALIBRATED = sorted(
    [n for n, m in METHODS.items() if m.quantizes and n != "rtn"]
    + [f"{n}+gptq" for n, m in METHODS.items() if m.supports_gptq and n != "rtn"]  # rtn+gptq: gptq
)


ALONE = ("quarot", "torq", "torq-guard+gptq", "torq-perm")


def _reference_reservoir(rows: list[torch.Tensor], capacity: int, seed: int) -> torch.Tensor:
    """Algorithm R item by item, with the same random numbers as the vectorized update."""
    gen = torch.Generator().manual_seed(seed)
    sample: list[torch.Tensor] = []
    seen = 0
    for x in rows:
        free = capacity - len(sample)
        head, tail = x[: max(free, 0)], x[max(free, 0) :]
        sample.extend(head)
        seen += head.shape[0]
        if tail.shape[0] == 0:
            continue
        draws = torch.rand(tail.shape[0], generator=gen, dtype=torch.float64)
        for i, row in enumerate(tail):
            seen += 1
            slot = int(draws[i] * seen)
            if slot < capacity:
                sample[slot] = row  # a later item that draws the same slot replaces it
    return torch.stack(sample)


def test_reservoir_is_algorithm_r_whatever_the_threads() -> None:
    """Many items of one batch draw the same slot; the last of them must hold it, as in the
    sequential algorithm, on any number of threads (an indexed assignment with repeated
    indices left the winner to the threads, and the sample changed from run to run)."""
    torch.manual_seed(1)
    rows = [torch.randn(4096, 64) for _ in range(6)]
    expected = _reference_reservoir(rows, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            for _ in range(3):
                st = BlockStatistics(64, 32, 64, seed=7)
                for x in rows:
                    st.update(x)
                assert torch.equal(st.sample, expected), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(0, "a") == derive_seed(0, "a")
    assert len({derive_seed(s, i) for s in (0, 1) for i in ("a", "b")}) == 4
    assert 0 <= derive_seed(123, "x") < 2**63
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with method_rng(0, "m"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the outer state is restored
    torch.rand(10)  # whatever ran before
    with method_rng(0, "m"):
        assert torch.equal(torch.rand(3), first)


@pytest.fixture
def data_dir(tiny_calibration_data_dir: Path) -> Path:
    return tiny_calibration_data_dir


@pytest.fixture
def tiny_folder(tmp_path: Path, tiny_tokenizer) -> Path:
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _run(methods: list[str], data_dir, folder, seed: int = 0) -> dict[str, float]:
    settings = TorqSettings(intra=IntraBlockConfig(max_iter=2, init="hadamard", k_top=32))
    # 4 × 64 calibration tokens into a reservoir of 48: the sample is drawn at random
    capture = CaptureSettings(CalibrationConfig(n_samples=4, seqlen=64), reservoir_tokens=48)
    config = RunConfig.of(
        model=str(folder),
        methods=method_specs(methods, settings),
        seqlen=64,
        max_windows=3,
        data_dir=str(data_dir),
        seed=seed,
        capture=capture,
    )
    rows = run(config, progress=False)["rows"]
    return {r["method"]: r["ppl"] for r in rows}


def test_every_method_is_independent_of_the_rest_of_the_run(data_dir, tiny_folder) -> None:
    """Each random or calibrated method after all the others and in reverse order (and the
    ones that draw random numbers alone), on two threads and from scrambled global random
    states: the same perplexity, bit for bit (a changed weight, transform or sample would
    move it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        everything = ["fp", "rtn", *RANDOM_OR_CALIBRATED]
        together = _run(everything, data_dir, tiny_folder)
        torch.manual_seed(12345)
        torch.rand(1000)
        backwards = _run(everything[::-1], data_dir, tiny_folder)
        for method in RANDOM_OR_CALIBRATED:  # after every other method, and before them all
            assert together[method] == backwards[method], method
        # and alone: the methods that draw random numbers (QuaRot's signs, the calibration
        # sample, the guard's held-back tokens, the permutation's), each in a process state
        # of its own
        for method in ALONE:
            torch.manual_seed(len(method))
            alone = _run([method], data_dir, tiny_folder)[method]
            assert together[method] == alone, method
    finally:
        torch.set_num_threads(threads)
    # the methods do differ, so equal numbers are not an accident of a degenerate setup
    assert len({together[m] for m in RANDOM_OR_CALIBRATED}) > len(RANDOM_OR_CALIBRATED) // 2


def test_run_seed_reaches_quarot(data_dir, tiny_folder) -> None:
    """``--seed`` sets QuaRot's random signs (it was read but never passed), and is part of
    QuaRot's settings key, so a kept model of one seed is not reused for another."""
    a = _run(["quarot"], data_dir, tiny_folder, seed=0)["quarot"]
    b = _run(["quarot"], data_dir, tiny_folder, seed=1)["quarot"]
    assert a != b
    assert _run(["quarot"], data_dir, tiny_folder, seed=1)["quarot"] == b
    base = {"model": "m", "seed": 0}
    assert setting_key({**base, "seed": 1}, "quarot") != setting_key(base, "quarot")
    assert setting_key({**base, "seed": 1}, "torq") == setting_key(base, "torq")
    assert get_method("quarot+gptq").name == "quarot+gptq"
