"""What the carried rows hold: one line per portable copy (``torq.eval.portable``) under
the given folders, with its answers so far, so that a session sees at a glance how far each
row has got, without loading a model.

    python benchmarks/carry_status.py docs/formats/carry docs/humaneval/carry docs/gsm8k/carry

Writes a markdown table to standard output (and, with ``--out F.json``, the same as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torq.errors import TorqError
from torq.eval.portable import carry_summary

COLUMNS = (
    ("file", "file"),
    ("task", "task"),
    ("method", "method"),
    ("format", "format"),
    ("calib_corpus", "calibration"),
    ("calib_seed", "seed"),
    ("answers", "scored"),
    ("generations", "generated"),
    ("sessions", "sessions"),
    ("seconds", "s, all sessions"),
    ("cpus", "CPU"),
)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, one per copy, in ``COLUMNS`` order."""
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for row in rows:
        cells = []
        for key, _ in COLUMNS:
            value = row.get(key)
            if key == "seconds":
                value = f"{value:.0f}"
            elif key == "cpus":  # a W4A4 row goes on only on its CPU (RESULTS §12.5)
                value = ", ".join(value) or None
            cells.append("" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders holding .npz copies")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        ap.error(f"not a folder: {', '.join(missing)}")
    try:
        rows = [carry_summary(p) for f in args.folders for p in sorted(f.glob("*.npz"))]
    except TorqError as e:
        sys.exit(f"carry_status: {e}")
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
