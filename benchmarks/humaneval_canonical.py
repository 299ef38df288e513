"""HumanEval's own solutions through torq's sandbox: pass@1 must be 100 %, the check that
the scorer (:mod:`torq.eval.humaneval`) and the isolation (:mod:`torq.eval.sandbox`) run
every problem's program as lm-eval's scorer would.

    python -m benchmarks.humaneval_canonical --out results/humaneval/canonical.json

Writes JSON (per problem: passed, seconds) and a markdown line (``<out>.md``).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import save
from torq.experimental import command_line, load_humaneval, machine_info, now_iso, score


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    problems = load_humaneval(args.data_dir)
    t0 = time.perf_counter()
    result = score(problems, {p.task_id: [p.canonical_solution] for p in problems})
    seconds = time.perf_counter() - t0
    failed = [t for t, r in result["tasks"].items() if r["passed"] == 0]
    record = {
        **result,
        "failed": failed,
        "seconds": seconds,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    line = (
        f"HumanEval canonical solutions through the sandbox: pass@1 {100 * result['pass@1']:.1f} % "
        f"of {result['problems']} problems ({len(failed)} failed), {seconds:.0f} s"
    )
    save(args.out, record, line)


if __name__ == "__main__":
    main()
