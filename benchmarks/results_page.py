"""docs/results.md and docs/results-more.md, written from the records in ``docs/records/``:
every number on a page is read from its record, and each table lists its records with the
commands that made them.

The pages' tables are declared below (:data:`PAGES`): a row names, for each of its cells, the
record and the row in it. A test holds the committed pages to this script's output, so a
number cannot drift from its record. Every other measured row, with its story, is in the
research notes (``docs/research/``).

Usage: ``python -m benchmarks.results_page`` (writes the pages), or ``--check`` (exit status
1 when a committed page differs).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torq import read_record

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TASKS = ("arc_challenge", "arc_easy", "hellaswag", "lambada_openai", "piqa", "winogrande")
TASK_NAMES = ("ARC-C", "ARC-E", "HellaSwag", "LAMBADA", "PIQA", "WinoGrande")


class Records:
    """The records a page reads, each read once, in the order the page first names them."""

    def __init__(self) -> None:
        self._read: dict[str, dict[str, Any]] = {}

    def __call__(self, path: str) -> dict[str, Any]:
        if path not in self._read:
            self._read[path] = read_record(DOCS / "records" / path)
        return self._read[path]

    def named(self, paths: list[str]) -> list[str]:
        return list(dict.fromkeys(paths))


# ---------------------------------------------------------------------------------------
# Cells: each reads one number (or a few) from a record and formats it.


@dataclass(frozen=True)
class Ppl:
    """A perplexity: the row ``method`` of a ``torq run`` record, or a peer's record
    (``method=None``: its quantized model), with ×FP against ``fp`` (``record:method``)."""

    record: str
    method: str | None = None
    fp: str | None = None
    bold: bool = False

    def value(self, records: Records) -> float:
        return ppl_of(records(self.record), self.method)

    def render(self, records: Records) -> str:
        text = f"{self.value(records):.2f}"
        if self.fp is not None:
            path, _, method = self.fp.partition(":")
            ratio = self.value(records) / ppl_of(records(path), method or None)
            text = f"{text} ({ratio:.2f})"
        return f"**{text}**" if self.bold else text

    def paths(self) -> list[str]:
        return [self.record] + ([self.fp.partition(":")[0]] if self.fp else [])


@dataclass(frozen=True)
class Estimate:
    """The whole test's ×FP estimated from a sample of its windows, with its 95 % interval:
    the row ``row`` of a ``benchmarks.ppl_paired`` record."""

    record: str
    row: str
    bold: bool = False

    def render(self, records: Records) -> str:
        (found,) = [r for r in records(self.record)["rows"] if r["row"] == self.row]
        ratio = f"**{found['ratio']:.3f}**" if self.bold else f"{found['ratio']:.3f}"
        return f"{ratio} ({found['low']:.3f}–{found['high']:.3f})"

    def paths(self) -> list[str]:
        return [self.record]


@dataclass(frozen=True)
class ZeroShotGap:
    """FP's six-task average less a row's, in points: paired question by question (a
    ``benchmarks.zeroshot_paired`` record's pair ``fp:method``, ± its standard error), or
    over every question of a ``torq run`` record's rows, not paired (``paired=False``)."""

    record: str
    method: str
    paired: bool = True

    def render(self, records: Records) -> str:
        record = records(self.record)
        if self.paired:
            (pair,) = [p for p in record["pairs"] if (p["a"], p["b"]) == ("fp", self.method)]
            average = pair["average"]
            return f"{100 * average['diff']:.1f} ± {100 * average['stderr']:.1f}"
        rows = {r["method"]: r for r in record["rows"]}
        gap = rows["fp"]["zeroshot"]["average"] - rows[self.method]["zeroshot"]["average"]
        return f"{100 * gap:.1f}⁺"

    def paths(self) -> list[str]:
        return [self.record]


@dataclass(frozen=True)
class Spread:
    """Two calibration seeds' spread: the larger perplexity over the smaller, less one."""

    a: Ppl
    b: Ppl

    def render(self, records: Records) -> str:
        x, y = self.a.value(records), self.b.value(records)
        return f"{100 * (max(x, y) / min(x, y) - 1):.1f} %"

    def paths(self) -> list[str]:
        return []


@dataclass(frozen=True)
class Field:
    """Any number of a record, found by ``find`` and formatted by ``fmt``."""

    record: str
    find: Callable[[dict[str, Any]], float]
    fmt: str = "{:.2f}"

    def render(self, records: Records) -> str:
        return self.fmt.format(self.find(records(self.record)))

    def paths(self) -> list[str]:
        return [self.record]


@dataclass(frozen=True)
class Ratio:
    """One perplexity over another (``b`` over ``a``), as a ratio and a change in percent."""

    a: Ppl
    b: Ppl

    def render(self, records: Records) -> str:
        ratio = self.b.value(records) / self.a.value(records)
        return f"{ratio:.3f} ({100 * (ratio - 1):+.1f} %)"

    def paths(self) -> list[str]:
        return []


Cell = Ppl | Estimate | ZeroShotGap | Spread | Ratio | Field | str


def ppl_of(record: dict[str, Any], method: str | None) -> float:
    """A perplexity of a record: a ``torq run`` row, a peer's quantized model, or (``fp``)
    a peer's float model."""
    if "rows" in record:
        (row,) = [r for r in record["rows"] if r["method"] == method]
        return float(row["ppl"])
    return float(record["fp" if method == "fp" else "quantized"]["ppl"])


# ---------------------------------------------------------------------------------------
# Tables and the page.


@dataclass(frozen=True)
class Table:
    """A heading, the text before the table, its columns and rows, the text after it."""

    heading: str
    before: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    after: str = ""
    align: tuple[str, ...] = field(default=())

    def render(self, records: Records) -> list[str]:
        align = self.align or ("---",) + ("---:",) * (len(self.columns) - 1)
        lines = [f"## {self.heading}", "", *_paragraph(self.before), ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("| " + " | ".join(align) + " |")
        for row in self.rows:
            cells = [c if isinstance(c, str) else c.render(records) for c in row]
            lines.append("| " + " | ".join(cells) + " |")
        if self.after:
            lines += ["", *_paragraph(self.after)]
        paths = [p for row in self.rows for c in row if not isinstance(c, str) for p in _paths(c)]
        lines += ["", "Records (in `docs/records/`) and the commands that made them:", ""]
        lines += [_source(path, records(path)) for path in records.named(paths)]
        return [*lines, ""]


def _paths(cell: Cell) -> list[str]:
    if isinstance(cell, Spread | Ratio):
        return cell.a.paths() + cell.b.paths()
    return cell.paths()  # type: ignore[union-attr]


def _paragraph(text: str) -> list[str]:
    """``text`` (paragraphs separated by blank lines) wrapped at 92 characters."""
    import textwrap

    out: list[str] = []
    for para in text.strip().split("\n\n"):
        out += textwrap.wrap(" ".join(para.split()), 92, break_on_hyphens=False)
        out.append("")
    return out[:-1]


_SCRIPTS = {p.name: p for p in (ROOT / "benchmarks").rglob("*.py")}
# Options renamed since a record was made, by their present names (the page's commands run)
RENAMED = {"--torq-unrotated": "--unrotated"}


def command_of(record: dict[str, Any]) -> str:
    """The record's command as a reader runs it: a benchmark script as ``python -m``, the
    command line's ``python -m torq.cli`` as ``torq``, an option renamed since by its
    present name (:data:`RENAMED`), without ``--out`` and ``--no-progress`` (where it wrote
    and whether it drew bars)."""
    words = record["command"].split()
    if words[:3] == ["python", "-m", "torq.cli"] or words[0].endswith("/python"):
        words = ["torq", *words[3:]] if words[1:3] == ["-m", "torq.cli"] else words
    elif words[0] in _SCRIPTS:
        module = _SCRIPTS[words[0]].relative_to(ROOT).with_suffix("")
        words = ["python", "-m", ".".join(module.parts), *words[1:]]
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif word != "--no-progress" and not word.startswith("--out="):
            kept.append(RENAMED.get(word, word))
    return " ".join(kept)


def _source(path: str, record: dict[str, Any]) -> str:
    machine = (record.get("machine") or {}).get("cpu") or "CPU"
    machine = re.sub(r"\(R\)| Processor", "", machine).strip()
    date = str(record.get("date") or record.get("created") or "")[:10]
    when = ", ".join(x for x in (machine, date) if x)
    return f"- `{path}`: `{command_of(record)}` ({when})"


# ---------------------------------------------------------------------------------------
# The page.

S = "recipes/smollm2-16w.json"  # SmolLM2's FP on the first 16 windows
Q = "recipes/qwen-16w.json"  # Qwen's
Z = "zeroshot/smollm2.json"  # SmolLM2's full test and every question of the six tasks
ZP = "zeroshot/smollm2-recipes-subset200-paired.json"
QS = "recipes/qwen-sample32-paired.json"
P = "comparison/peers/"


def _smol(record: str, method: str | None = None, bold: bool = False) -> Ppl:
    return Ppl(record, method, fp=f"{S}:fp", bold=bold)


def _smol_full(record: str, method: str | None = None, bold: bool = False) -> Ppl:
    return Ppl(record, method, fp=f"{Z}:fp", bold=bold)


def _qwen(record: str, method: str | None = None, bold: bool = False) -> Ppl:
    return Ppl(record, method, fp=f"{Q}:fp", bold=bold)


def _seeds(a: Ppl, b: Ppl) -> tuple[Cell, Cell, Cell]:
    return a, b, Spread(a, b)


SMOLLM2 = Table(
    "SmolLM2-135M",
    """PPL on WikiText-2's test (×FP in brackets): the first 16 windows with two calibration
    seeds (`--calib-seed 0` and `1`; the spread is the larger over the smaller, less one),
    and the full test (147 windows). Calibration on 32 windows. "Zero-shot" is FP's average
    over the six tasks less the row's, in points: paired question by question on a seeded
    subset of 200 questions per task, ± its standard error, or ⁺ over every question, not
    paired. Rows marked "peer" were made by that project's own code
    (`benchmarks/peers/`).""",
    ("row", "16 windows, seed 0", "seed 1", "spread", "full test", "zero-shot"),
    (
        ("FP", Ppl(S, "fp"), "", "", Ppl(Z, "fp"), "0"),
        (
            "`default` (`torq-had32+gptaq`, folded, `nearest`)",
            *_seeds(
                _smol("recipes/smollm2-gptaq-16w.json", "torq-had32+gptaq", True),
                _smol("recipes/smollm2-default-seed1-16w.json", "torq-had32+gptaq"),
            ),
            _smol_full("recipes/smollm2-default-gptaq-full.json", "torq-had32+gptaq", True),
            ZeroShotGap(ZP, "torq-had32+gptaq"),
        ),
        (
            "`best-ppl` (`torq+gptaq`, `nearest`)",
            *_seeds(
                _smol("recipes/smollm2-torq-gptaq-16w.json", "torq+gptaq", True),
                _smol("recipes/smollm2-seed1-16w.json", "torq+gptaq", True),
            ),
            _smol_full("recipes/smollm2-torq-gptaq-full-zs.json", "torq+gptaq", True),
            ZeroShotGap(ZP, "torq+gptaq"),
        ),
        (
            "WUSH with GPTQ, torq's (`wush+gptq`, `nearest`)",
            *_seeds(
                _smol("recipes/smollm2-wush-16w.json", "wush+gptq"),
                _smol("recipes/smollm2-seed1-16w.json", "wush+gptq"),
            ),
            _smol_full("recipes/smollm2-wush-gptq-full-zs.json", "wush+gptq"),
            ZeroShotGap(ZP, "wush+gptq"),
        ),
        (
            "WUSH from its own code, its GPTQ (peer)",
            *_seeds(
                _smol(P + "wush-gptq-smollm2-16w.json"),
                _smol(P + "wush-gptq-seed1-smollm2-16w.json"),
            ),
            _smol_full(P + "wush-gptq-smollm2-full.json"),
            ZeroShotGap(ZP, "wush-code-gptq"),
        ),
        (
            "`torq+gptq` (`ocp`)",
            *_seeds(
                _smol("method-value/smollm2-gptq-rows-16w.json", "torq+gptq"),
                _smol("method-value/smollm2-gptq-rows-seed1-16w.json", "torq+gptq"),
            ),
            _smol_full(Z, "torq+gptq"),
            ZeroShotGap(Z, "torq+gptq", paired=False),
        ),
        (
            "`torq-had32+gptq` (folded, `nearest`)",
            *_seeds(
                _smol(S, "torq-had32+gptq"),
                _smol("recipes/smollm2-had32-gptq-folded-seed1-16w.json", "torq-had32+gptq"),
            ),
            _smol_full("recipes/smollm2-default-full.json", "torq-had32+gptq"),
            "—",
        ),
        (
            "`had32+gptaq` (`nearest`, no balancing)",
            *_seeds(
                _smol("recipes/smollm2-had32-gptaq-16w.json", "had32+gptaq"),
                _smol("recipes/smollm2-had32-gptaq-seed1-16w.json", "had32+gptaq"),
            ),
            "—",
            "—",
        ),
        (
            "torq's WUSH, RTN weights (`wush`, `nearest`)",
            *_seeds(
                _smol("recipes/smollm2-wush-16w.json", "wush"),
                _smol("recipes/smollm2-wush-had32gptq-seed1-16w.json", "wush"),
            ),
            "—",
            "—",
        ),
        (
            "MR-GPTQ, built in torq (`mr-gptq`)",
            *_seeds(
                _smol("method-value/smollm2-gptq-rows-16w.json", "mr-gptq"),
                _smol("method-value/smollm2-gptq-rows-seed1-16w.json", "mr-gptq"),
            ),
            "—",
            "—",
        ),
        (
            "`had32+gptq` (`ocp`)",
            *_seeds(
                _smol("method-value/smollm2-gptq-rows-16w.json", "had32+gptq"),
                _smol("method-value/smollm2-gptq-rows-seed1-16w.json", "had32+gptq"),
            ),
            "—",
            "—",
        ),
        (
            "`had32+gptq` (`nearest`)",
            *_seeds(
                _smol("recipes/smollm2-wush-16w.json", "had32+gptq"),
                _smol("recipes/smollm2-wush-had32gptq-seed1-16w.json", "had32+gptq"),
            ),
            "—",
            "—",
        ),
        (
            "WUSH from its own code, RTN weights (peer)",
            *_seeds(
                _smol(P + "wush-rtn-smollm2-16w.json"),
                _smol(P + "wush-rtn-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "Brevitas: Qronos after its QuaRot rotations (peer, `ocp`)",
            *_seeds(
                _smol(P + "brevitas-qronos-smollm2-16w.json"),
                _smol(P + "brevitas-qronos-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "FlatQuant, learned transforms, RTN (peer, `nearest`; 1.7 % of its paper's training)",
            *_seeds(
                _smol(P + "flatquant-nearest-smollm2-16w.json"),
                _smol(P + "flatquant-nearest-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "Brevitas: GPTQ after its QuaRot rotations (peer, `ocp`)",
            *_seeds(
                _smol(P + "brevitas-gptq-smollm2-16w.json"),
                _smol(P + "brevitas-gptq-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "SpinQuant, learned rotations, its GPTQ (peer, `nearest`; 12.5 % of its window-steps)",
            *_seeds(
                _smol(P + "spinquant-gptq-nearest-smollm2-16w.json"),
                _smol(P + "spinquant-gptq-nearest-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "SpinQuant, the same, RTN weights (peer)",
            *_seeds(
                _smol(P + "spinquant-nearest-smollm2-16w.json"),
                _smol(P + "spinquant-nearest-seed1-smollm2-16w.json"),
            ),
            "—",
            "—",
        ),
        (
            "`fast` (`had32`; `nearest`, the full test `ocp`)",
            _smol(S, "had32"),
            "",
            "",
            _smol_full(Z, "had32"),
            ZeroShotGap(Z, "had32", paired=False),
        ),
        (
            "`rtn` (`nearest`, the full test `ocp`)",
            _smol(S, "rtn"),
            "",
            "",
            _smol_full(Z, "rtn"),
            ZeroShotGap(Z, "rtn", paired=False),
        ),
        (
            "AMD Quark, QuaRot's rotations, RTN (peer, `ocp`)",
            _smol(P + "quark-floor-smollm2-16w.json"),
            "",
            "",
            "—",
            "—",
        ),
        (
            "Brevitas, its QuaRot rotations, RTN (peer, `ocp`)",
            _smol(P + "brevitas-rtn-smollm2-16w.json"),
            "",
            "",
            "—",
            "—",
        ),
    ),
    """— not measured. Every peer is behind the `default`; only `best-ppl` (TORQ's
    calibrated rotations, which no engine serves) is lower.""",
    align=("---", "---:", "---:", "---:", "---:", "---:"),
)

QWEN = Table(
    "Qwen2.5-Coder-0.5B",
    """PPL on WikiText-2's first 16 windows (×FP in brackets) with two calibration seeds,
    and the whole test's ×FP estimated from 32 of its 145 windows drawn at random
    (`--window-sample 32`), with its 95 % interval (a full-test row costs about three
    core-hours here). Calibration on 16 windows. Every linear is rotated (`torq quantize
    --rotate-biased`); as `torq quantize` writes Qwen2 by default (its q/k/v, which have
    biases, unrotated, so that vLLM loads the folder) see the two "as served" rows.""",
    ("row", "16 windows, seed 0", "seed 1", "spread", "whole test ×FP, estimated"),
    (
        ("FP", Ppl(Q, "fp"), "", "", "1"),
        (
            "`default` (`torq-had32+gptaq`, folded, `nearest`)",
            *_seeds(
                _qwen(Q, "torq-had32+gptaq", True),
                _qwen("recipes/qwen-default-seed1-16w.json", "torq-had32+gptaq"),
            ),
            Estimate(QS, "qwen-default-sample32:torq-had32+gptaq", True),
        ),
        (
            "the `default` as served (q/k/v unrotated)",
            _qwen("recipes/qwen-default-unrotated-qkv-16w.json", "torq-had32+gptaq"),
            "",
            "",
            "—",
        ),
        (
            "`had32+gptaq` (`nearest`, no balancing)",
            *_seeds(
                _qwen("recipes/qwen-had32-gptaq-16w.json", "had32+gptaq", True),
                _qwen("recipes/qwen-had32-gptaq-seed1-16w.json", "had32+gptaq", True),
            ),
            Estimate(QS, "qwen-had32-gptaq-sample32:had32+gptaq", True),
        ),
        (
            "`had32+gptq` (`nearest`)",
            *_seeds(
                _qwen("recipes/qwen-had32-gptq-16w.json", "had32+gptq"),
                _qwen("recipes/qwen-had32-gptq-seed1-16w.json", "had32+gptq"),
            ),
            Estimate(QS, "qwen-had32-gptq-sample32:had32+gptq", True),
        ),
        (
            "`best-ppl` (`torq+gptaq`, `nearest`; estimate: seed 1)",
            *_seeds(
                _qwen("recipes/qwen-torq-gptaq-16w.json", "torq+gptaq"),
                _qwen("recipes/qwen-torq-gptaq-seed1-16w.json", "torq+gptaq"),
            ),
            Estimate(QS, "qwen-torq-gptaq-seed1-sample32:torq+gptaq"),
        ),
        (
            "`torq-had32+gptq` (folded, `nearest`)",
            *_seeds(
                _qwen("recipes/qwen-torq-had32-gptq-16w.json", "torq-had32+gptq"),
                _qwen("recipes/qwen-torq-had32-gptq-seed1-16w.json", "torq-had32+gptq"),
            ),
            Estimate(QS, "qwen-torq-had32-gptq-sample32:torq-had32+gptq"),
        ),
        (
            "WUSH from its own code, its GPTQ (peer)",
            *_seeds(
                _qwen(P + "wush-gptq-qwen-16w.json"),
                _qwen(P + "wush-gptq-qwen-seed1-16w.json"),
            ),
            Estimate(QS, "wush-gptq-qwen-sample32:wush"),
        ),
        (
            "MR-GPTQ, built in torq (`mr-gptq`; estimate: seed 1)",
            *_seeds(
                _qwen("recipes/qwen-mr-gptq-16w.json", "mr-gptq"),
                _qwen("recipes/qwen-mr-gptq-seed1-16w.json", "mr-gptq"),
            ),
            Estimate(QS, "qwen-mr-gptq-seed1-sample32:mr-gptq"),
        ),
        (
            "torq's WUSH with GPTQ (`wush+gptq`, `nearest`)",
            *_seeds(
                _qwen("recipes/qwen-wush-gptq-16w.json", "wush+gptq"),
                _qwen("recipes/qwen-wush-gptq-seed1-16w.json", "wush+gptq", True),
            ),
            Estimate(QS, "qwen-wush-gptq-sample32:wush+gptq"),
        ),
        (
            "torq's WUSH, RTN weights (`wush`, `nearest`)",
            *_seeds(
                _qwen("recipes/qwen-wush-rtn-16w.json", "wush"),
                _qwen("recipes/qwen-wush-rtn-seed1-16w.json", "wush"),
            ),
            "—",
        ),
        (
            "WUSH from its own code, RTN weights (peer)",
            *_seeds(
                _qwen(P + "wush-rtn-qwen-16w.json"),
                _qwen(P + "wush-rtn-qwen-seed1-16w.json"),
            ),
            "—",
        ),
        (
            "`fast` (`had32`, `nearest`)",
            _qwen(Q, "had32"),
            "",
            "",
            Estimate(QS, "qwen-had32-sample32:had32"),
        ),
        (
            "`fast` as served (q/k/v unrotated)",
            _qwen("recipes/qwen-fast-unrotated-qkv-16w.json", "had32"),
            "",
            "",
            "—",
        ),
        (
            "`rtn` (`nearest`)",
            _qwen("recipes/qwen-rtn-16w.json", "rtn"),
            "",
            "",
            Estimate(QS, "qwen-rtn-sample32:rtn"),
        ),
        (
            "AMD Quark, QuaRot's R1 and R2, RTN (peer)",
            _qwen(P + "quark-r1r2-qwen-16w.json"),
            "",
            "",
            "—",
        ),
        (
            "llm-compressor, SpinQuant's rotations, RTN (peer)",
            _qwen(P + "llmcompressor-qwen-16w.json"),
            "",
            "",
            "—",
        ),
        (
            "Brevitas, its QuaRot rotations, RTN (peer, `ocp`)",
            _qwen(P + "brevitas-rtn-qwen-16w.json"),
            "",
            "",
            "—",
        ),
    ),
    """— not measured. On Qwen's whole test the `default` is level with the plain 32-block
    Hadamard with GPTQ or GPTAQ (no balancing), and ahead of every peer.""",
)


def _task(record: str, method: str, task: str) -> Field:
    def find(r: dict[str, Any]) -> float:
        (row,) = [x for x in r["rows"] if x["method"] == method]
        return 100 * row["zeroshot"]["tasks"][task]["value"]

    return Field(record, find, "{:.1f}")


def _average(record: str, method: str) -> Field:
    def find(r: dict[str, Any]) -> float:
        (row,) = [x for x in r["rows"] if x["method"] == method]
        return 100 * row["zeroshot"]["average"]

    return Field(record, find, "{:.1f}")


def _zeroshot_row(method: str) -> tuple[Cell, ...]:
    return (
        f"`{method}`" if method != "fp" else "FP",
        _smol_full(Z, method) if method != "fp" else Ppl(Z, "fp"),
        *(_task(Z, method, t) for t in TASKS),
        _average(Z, method),
    )


ZEROSHOT = Table(
    "SmolLM2-135M: the paper's methods on the full test and the six tasks",
    """Perplexity on the full test (×FP in brackets) and the six zero-shot tasks of the
    paper through lm-evaluation-harness (0-shot, every question, `acc_norm` where defined),
    `ocp` scales, calibration on 32 windows.""",
    ("method", "PPL", *TASK_NAMES, "average"),
    tuple(
        _zeroshot_row(m)
        for m in (
            "fp",
            "torq+gptq",
            "torq",
            "torq-had32",
            "torq-intra",
            "torq-inter",
            "had32",
            "had128",
            "hadfull",
            "gptq",
            "rtn",
            "quarot",
        )
    ),
)


def _pair_cell(method: str, task: str | None) -> Field:
    def find(r: dict[str, Any]) -> float:
        (pair,) = [p for p in r["pairs"] if (p["a"], p["b"]) == ("fp", method)]
        return 100 * (pair["average"] if task is None else pair["tasks"][task])["diff"]

    return Field(ZP, find, "{:+.1f}")


def _pair_error(method: str, task: str | None) -> Field:
    def find(r: dict[str, Any]) -> float:
        (pair,) = [p for p in r["pairs"] if (p["a"], p["b"]) == ("fp", method)]
        return 100 * (pair["average"] if task is None else pair["tasks"][task])["stderr"]

    return Field(ZP, find, "± {:.1f}")


PAIRED = Table(
    "SmolLM2-135M: the recipes on the six tasks, question by question",
    """200 questions of each task drawn at random (seed 0, the same for every row), each
    row's answers compared with FP's on the same questions: FP less the row, points, and
    the paired standard error below each. WUSH's own code: its calibration seed 1.""",
    ("FP − row", *TASK_NAMES, "average"),
    tuple(
        row
        for label, method in (
            ("`default`", "torq-had32+gptaq"),
            ("`best-ppl`", "torq+gptaq"),
            ("`wush+gptq`", "wush+gptq"),
            ("WUSH's own code, GPTQ (peer)", "wush-code-gptq"),
        )
        for row in (
            (label, *(_pair_cell(method, t) for t in (*TASKS, None))),
            ("", *(_pair_error(method, t) for t in (*TASKS, None))),
        )
    ),
)


def _export(record: str, method: str, key: str) -> Field:
    def find(r: dict[str, Any]) -> float:
        (row,) = [x for x in r["rows"] if x["method"] == method]
        return row[key]

    return Field(record, find, "{:.3f}")


def _export_gap(record: str, method: str) -> Field:
    def find(r: dict[str, Any]) -> float:
        (row,) = [x for x in r["rows"] if x["method"] == method]
        return 100 * abs(row["transformers"] / row["torq_nearest"] - 1)

    return Field(record, find, "{:.2f} %")


N = "nvfp4/"
NS = N + "smollm2-default-16w.json"  # SmolLM2's FP and the default with standard scales
NQ = N + "qwen-default-8w.json"  # Qwen's FP and its default, first 8 windows
NR = N + "smollm2-rows-16w.json"  # RTN and GPTQ


def _nv_smol(record: str, method: str | None = None, bold: bool = False) -> Ppl:
    return Ppl(record, method, fp=f"{NS}:fp", bold=bold)


def _nv_qwen(record: str, method: str | None = None, bold: bool = False) -> Ppl:
    return Ppl(record, method, fp=f"{NQ}:fp", bold=bold)


NVFP4 = Table(
    "NVFP4 W4A4",
    """NVFP4 weights and activations (blocks of 16, E4M3 block scales, an FP32 tensor
    scale), the activations' tensor scale calibrated once on the calibration windows (what
    compressed-tensors and vLLM serve: `--act-scale static`). PPL (×FP): SmolLM2-135M on the
    first 16 windows, calibrated on 32; Qwen2.5-Coder-0.5B on its first 8, calibrated on 8
    (its q/k/v unrotated, as served). In NVFP4 the recipes round the weights with Four Over
    Six (each block's scale maps its largest value onto 6 or onto 4, whichever rounds the
    block closer; the result is standard NVFP4, `--scale-mode 4over6-weights`). Not
    measured: the seeds, SmolLM2's full test, Qwen's RTN, GPTQ and `fast` rows and its
    32-window sample, llm-compressor's SpinQuant transforms with GPTQ.""",
    ("row", "SmolLM2-135M, 16 windows", "Qwen2.5-Coder-0.5B, 8 windows", "servable"),
    (
        ("FP", Ppl(NS, "fp"), Ppl(NQ, "fp"), ""),
        (
            "`default` (`torq-had32+gptaq`, folded, Four Over Six weights)",
            _nv_smol(N + "smollm2-default-46w-16w.json", "torq-had32+gptaq", bold=True),
            _nv_qwen(NQ, "torq-had32+gptaq"),
            "yes",
        ),
        ("the `default`, standard scales", _nv_smol(NS, "torq-had32+gptaq"), "", "yes"),
        (
            "`fast` (RTN, Four Over Six weights)",
            _nv_smol(N + "smollm2-fast-46w-16w.json", "rtn"),
            "",
            "yes",
        ),
        ("`rtn`", _nv_smol(NR, "rtn"), "", "yes"),
        ("`gptq`", _nv_smol(NR, "gptq"), "", "yes"),
        (
            "`mr-gptq` (16-block Hadamards, MSE scales)",
            _nv_smol(N + "smollm2-mrgptq-16w.json", "mr-gptq"),
            "",
            "yes",
        ),
        (
            "the `default` with act-order (`--act-order`)",
            _nv_smol(N + "smollm2-default-actorder-16w.json", "torq-had32+gptaq"),
            "",
            "yes",
        ),
        (
            "the `default`, q/k/v rotated too (vLLM: with torq's plugin)",
            "",
            _nv_qwen(N + "qwen-default-rotated-8w.json", "torq-had32+gptaq"),
            "yes",
        ),
        (
            "the `default` with the rotation check (`--rotation-check 0.25`)",
            _nv_smol(N + "smollm2-default-rotcheck-16w.json", "torq-had32+gptaq"),
            _nv_qwen(N + "qwen-default-rotcheck-8w.json", "torq-had32+gptaq"),
            "yes",
        ),
        (
            "`gptaq` (no transform, Four Over Six weights)",
            "",
            _nv_qwen(N + "qwen-gptaq-8w.json", "gptaq"),
            "yes",
        ),
        (
            "`gptaq` with act-order (`--act-order`)",
            "",
            _nv_qwen(N + "qwen-gptaq-actorder-8w.json", "gptaq"),
            "yes",
        ),
        (
            "the `default` with 16-block Hadamards, every linear rotated",
            "",
            _nv_qwen(N + "qwen-bal16-gptaq-8w.json", "torq-had32+gptaq"),
            "no",
        ),
        (
            "llm-compressor, its NVFP4 GPTQ (peer)",
            _nv_smol(P + "llmc-nvfp4-gptq-smollm2-16w.json"),
            _nv_qwen(P + "llmc-nvfp4-gptq-qwen-8w.json"),
            "yes",
        ),
        (
            "llm-compressor, QuIP's 16-block Hadamards and its NVFP4 GPTQ (peer)",
            _nv_smol(P + "llmc-nvfp4-quip-gptq-smollm2-16w.json"),
            _nv_qwen(P + "llmc-nvfp4-quip-gptq-qwen-8w.json", bold=True),
            "yes",
        ),
    ),
    after="""On SmolLM2 the `default` is 15.9 % under llm-compressor's NVFP4 GPTQ (19.2 % under
    its QuIP with GPTQ); on Qwen it is 2.6 % over the latter, llm-compressor's best there
    (2.1 % with q/k/v rotated too); the other rows tried on Qwen are 1.3–2.7 % behind it,
    and act-order costs on both models.""",
    align=("---", "---:", "---:", "---"),
)

SERVED = Table(
    "Served through transformers",
    """A compressed-tensors folder loaded through transformers (bf16, its Hadamard
    re-attached) against torq's own model of the same settings, the same windows;
    calibration on 8 windows. [serving.md](serving.md) has vLLM.""",
    ("model", "torq", "transformers", "gap", "windows"),
    (
        (
            "`torq-had32`, folded",
            _export("export/smollm2-ct-full-h200.json", "torq-had32", "torq_nearest"),
            _export("export/smollm2-ct-full-h200.json", "torq-had32", "transformers"),
            _export_gap("export/smollm2-ct-full-h200.json", "torq-had32"),
            "full test, an H200",
        ),
        (
            "`had32`",
            _export("export/smollm2-ct-full-h200.json", "had32", "torq_nearest"),
            _export("export/smollm2-ct-full-h200.json", "had32", "transformers"),
            _export_gap("export/smollm2-ct-full-h200.json", "had32"),
            "full test, an H200",
        ),
        (
            "`torq-had32`, folded",
            _export("export/smollm2-ct-40w.json", "torq-had32", "torq_nearest"),
            _export("export/smollm2-ct-40w.json", "torq-had32", "transformers"),
            _export_gap("export/smollm2-ct-40w.json", "torq-had32"),
            "40, CPU",
        ),
    ),
)


M = "moe/"
MF = M + "moe-smollm2-e8-default-served-2w.json"  # FP and the default as served, in torq
MS = M + "moe-smollm2-e8-served-split-2w.json"  # the experts' activations in 4 bits or float


def _moe(record: str, method: str = "torq-had32+gptaq") -> Ppl:
    return Ppl(record, method, fp=f"{MF}:fp")


def _moe_served(key: str) -> Field:
    """A row of ``benchmarks.moe_served``'s record, with its ×FP."""

    def find(r: dict[str, Any]) -> Any:
        return f"{r['ppl'][key]:.2f} ({r['ppl'][key] / r['ppl']['fp']:.2f})"

    return Field(MS, find, "{}")


def _dense(row: str, method: str) -> Ppl:
    return Ppl(f"{M}dense-smollm2-{row}-2w.json", method, fp=f"{MF}:fp")


def _experts(row: str, method: str) -> Ppl:
    return Ppl(f"{M}moe-smollm2-e8-{row}-2w.json", method, fp=f"{MF}:fp")


K6 = M + "moe-smollm2-e8-k6-rows-2w.json"  # the sparse variant's FP, RTN, GPTQ and fast


def _sparse(record: str, method: str) -> Ppl:
    return Ppl(record, method, fp=f"{K6}:fp")


MOE = Table(
    "Mixture of experts",
    """SmolLM2-135M made a Mixtral of 8 experts (`benchmarks/moe_from_dense.py`): every token
    routed to all, whose FP is the dense model's (exact), or to the top 6 by a router fitted
    on calibration tokens, the neurons grouped into experts by co-activation (sparse; a
    gated MLP is not sparse, so its FP is 1.9× the dense model's). PPL (×the column's FP)
    on the first 2 windows, calibration on 4 (cut for machine time); the `default` with its
    `nearest` scale rule, the other rows with `torq run`'s `ocp`. torq's own format runs
    every transform, inside the experts too. In a compressed-tensors folder the experts'
    inputs are balanced but not rotated: neither transformers nor vLLM runs an online
    transform inside the experts. transformers runs the experts' activations in bf16.""",
    ("row", "dense", "MoE, exact", "MoE, sparse", "computed by"),
    (
        ("FP", Ppl(MF, "fp"), Ppl(MF, "fp"), Ppl(K6, "fp"), "torq"),
        ("RTN", _dense("rtn", "rtn"), _experts("rtn", "rtn"), _sparse(K6, "rtn"), "torq"),
        (
            "GPTQ, no transform",
            _dense("gptq", "gptq"),
            _experts("gptq", "gptq"),
            _sparse(K6, "gptq"),
            "torq",
        ),
        (
            "`fast` (`had32`)",
            _dense("fast", "had32"),
            _experts("fast", "had32"),
            _sparse(K6, "had32"),
            "torq",
        ),
        (
            "QuaRot",
            _dense("quarot", "quarot"),
            "refused: its residual rotation does not pass a MoE block",
            "—",
            "torq",
        ),
        ("`paper` (`torq`)", _dense("paper", "torq"), _experts("paper", "torq"), "—", "torq"),
        (
            "the `default`, torq's format",
            _moe(M + "dense-smollm2-default-2w.json"),
            _moe(M + "moe-smollm2-e8-default-2w.json"),
            _sparse(M + "moe-smollm2-e8-k6-default-2w.json", "torq-had32+gptaq"),
            "torq",
        ),
        (
            "the `default` as served: experts unrotated, their activations in MXFP4",
            "—",
            _moe(MF),
            _sparse(M + "moe-smollm2-e8-k6-served-2w.json", "torq-had32+gptaq"),
            "torq (an FP4 engine would)",
        ),
        (
            "the same, the experts' activations in float",
            "—",
            _moe_served("experts_float"),
            "—",
            "torq",
        ),
        (
            "the compressed-tensors folder of the same settings",
            "—",
            _moe(M + "moe-smollm2-e8-served-transformers-2w.json"),
            "—",
            "transformers (bf16)",
        ),
    ),
    after="""On the exact variant RTN and the fixed Hadamard give the dense model's perplexity
    exactly: the experts are slices of its MLP and their blocks fall where the dense
    model's do. GPTQ gains less on the experts than on the dense MLP (89.05 against 75.33):
    in part because each expert's GPTQ spreads its rounding errors over its own 192 inputs
    only (`benchmarks/diagnostics/gptq_split.py`). The `default` loses nothing against the
    dense model (−0.2 %) in torq's format; served unrotated with 4-bit activations the
    experts lose 19 %. Through transformers the folder is 0.03 % from torq's model with the
    experts' activations in float, which is what transformers computes. vLLM 0.32's CPU
    build reads the folder but runs MXFP4 experts only through its GPU kernel (Marlin); not
    measured on a GPU. — not measured.""",
    align=("---", "---:", "---:", "---:", "---"),
)


def _peak(record: str) -> Field:
    def find(r: dict[str, Any]) -> float:
        row = r["rows"][0]
        rss = row.get("peak_rss_bytes") or r.get("peak_memory", {}).get("host_rss_bytes")
        return rss / 2**30

    return Field(record, find, "{:.2f} GiB")


MEMORY = Table(
    "Memory",
    """Every run streams the checkpoint one decoder layer at a time
    ([large-models.md](large-models.md)); the peak resident set of the whole run. The larger
    shapes have random weights (their perplexities mean nothing).""",
    ("what", "peak resident set"),
    (
        (
            "SmolLM2-135M, `fp,rtn,had32+gptq` on 16 windows",
            _peak("one-path/smollm2-16w-streamed.json"),
        ),
        ("a 0.47B Llama shape, `rtn`, 8 windows", _peak("scale/llama-0.4b-rtn-no-flags.json")),
        (
            "Llama-3-8B's shape, `torq` through all 32 layers, 8 calibration windows",
            _peak("scale/8b-torq.json"),
        ),
        ("Llama-3-70B's widths, 2 layers, `rtn`, streamed and saved", _peak("scale/70b-2l.json")),
    ),
)

C = "calibration/"
ZC = C + "smollm2-chat-zs-paired.json"
_WIKI_S = _smol("recipes/smollm2-gptaq-16w.json", "torq-had32+gptaq")
_WIKI_Q = _qwen(Q, "torq-had32+gptaq")

CALIBRATION = Table(
    "Calibration data: WikiText or chats",
    """The `default` calibrated on WikiText-2's validation text (as in the tables above), on
    chats rendered with each model's own template (GSM8K's training problems and HumanEval's
    problems as user and assistant turns, three windows of GSM8K to one of HumanEval:
    `python -m benchmarks.chat_data`), or on half of each. PPL on WikiText-2's first 16
    windows (×FP), its ratio to the WikiText row (the `default`'s calibration seeds spread
    is in the tables above), and FP's six-task average less the row's on the 200-question
    subset, paired. Both are instruct models; on them WikiText is the better calibration:
    the chats cost perplexity and zero-shot accuracy alike.""",
    ("model", "calibration data", "PPL, 16 windows", "against WikiText's", "zero-shot"),
    (
        (
            "SmolLM2-135M",
            "WikiText-2, 32 windows",
            _WIKI_S,
            "1",
            ZeroShotGap(ZC, "torq-had32+gptaq@265af40f35"),
        ),
        (
            "SmolLM2-135M",
            "chats, 24 + 8 windows",
            _smol(C + "smollm2-default-chat-16w.json", "torq-had32+gptaq"),
            Ratio(_WIKI_S, _smol(C + "smollm2-default-chat-16w.json", "torq-had32+gptaq")),
            ZeroShotGap(ZC, "torq-had32+gptaq@8fb23576f2"),
        ),
        (
            "SmolLM2-135M",
            "WikiText-2 16 + chats 12 + 4",
            _smol(C + "smollm2-default-mix-16w.json", "torq-had32+gptaq"),
            Ratio(_WIKI_S, _smol(C + "smollm2-default-mix-16w.json", "torq-had32+gptaq")),
            "—",
        ),
        ("Qwen2.5-Coder-0.5B", "WikiText-2, 16 windows", _WIKI_Q, "1", "—"),
        (
            "Qwen2.5-Coder-0.5B",
            "chats, 12 + 4 windows",
            _qwen(C + "qwen-default-chat-16w.json", "torq-had32+gptaq"),
            Ratio(_WIKI_Q, _qwen(C + "qwen-default-chat-16w.json", "torq-had32+gptaq")),
            "—",
        ),
    ),
    align=("---", "---", "---:", "---:", "---:"),
)

B = "budget/"
_B425 = _smol(B + "smollm2-b425-16w.json", "torq-had32+gptaq")


def _reached(record: str) -> Field:
    """The average stored bits per weight a budgeted row reached."""

    def find(r: dict[str, Any]) -> float:
        return float(r["rows"][-1]["details"]["precision_budget"]["reached_bits"])

    return Field(record, find, "{:.2f}")


def _budget_row(label: str, by: str, stem: str) -> tuple[Cell, ...]:
    row = _smol(B + f"smollm2-{stem}-16w.json", "torq-had32+gptaq")
    return (label, by, _reached(B + f"smollm2-{stem}-16w.json"), row, Ratio(_B425, row))


QB = B + "qwen-sample32-paired.json"  # each Qwen row's whole-test ×FP, estimated
QBD = B + "qwen-sample32-vs-default.json"  # Qwen's budgeted row against all MXFP4
BUDGET = Table(
    "A precision budget",
    """The `default` with `--avg-bits`: the input groups (q/k/v, o, gate/up, down) that hurt
    most kept in MXFP8 W8A8, the rest in MXFP4; the average stored bits per weight of the
    decoder layers' linears. Chosen by `block`, the rise in the layer's output error with
    the group alone quantized (the default); `linear`, the group's own error; `random`; the
    `ends`, the first and last layers. Calibrated on 16 windows. SmolLM2-135M: PPL on the
    first 16 windows (×FP). Qwen2.5-Coder-0.5B: the whole test's ×FP estimated from 32 random
    windows, 95 % interval. 1.10× FP takes 6 bits on SmolLM2, 5 on Qwen. Not measured:
    SmolLM2's full test, the rest of Qwen's curve (1.5 and 2 core-hours a run).""",
    ("model", "bits asked", "chosen by", "bits reached", "PPL (×FP)", "against all MXFP4"),
    (
        ("SmolLM2-135M", "4.25", "—", "4.25", _B425, "1"),
        ("SmolLM2-135M", *_budget_row("4.5", "`block`", "b45-block")),
        ("SmolLM2-135M", *_budget_row("5", "`block`", "b5-block")),
        ("SmolLM2-135M", *_budget_row("5", "`linear`", "b5-linear")),
        ("SmolLM2-135M", *_budget_row("5", "`random`", "b5-random")),
        ("SmolLM2-135M", *_budget_row("5", "`ends`", "b5-ends")),
        ("SmolLM2-135M", *_budget_row("6", "`block`", "b6-block")),
        (
            "Qwen2.5-Coder-0.5B",
            "4.25",
            "—",
            "4.25",
            Estimate(QB, "qwen-default-sample32:torq-had32+gptaq"),
            "1",
        ),
        (
            "Qwen2.5-Coder-0.5B",
            "5",
            "`block`",
            _reached(B + "qwen-b5-block-sample32.json"),
            Estimate(QB, "qwen-b5-block-sample32:torq-had32+gptaq"),
            Estimate(QBD, "qwen-b5-block-sample32:torq-had32+gptaq"),
        ),
    ),
    align=("---", "---:", "---", "---:", "---:", "---:"),
)

INTRO = """All rows are MXFP4 W4A4 (weights and activations) but the NVFP4 table's,
perplexity on WikiText-2's test text in windows of 2048 tokens, measured on 2-core CPU
machines (an AMD EPYC or an Intel Xeon VM, 23.5 GiB, no GPU; each record names which)
unless a row says otherwise. The same
command gives the same numbers bit for bit on one machine; another CPU kind moves a W4A4
row by 0.2–0.6 %. FP is the embedded GGUF files' weights, dequantized (SmolLM2-135M's
Q4_1, Qwen2.5-Coder-0.5B's Q5_0 and Q6_K).

This page is written from the records by `python -m benchmarks.results_page`: each number
is read from the record listed under its table. The [research notes](research/README.md)
hold how each row was reached, every other row measured (the [rows in
detail](research/rows.md)), and the attempts that did not pay; [more
results](results-more.md) the zero-shot tasks, calibration data and the precision budget."""

MORE_INTRO = """More results, written from the records as [the results page](results.md) is:
the paper's methods on the six zero-shot tasks, the recipes question by question, the
calibration data and the precision budget. The same machines and windows as there."""

# each page, its heading's text and its tables
PAGES: dict[str, tuple[str, str, tuple[Table, ...]]] = {
    "results.md": ("Results", INTRO, (SMOLLM2, QWEN, NVFP4, MOE, SERVED, MEMORY)),
    "results-more.md": ("More results", MORE_INTRO, (ZEROSHOT, PAIRED, CALIBRATION, BUDGET)),
}


def render(page: str = "results.md") -> str:
    """A whole page."""
    heading, intro, tables = PAGES[page]
    records = Records()
    lines = [f"# {heading}", "", *_paragraph(intro), ""]
    for table in tables:
        lines += table.render(records)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    differ = []
    for name in PAGES:
        page, path = render(name), DOCS / name
        if args.check:
            if not path.exists() or path.read_text() != page:
                differ.append(name)
            continue
        path.write_text(page)
        print(f"wrote {path.relative_to(ROOT)} ({page.count(chr(10))} lines)")
    if args.check:
        print(f"docs/{', docs/'.join(differ)} differ" if differ else "the pages are the records'")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
