"""docs/results.md and results-more.md are the pages ``benchmarks.results_page`` writes from
the records: every number on them is read from a record beside it."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import results_page

ROOT = Path(__file__).resolve().parents[1]


def test_the_results_pages_are_the_ones_the_records_give() -> None:
    for name in results_page.PAGES:
        page = results_page.render(name)
        assert (ROOT / "docs" / name).read_text() == page, (
            f"docs/{name} differs from its records: python -m benchmarks.results_page"
        )
        assert page.count("\n") <= 300


def test_a_number_on_the_page_follows_its_record() -> None:
    """A cell reads its record, not a copy: the `default`'s SmolLM2 row is the record's
    perplexity to two decimals, with its ratio to the record's FP row."""
    records = results_page.Records()
    record = records("recipes/smollm2-gptaq-16w.json")
    (row,) = [r for r in record["rows"] if r["method"] == "torq-had32+gptaq"]
    fp = next(r for r in records("recipes/smollm2-16w.json")["rows"] if r["method"] == "fp")
    cell = results_page.Ppl(
        "recipes/smollm2-gptaq-16w.json", "torq-had32+gptaq", fp="recipes/smollm2-16w.json:fp"
    )
    assert cell.render(records) == f"{row['ppl']:.2f} ({row['ppl'] / fp['ppl']:.2f})"
    row["ppl"] = 99.0  # the page is re-read from what the record says
    assert cell.render(records).startswith("99.00 (")


def test_a_record_command_reads_as_a_reader_runs_it() -> None:
    record = {"command": "wush_mxfp4.py --model m --out /tmp/x.json --no-progress --gptq"}
    assert results_page.command_of(record) == (
        "python -m benchmarks.peers.wush_mxfp4 --model m --gptq"
    )


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"\d+\.\d+", text))


def test_every_number_of_the_readme_results_is_on_the_results_page() -> None:
    """The README's results table and its notes quote the results page (itself read from
    the records); the one number they derive, the mean of torq's WUSH + GPTQ over three
    calibration seeds on Qwen, is derived here from its three records."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Results", 1)[1].split("\nIn MXFP4, run from their own code", 1)[0]
    records = results_page.Records()
    seeds = [
        results_page.ppl_of(records(f"recipes/qwen-wush-gptq{s}-16w.json"), "wush+gptq")
        for s in ("", "-seed1", "-seed2")
    ]
    fp = results_page.ppl_of(records("recipes/qwen-16w.json"), "fp")
    derived = {f"{sum(seeds) / 3:.2f}", f"{sum(seeds) / 3 / fp:.2f}"}
    page = _numbers("".join((ROOT / "docs" / n).read_text() for n in results_page.PAGES))
    quoted = _numbers(section)
    assert len(quoted) > 30
    assert sorted(quoted - page - derived - {"1.00"}) == []
