"""HumanEval pass@1, or GSM8K exact match, of quantized models (the paper's Table 4): each
method quantizes the model (W4A4 MXFP4 unless told), lm-eval generates greedy completions
offline, and each HumanEval program runs isolated (:mod:`torq.eval.sandbox`).

    python -m benchmarks.humaneval --model qwen2.5-coder-0.5b \\
        --methods fp,rtn,had32,torq-had32,torq --out results/humaneval/qwen-coder.json
    python -m benchmarks.humaneval --task gsm8k --n 200 --methods fp,torq-had32 \\
        --out results/gsm8k/qwen-coder-200.json

GSM8K (``--task gsm8k``): lm-eval's 5-shot task on ``--n`` test problems drawn with
``--seed`` (:func:`torq.eval.generation.evaluate_gsm8k`; the same problems for every method),
strict and flexible exact match, each with its standard error.

The record is rewritten after each method, and a method already in ``--out`` is not run
again (a stopped run goes on with the next method). Generation is slow on a CPU (up to
1024 new tokens for each of 164 problems): ``--limit N`` takes the first N problems. With
``--resume-dir DIR`` each method's quantized model is kept in ``DIR`` once it is made, and
each answer as it is generated, so a run stopped in the middle of a method goes on where it
stopped (the same command again: no calibration, only the answers not yet generated;
:mod:`torq.runs.kept` checks that the directory holds this model). ``--problems 120-163``
asks only those problems.
Writes JSON and a markdown table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import save
from torq.experimental import (
    MAX_GEN_TOKS,
    PROMPTS,
    CalibrationConfig,
    CaptureSettings,
    FolderStore,
    QuantConfig,
    RunKey,
    TorqError,
    TorqSettings,
    apply_method,
    check_problem_count,
    check_problem_indices,
    check_prompt,
    command_line,
    evaluate_gsm8k,
    evaluate_humaneval,
    fingerprint_ids,
    get_method,
    gsm8k_test_size,
    keep_model,
    load,
    load_humaneval,
    load_kept_model,
    machine_info,
    method_rng,
    method_spec,
    now_iso,
    read_record,
    record_setting,
    sessions_seconds,
)


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default="fp,rtn,had32,torq-had32,torq")
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument(
        "--calib-corpus",
        default="wikitext2-valid",
        help="calibration corpus (as 'torq run --calib-corpus'; the paper's Table 5)",
    )
    ap.add_argument(
        "--calib-seed",
        type=int,
        default=0,
        help="seed of the calibration windows, each group's token sample and the solver's "
        "draws (as 'torq run --calib-seed'): a second seed of the same row",
    )
    ap.add_argument("--task", choices=("humaneval", "gsm8k"), default="humaneval")
    ap.add_argument(
        "--prompt",
        choices=PROMPTS,
        default="completion",
        help="HumanEval: the prompt continued as plain text (lm-eval's humaneval), or put "
        "in the model's chat template (its humaneval_instruct, as instruct models are "
        "reported)",
    )
    ap.add_argument("--limit", type=int, default=None, help="HumanEval: the first N problems")
    ap.add_argument(
        "--problems",
        type=parse_problems,
        default=None,
        metavar="SPEC",
        help="HumanEval: only these problems, by index (0..163), as '120-163' or '3,7,10-12'",
    )
    ap.add_argument("--n", type=int, default=None, help="GSM8K: N problems drawn with --seed")
    ap.add_argument("--seed", type=int, default=0, help="GSM8K: which problems")
    ap.add_argument("--max-gen-toks", type=int, default=MAX_GEN_TOKS)
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="problems generated together (each answer stops at its own stop string; the "
        "answers may differ from one-at-a-time where two tokens are nearly tied: "
        "benchmarks/generation_batch.py measures both); not part of a row's identity",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--resume-dir",
        default=None,
        help="keep each method's quantized model and its answers here as they come; "
        "the same command again goes on where a stopped run stopped",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rows = read_record(out)["rows"] if out.is_file() else []
    done = {r["method"] for r in rows}
    if args.calib_seed < 0:
        ap.error(f"--calib-seed must be 0 or more, not {args.calib_seed}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be 1 or more, not {args.batch_size}")
    if args.task != "humaneval" and args.prompt != "completion":
        ap.error("--prompt applies to HumanEval only")
    check_arguments(args, ap)
    settings = torq_settings(args)
    todo = [m for m in args.methods.split(",") if m not in done]
    for method in todo:
        loaded = load(args.model)
        try:  # before any quantization
            check_prompt(loaded.tokenizer, args.prompt)
        except TorqError as exc:
            ap.error(f"--prompt {args.prompt}: {args.model}: {exc}")
        model, quantize_seconds = loaded.model, 0.0
        identity = _identity(args, method)
        resume = _row_path(args, method)
        if resume is not None:
            _check_batch_size(resume / "answers", args.batch_size, ap)  # before quantizing
        kept = None
        if resume is not None and method != "fp":
            kept = load_kept_model(resume, fingerprint_ids(loaded.tokenizer))
        if kept is not None:
            # the calibration ran in an earlier session; the row reports what it cost then
            model, info = kept
            quantize_seconds = float(info["quantize_seconds"])
        elif method != "fp":
            t0 = time.perf_counter()
            quantize(args, model, loaded.tokenizer, method, settings)
            quantize_seconds = time.perf_counter() - t0
            if resume is not None:
                keep_model(
                    resume,
                    model,
                    fingerprint_ids(loaded.tokenizer),
                    {"method": method, "identity": identity, "quantize_seconds": quantize_seconds},
                )
        cache = None if resume is None else resume / "answers"
        store = None
        if cache is not None:  # the answers' folder names the row
            record_setting(cache, identity)
            store = FolderStore(cache)
        if args.task == "gsm8k":
            result = evaluate_gsm8k(
                model,
                loaded.tokenizer,
                args.data_dir,
                args.n,
                args.seed,
                batch_size=args.batch_size,
                store=store,
            )
            result["batch_size"] = args.batch_size
            print(method, result["flexible-extract"], flush=True)
        else:
            result = evaluate_humaneval(
                model,
                loaded.tokenizer,
                args.data_dir,
                args.limit,
                args.max_gen_toks,
                store=store,
                prompt=args.prompt,
                batch_size=args.batch_size,
                problems=args.problems,
            )
            print(method, result["pass@1"], flush=True)
        rows.append({"method": method, "quantize_seconds": quantize_seconds, **result})
        record = {
            "task": args.task,
            "model": args.model,
            "format": args.format,
            "calib_samples": args.calib_samples,
            "calib_corpus": args.calib_corpus,
            "calib_seed": args.calib_seed,
            "prompt": args.prompt,
            "limit": args.limit,
            "problems": args.problems,
            "n": args.n,
            "seed": args.seed,
            "rows": rows,
            "command": command_line(),
            "date": now_iso(),
            "machine": machine_info(),
        }
        save(out, record, _table(args, rows))


def check_arguments(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Refuse, in one line and before any model is loaded, what would fail later or run
    something else than asked: an unknown method, an option of the other task, a problem
    count outside the data (lm-eval reads 0 or a count past the end as every problem)."""
    for method in args.methods.split(","):
        try:
            get_method(method)
        except TorqError as exc:
            ap.error(str(exc))
    if args.task == "gsm8k" and args.limit is not None:
        ap.error("--limit applies to HumanEval; GSM8K takes --n problems drawn with --seed")
    if args.task == "gsm8k" and args.problems is not None:
        ap.error("--problems applies to HumanEval; GSM8K takes --n problems drawn with --seed")
    if args.limit is not None and args.problems is not None:
        ap.error("give --limit or --problems, not both")
    if args.task == "humaneval" and args.n is not None:
        ap.error("--n applies to GSM8K; HumanEval takes its first --limit problems")
    try:
        if args.task == "gsm8k":
            check_problem_count(args.n, gsm8k_test_size(args.data_dir), "--n")
        elif args.limit is not None:
            check_problem_count(args.limit, len(load_humaneval(args.data_dir)), "--limit")
        elif args.problems is not None:
            check_problem_indices(args.problems, len(load_humaneval(args.data_dir)))
    except TorqError as exc:
        ap.error(str(exc))


