"""Rows of several runs on the same seeded window sample, compared window by window.

python -m benchmarks.ppl_paired A.json B.json --reference fp --out results/paired.json

Each record is a ``torq run --window-sample N`` (or a run over the whole test) or a peer
script's record with the same ``--window-sample N`` (``benchmarks/peers/``; its rows are
``fp`` when it has one and the peer's name): every row keeps each window's NLL. The rows of
all the records are compared with the ``--reference`` row (a method name, or
``record-stem:method`` when several records hold it): the whole test's PPL ratio estimated
from the per-window differences, with its 95 % interval
(:func:`torq.eval.perplexity.paired_log_ratio`). Records on other windows are refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import save
from torq.experimental import (
    TorqError,
    command_line,
    machine_info,
    now_iso,
    paired_log_ratio,
    read_record,
)


def windows_of(record: dict[str, Any]) -> dict[str, Any]:
    """Which windows a record scored: the sample's ids and the test's size, or the first n."""
    ev = record["eval"]
    sample = ev.get("window_sample")
    return {
        "dataset": ev["dataset"],
        "seqlen": ev["seqlen"],
        # the model's shape: a run, an eval of its saved folder and a peer name it differently
        "model": [
            record["model"].get(k)
            for k in ("model_type", "num_hidden_layers", "hidden_size", "num_parameters")
        ],
        "ids": sample["ids"] if sample else list(range(ev["n_windows"])),
        "population": sample["of"] if sample else None,
    }


def peer_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A peer script's record as rows: its float model's (``fp``) when scored, and the
    quantized model's under the peer's name."""
    if "peer" not in record:
        raise TorqError("neither a torq run record nor a peer script's record")
    rows = []
    for method, key in (("fp", "fp"), (record["peer"], "quantized")):
        if key in record:
            rows.append(
                {
                    "method": method,
                    "ppl": record[key]["ppl"],
                    "details": {"perplexity": record[key]},
                }
            )
    return rows


def load_rows(paths: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every row with per-window NLLs, keyed ``stem:method``; all on the same windows."""
    rows: dict[str, dict[str, Any]] = {}
    windows = None
    for p in paths:
        record = read_record(Path(p))
        this = windows_of(record)
        if windows is not None and this != windows:
            raise TorqError(f"{p} scored other windows than {paths[0]}")
        windows = this
        for r in record.get("rows") or peer_rows(record):
            nll = ((r.get("details") or {}).get("perplexity") or {}).get("window_nll")
            if not nll:
                raise TorqError(f"{p}: row {r['method']} keeps no per-window NLL (rerun it)")
            rows[f"{Path(p).stem}:{r['method']}"] = {"ppl": r["ppl"], "nll": nll}
    assert windows is not None
    return rows, windows


def pick(rows: dict[str, dict[str, Any]], name: str) -> str:
    """The one key of ``rows`` that is ``name`` or ends with ``:name``."""
    found = [k for k in rows if k == name or k.endswith(f":{name}")]
    if len(found) != 1:
        raise TorqError(f"--reference {name!r} matches {len(found)} rows: {', '.join(found)}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--reference", default="fp", help="the row every other is divided by")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        rows, windows = load_rows(args.records)
        ref = pick(rows, args.reference)
    except TorqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seqlen, population = windows["seqlen"], windows["population"]
    n = len(rows[ref]["nll"])
    compared = []
    for key, row in rows.items():
        if key == ref:
            continue
        est = paired_log_ratio(rows[ref]["nll"], row["nll"], seqlen, population)
        compared.append({"row": key, "ppl": row["ppl"], **est.to_dict()})
    compared.sort(key=lambda c: c["ratio"])
    where = f"{n} windows drawn of {population}" if population else f"the first {n} windows"
    lines = [
        f"Against `{ref}` (PPL {rows[ref]['ppl']:.2f}), {where}; the whole test's ratio "
        "estimated window by window, 95 % interval.",
        "",
        "| row | PPL on these windows | ratio | 95 % interval |",
        "| --- | ---: | ---: | --- |",
    ]
    for c in compared:
        lines.append(
            f"| `{c['row']}` | {c['ppl']:.2f} | {c['ratio']:.3f} | {c['low']:.3f}–{c['high']:.3f} |"
        )
    record = {
        "kind": "torq.ppl_paired",
        "date": now_iso(),
        "command": command_line(),
        "records": args.records,
        "reference": ref,
        "windows": {"seqlen": seqlen, "n": n, "population": population},
        "rows": compared,
        "machine": machine_info(),
    }
    save(args.out, record, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
