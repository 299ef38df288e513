"""``benchmarks/peers/peer_common.py``: a peer scored on the windows ``torq run`` scores, the
first N or the same seeded sample of the whole test."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import peer_common

from torq.eval import windows_from_text
from torq.eval.perplexity import sample_windows


class CharTokenizer:
    """One id per character: enough text for a few windows of a short length."""

    def __call__(self, text: str, **_: object) -> SimpleNamespace:
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 97 for c in text]]))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peer_common.add_common_args(parser, "test")
    return parser.parse_args(["--seqlen", "8", *argv])


TEXT = "".join(chr(97 + i % 26) for i in range(8 * 40 + 3))


def test_the_first_16_windows_unless_told() -> None:
    tok = CharTokenizer()
    windows, sample = peer_common.eval_windows(_args(), TEXT, tok)
    assert sample is None
    assert torch.equal(windows, windows_from_text(TEXT, tok, 8, 16))
    full, _ = peer_common.eval_windows(_args("--max-windows", "0"), TEXT, tok)
    assert full.shape[0] == windows_from_text(TEXT, tok, 8, None).shape[0] > 16


def test_a_window_sample_is_torq_runs_draw_of_the_whole_test() -> None:
    tok = CharTokenizer()
    args = _args("--window-sample", "5", "--window-sample-seed", "3")
    windows, sample = peer_common.eval_windows(args, TEXT, tok)
    every = windows_from_text(TEXT, tok, 8, None)
    expected, ids = sample_windows(every, 5, 3)
    assert torch.equal(windows, expected)
    assert sample == {"n": 5, "seed": 3, "of": int(every.shape[0]), "ids": ids}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--window-sample", "5", "--max-windows", "16"), "drop --max-windows"),
        (("--window-sample", "1"), "at least 2 windows"),
    ],
)
def test_conflicting_window_choices_stop_in_one_line(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        peer_common.eval_windows(_args(*argv), TEXT, CharTokenizer())


def test_a_checkout_is_imported_without_the_import_path_and_never_shadows(tmp_path) -> None:
    """A peer's checkout: its top-level packages import one another from it, the import
    path stays as it was, and a name an installed module takes is refused, not shadowed."""
    repo = tmp_path / "checkout"
    (repo / "torqpeer_pkg").mkdir(parents=True)
    (repo / "torqpeer_pkg" / "__init__.py").write_text("from torqpeer_helper import VALUE\n")
    (repo / "torqpeer_helper.py").write_text("VALUE = 7\n")
    (repo / "json").mkdir()
    (repo / "json" / "__init__.py").write_text("SHADOW = True\n")
    before = list(sys.path)
    (pkg,) = peer_common.import_from_checkout(repo, "torqpeer_pkg")
    assert pkg.VALUE == 7 and sys.path == before
    with pytest.raises(SystemExit, match="not from"):
        peer_common.import_from_checkout(repo, "json")