def _row_path(args: argparse.Namespace, method: str) -> Path | None:
    """The method's resume directory (named by the hash of :func:`_identity`); ``None``
    where the run keeps none."""
    if args.resume_dir is None:
        return None
    digest = hashlib.sha1(_identity(args, method).encode()).hexdigest()[:10]
    return Path(args.resume_dir) / f"{args.task}-{method}-{digest}"


def _check_batch_size(cache: Path, batch_size: int, ap: argparse.ArgumentParser) -> None:
    """A row's answers come from one batch size: the batch changes W4A4 answers (RESULTS
    §12.1), so a row kept with another one is not continued with this one. Sessions from
    before the batch size was logged generated one problem at a time."""
    meta = cache / "meta.json"
    if meta.is_file():
        sessions = json.loads(meta.read_text()).get("sessions", [])
        _check_sessions(sessions, cache, "--resume-dir", batch_size, ap)


def _check_sessions(
    sessions: list[dict[str, Any]],
    where: Path,
    option: str,
    batch_size: int,
    ap: argparse.ArgumentParser,
) -> None:
    earlier = {int(s.get("batch_size", 1)) for s in sessions}
    if sessions and earlier != {batch_size}:
        sizes = ", ".join(str(b) for b in sorted(earlier))
        ap.error(
            f"{where} holds answers generated with --batch-size {sizes}; continue it with that "
            f"(or give another {option} for --batch-size {batch_size})"
        )


