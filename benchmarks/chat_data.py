"""Chat-format calibration data from local files: GSM8K's training problems and HumanEval's
problems as user/assistant turns (JSON lines of ``messages``), for ``--calib-data``; each
model renders them with its own chat template.

Usage: ``python -m benchmarks.chat_data --out results/chat`` writes
``gsm8k-chat.jsonl`` (GSM8K train: the question, then its worked answer) and
``humaneval-chat.jsonl`` (a HumanEval prompt to complete, then the prompt with its canonical
solution) from ``--data-dir`` (``$TORQ_DATA_DIR``, laid out like ``../shared/data``).
Then, for example, ``torq quantize smollm2-135m --out q --calib-data
results/chat/gsm8k-chat.jsonl:24,results/chat/humaneval-chat.jsonl:8 --calib-samples 32``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from torq.experimental import TorqError, resolve_data_dir


def gsm8k_chats(data_dir: Path) -> list[dict]:
    """GSM8K's training problems: the question as the user's turn, the worked answer (its
    ``#### N`` line included) as the assistant's."""
    path = data_dir / "gsm8k" / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {"messages": [{"role": "user", "content": r["question"]},
                      {"role": "assistant", "content": r["answer"]}]}
        for r in rows
    ]  # fmt: skip


def humaneval_chats(data_dir: Path) -> list[dict]:
    """HumanEval's problems: the prompt to complete as the user's turn, the prompt with its
    canonical solution as the assistant's."""
    with gzip.open(data_dir / "humaneval" / "HumanEval.jsonl.gz", "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [
        {"messages": [
            {"role": "user", "content": "Complete this Python function.\n\n" + r["prompt"]},
            {"role": "assistant", "content": r["prompt"] + r["canonical_solution"]},
        ]}
        for r in rows
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the two .jsonl files")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    data_dir = resolve_data_dir(args.data_dir)
    if data_dir is None:
        raise TorqError("no data directory: --data-dir or $TORQ_DATA_DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, chats in (("gsm8k", gsm8k_chats(data_dir)), ("humaneval", humaneval_chats(data_dir))):
        path = out / f"{name}-chat.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in chats))
        print(f"wrote {path} ({len(chats)} chats)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
