"""Merge the answers of a second process on a row into the row's portable copy.

A long generation row (``benchmarks/humaneval.py``, one problem at a time) can be made by
two processes side by side, one on each core: the row's own run takes lm-eval's order
(longest prompt first) and a second one, started from a copy of the row's portable copy,
takes the reverse (``--order shortest-first``) with its own ``--resume-dir`` and
``--portable-dir``. Stop both, then

    python benchmarks/carry_merge.py results/humaneval/helper-carry/X.npz \\
        docs/humaneval/carry/X.npz

adds the second one's answers to the row's copy (``torq.eval.portable.merge_portable``:
the same setting, model and CPU, and every answer both hold the same, or nothing is
written), and the row's command, run again, uses them instead of generating them. Merge
only while the row's own run is stopped: it rewrites its copy as it goes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torq.errors import TorqError
from torq.eval.portable import merge_portable


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the second process's portable copy")
    ap.add_argument("dst", type=Path, help="the row's portable copy, added to in place")
    args = ap.parse_args(argv)
    if args.src.resolve() == args.dst.resolve():
        ap.error("the two copies are one file")
    try:
        out = merge_portable(args.src, args.dst)
    except TorqError as exc:
        sys.exit(f"carry_merge.py: error: {exc}")
    print(
        f"{args.dst}: {out['added']} answers added, {out['shared']} held by both "
        f"(the same), {out['answers']} in all"
    )


if __name__ == "__main__":
    main()