def quantize(
    args: argparse.Namespace,
    model: torch.nn.Module,
    tokenizer: Any,
    method: str,
    settings: TorqSettings | None = None,
) -> None:
    """Quantize ``model`` in place with ``method`` in ``args.format`` (weights and
    activations), calibrated as ``args`` says (:func:`torq_settings`)."""
    qconfig = QuantConfig.from_names(args.format, args.format)
    spec = method_spec(method, settings or torq_settings(args))
    ctx = spec.context(capture(args), tokenizer, progress=False, data_dir=args.data_dir)
    # a method's draws depend on its own quantization settings, never on what ran
    # before it nor on the task it is scored on
    with method_rng(0, _quantization_identity(args, method)):
        apply_method(spec.method, model, qconfig, ctx)


def capture(args: argparse.Namespace) -> CaptureSettings:
    """The calibration windows of the calibrated methods (and the seed of their draws)."""
    calibration = CalibrationConfig(
        n_samples=args.calib_samples, corpus=args.calib_corpus, seed=args.calib_seed
    )
    return CaptureSettings(calibration=calibration)


def torq_settings(args: argparse.Namespace) -> TorqSettings:
    """TORQ's settings with the seed of its draws (as ``torq run --calib-seed``: each
    group's token sample, the intra-block solver's)."""
    # torq's own intra-block defaults (the Hadamard start, every column a candidate) with the
    # seed replaced: a bare IntraBlockConfig is the paper's (identity start, K/2 candidates),
    # which the rows from 2026-11-26 14:44 to 2026-11-27 03:40 ran by mistake (RESULTS §12.1)
    intra = replace(TorqSettings().intra, seed=args.calib_seed)
    return TorqSettings(intra=intra)


def _quantization_identity(args: argparse.Namespace, method: str) -> str:
    """What makes one method's quantized model the same, whichever task scores it."""
    keys = ("model", "format", "calib_samples", "calib_corpus")
    identity = {"method": method, **{k: getattr(args, k) for k in keys}}
    if args.calib_seed != 0:  # left out at 0: the rows measured before the option draw as then
        identity["calib_seed"] = args.calib_seed
    return json.dumps(identity, sort_keys=True)


def _identity(args: argparse.Namespace, method: str) -> str:
    """What makes one method's quantized model and answers the same across sessions (the
    name of its resume directory)."""
    keys = ("task", "model", "format", "calib_samples", "max_gen_toks")
    identity = {"method": method, **{k: getattr(args, k) for k in keys}}
    if args.calib_corpus != "wikitext2-valid":  # the default is left out: the directories
        identity["calib_corpus"] = args.calib_corpus  # of runs before the option still match
    if args.calib_seed != 0:
        identity["calib_seed"] = args.calib_seed
    if args.prompt != "completion":
        identity["prompt"] = args.prompt
    recipe = get_method(method).transform.key_settings(
        RunKey(), asdict(torq_settings(args)), asdict(capture(args))
    )
    if recipe:  # what the transform reads (TORQ's settings): a model kept with other
        # settings is never reloaded for these; none for RTN and the fixed Hadamards,
        # whose directories keep their names
        identity["recipe"] = recipe
    return json.dumps(identity, sort_keys=True, default=str)


def _setting(args: argparse.Namespace, rows: list[dict]) -> str:
    """The quantization the rows share, for the table's title: the format only where a row
    quantizes, the calibration corpus and seed only where one calibrates (an FP-only record
    has neither)."""
    from torq.experimental import get_method

    methods = [get_method(r["method"]) for r in rows]
    if not any(m.quantizes for m in methods):
        return ", float weights and activations"
    text = f", W4A4 {args.format}"
    if any(m.calibrates() for m in methods):
        text += f", calibrated on {args.calib_corpus} (seed {args.calib_seed})"
    return text


def _row_seconds(row: dict[str, Any], key: str) -> float:
    """A row's generation time over every session that made its answers (a resumed row's
    ``key`` holds only the last session's)."""
    sessions = (row.get("request_cache") or {}).get("sessions")
    return sessions_seconds(sessions) if sessions else float(row[key])


def parse_problems(spec: str) -> list[int]:
    """``--problems``: indices and ranges, ``'3,7,10-12'`` → ``[3, 7, 10, 11, 12]``."""
    indices: list[int] = []
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if hi < lo:
                raise ValueError
            indices.extend(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{spec!r} is not a list of problem indices such as '3,7,10-12'"
        ) from None
    return indices


def _problem_count(args: argparse.Namespace) -> int:
    """How many HumanEval problems the run asks."""
    if args.problems is not None:
        return len(args.problems)
    return args.limit or 164


def _table(args: argparse.Namespace, rows: list[dict]) -> str:
    """The markdown table of the rows so far."""
    if args.task == "gsm8k":
        lines = [
            f"{args.model}, GSM8K ({rows[0]['n']} test problems, seed {args.seed}), 5-shot, "
            f"greedy, exact match{_setting(args, rows)}",
            "",
            "| method | strict % | flexible % | problems | s, all sessions |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            strict, flexible = r["strict-match"], r["flexible-extract"]
            lines.append(
                f"| {r['method']} | {100 * strict['exact_match']:.1f} ± "
                f"{100 * strict['stderr']:.1f} | {100 * flexible['exact_match']:.1f} ± "
                f"{100 * flexible['stderr']:.1f} | {r['n']} | {_row_seconds(r, 'seconds'):.0f} |"
            )
        return "\n".join(lines) + "\n"
    lines = [
        f"{args.model}, HumanEval ({_problem_count(args)} problems, {args.prompt} prompt), "
        f"greedy, pass@1{_setting(args, rows)}",
        "",
        "| method | pass@1 % | problems | generate s, all sessions |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {100 * r['pass@1']:.1f} | {r['problems']} "
            f"| {_row_seconds(r, 'generate_seconds'):.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except TorqError as exc:  # a model that cannot be loaded, data that is not there
        sys.exit(f"humaneval.py: error: {exc}")
