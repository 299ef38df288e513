"""What the peer-library scripts share: arguments, model and window loading, evaluation, JSON.

Every peer script quantizes the same float model that ``torq.models.load`` returns and then
scores the peer's fake-quantized model with torq's own WikiText-2 perplexity
(``torq.eval``), so its number sits beside ``torq run`` numbers measured the same way.

``--model tiny-llama`` (and ``tiny-smollm2-shape``) builds a small randomly initialised
Llama instead, with random token windows: a smoke test of the peer's API on this machine
that downloads nothing and takes seconds. Its perplexity means nothing beyond "finite".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torq.experimental import (
    command_line,
    load_wikitext2_test,
    machine_info,
    now_iso,
    perplexity,
    sample_windows,
    versions,
    windows_from_text,
    write_json_atomic,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Random-weight Llama shapes for smoke tests (vocabulary 384, embeddings tied like SmolLM2).
TINY_MODELS: dict[str, dict[str, int]] = {
    "tiny-llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # SmolLM2-135M's widths (hidden 576, MLP 1536, head_dim 64, 9 / 3 heads), two layers:
    # checks that a peer's rotations accept the real model's non-power-of-two sizes.
    "tiny-smollm2-shape": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
}
TINY_VOCAB = 384


@dataclass
class Subject:
    """The float model a peer quantizes, with its evaluation windows."""

    model: nn.Module
    windows: torch.Tensor
    describe: dict[str, Any]
    tiny: bool
    tokenizer: Any = None
    # which of the test's windows a seeded sample took (torq run's ``eval.window_sample``)
    window_sample: dict[str, Any] | None = None


def add_common_args(parser: argparse.ArgumentParser, peer: str) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="anything torq.models.load accepts, or a smoke-test model: "
        + ", ".join(sorted(TINY_MODELS)),
    )
    parser.add_argument(
        "--max-windows",
        type=int,
        default=None,
        help="evaluate the first N WikiText-2 windows (0: the full test; default 16)",
    )
    parser.add_argument(
        "--window-sample",
        type=int,
        default=None,
        metavar="N",
        help="evaluate a seeded random sample of N of the whole test's windows, as torq run "
        "--window-sample draws them (pairs with its rows in benchmarks/ppl_paired.py)",
    )
    parser.add_argument("--window-sample-seed", type=int, default=0)
    parser.add_argument("--seqlen", type=int, default=2048, help="perplexity window length")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="data directory laid out like ../shared/data (default: $TORQ_DATA_DIR, "
        "else ../shared/data beside the repository when it exists)",
    )
    parser.add_argument(
        "--out", default=None, help=f"result JSON (default results/peers/{peer}-<model>.json)"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device for quantization and evaluation",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed for random rotations")
    parser.add_argument(
        "--with-fp",
        action="store_true",
        help="also evaluate the float model on the same windows before quantizing",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def resolve_data_dir(arg: str | None) -> str | None:
    if arg is not None:
        return arg
    if os.environ.get("TORQ_DATA_DIR"):
        return os.environ["TORQ_DATA_DIR"]
    beside = REPO_ROOT.parent / "shared" / "data"
    return str(beside) if beside.is_dir() else None


def _tiny_model(name: str) -> nn.Module:
    """A random Llama saved to a temporary folder, so ``config.name_or_path`` can be reloaded
    (llm-compressor's ``oneshot`` re-reads the config from there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **TINY_MODELS[name],
    )
    model = LlamaForCausalLM(config).eval()
    folder = tempfile.mkdtemp(prefix=f"{name}-")
    model.save_pretrained(folder)
    model.config.name_or_path = folder
    return model


def eval_windows(
    args: argparse.Namespace, text: str, tokenizer: Any
) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """The WikiText-2 windows a peer is scored on: the first ``--max-windows`` (16 unless
    given; 0 the full test), or ``--window-sample`` windows drawn from the whole test with
    torq's :func:`~torq.eval.perplexity.sample_windows`, so that the rows pair with a
    ``torq run --window-sample`` record window by window."""
    if args.window_sample is None:
        limit = 16 if args.max_windows is None else args.max_windows
        return windows_from_text(text, tokenizer, args.seqlen, limit or None), None
    if args.max_windows is not None:
        raise SystemExit("--window-sample draws from the whole test: drop --max-windows")
    if args.window_sample < 2:
        raise SystemExit(f"--window-sample needs at least 2 windows: {args.window_sample}")
    windows = windows_from_text(text, tokenizer, args.seqlen, None)
    total = int(windows.shape[0])
    windows, ids = sample_windows(windows, args.window_sample, args.window_sample_seed)
    return windows, {"n": len(ids), "seed": args.window_sample_seed, "of": total, "ids": ids}


def load_subject(args: argparse.Namespace) -> Subject:
    """The float model and its windows (WikiText-2 test, or random ids for a tiny model)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.model in TINY_MODELS:
        model = _tiny_model(args.model)
        gen = torch.Generator().manual_seed(args.seed)
        if args.window_sample is not None:
            raise SystemExit("--window-sample needs a real model's test, not random windows")
        n_windows = args.max_windows or 16  # a random model has no test to run in full
        windows = torch.randint(0, TINY_VOCAB, (n_windows, args.seqlen), generator=gen)
        describe = {
            "source": f"random init ({args.model})",
            "model_type": "llama",
            **TINY_MODELS[args.model],
            "vocab_size": TINY_VOCAB,
            "num_parameters": sum(p.numel() for p in model.parameters()),
        }
        return Subject(model.to(args.device), windows, describe, tiny=True)
    from torq.experimental import load

    lm = load(args.model)
    text = load_wikitext2_test(resolve_data_dir(args.data_dir))
    windows, sample = eval_windows(args, text, lm.tokenizer)
    return Subject(
        lm.model.to(args.device),
        windows,
        lm.describe(),
        tiny=False,
        tokenizer=lm.tokenizer,
        window_sample=sample,
    )


def calibration_tokens(args: argparse.Namespace, subject: Subject) -> torch.Tensor:
    """torq's calibration windows (``torq.calibration.data.calibration_windows``:
    ``--calib-samples`` × ``--calib-seqlen`` tokens of ``--calib-corpus``, seed
    ``--calib-seed``) for a real model; seeded random ids for a tiny one."""
    if subject.tiny:
        gen = torch.Generator().manual_seed(args.calib_seed + 1)
        vocab = subject.describe["vocab_size"]
        return torch.randint(0, vocab, (args.calib_samples, args.calib_seqlen), generator=gen)
    from torq.experimental import CalibrationConfig, calibration_windows

    config = CalibrationConfig(
        corpus=args.calib_corpus,
        n_samples=args.calib_samples,
        seqlen=args.calib_seqlen,
        seed=args.calib_seed,
    )
    return calibration_windows(subject.tokenizer, config, resolve_data_dir(args.data_dir))


def evaluate(model: nn.Module, windows: torch.Tensor, desc: str, progress: bool) -> dict:
    """torq's perplexity, plus whether the logits of the first window are all finite."""
    with torch.no_grad():
        first = windows[:1].to(next(model.parameters()).device)
        finite = bool(torch.isfinite(model(input_ids=first, use_cache=False).logits).all())
    result = perplexity(model, windows, progress=progress, desc=desc).to_dict()
    result["first_window_logits_finite"] = finite
    return result


def first_window_nll(model: nn.Module, windows: torch.Tensor) -> float:
    """Mean token NLL on the first window: a cheap check that a rotation alone (quantization
    switched off) leaves the float model's function unchanged."""
    return perplexity(model, windows[:1], progress=False).mean_nll


def start(
    args: argparse.Namespace, check_rotation: bool
) -> tuple[Subject, dict[str, Any], float | None]:
    """Load the subject; the record with the FP row when ``--with-fp``; and the float
    first-window NLL for :func:`rotation_check` when ``check_rotation``."""
    subject = load_subject(args)
    record: dict[str, Any] = {}
    if args.with_fp:
        record["fp"] = evaluate(subject.model, subject.windows, "fp", not args.no_progress)
    nll = first_window_nll(subject.model, subject.windows) if check_rotation else None
    return subject, record, nll


@contextmanager
def timed() -> Any:
    box: dict[str, float] = {}
    start = time.perf_counter()
    try:
        yield box
    finally:
        box["seconds"] = time.perf_counter() - start


def package_versions(*names: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def default_out(peer: str, model: str) -> Path:
    slug = Path(model).name.replace(".gguf", "").replace("/", "_") or "model"
    return REPO_ROOT / "results" / "peers" / f"{peer}-{slug}.json"


def save_record(
    args: argparse.Namespace,
    peer: str,
    subject: Subject,
    record: dict[str, Any],
    label: str = "W4A4",
) -> Path:
    """Write the result JSON with the command, versions, machine and model, and print it."""
    payload = {
        "peer": peer,
        "created": now_iso(),
        "command": command_line(),
        "args": vars(args),
        "model": {"name": args.model, **subject.describe},
        "eval": {
            "dataset": "random token ids" if subject.tiny else "wikitext-2-raw test",
            "seqlen": args.seqlen,
            "n_windows": int(subject.windows.shape[0]),
            "window_sample": subject.window_sample,
            "harness": "torq.eval.perplexity",
        },
        **record,
        "versions": versions(),
        "machine": machine_info(),
    }
    out = Path(args.out) if args.out else default_out(peer, args.model)
    write_json_atomic(out, payload)
    ppl = record.get("quantized", {}).get("ppl", float("nan"))
    fp = record.get("fp", {}).get("ppl")
    fp_text = f"  FP {fp:.3f}" if fp is not None else ""
    quant_s = record.get("quantize_seconds", float("nan"))
    print(f"{peer} on {args.model}: {label} PPL {ppl:.3f}{fp_text}  (quantize {quant_s:.1f} s)")
    print(f"wrote {out}")
    return out


def rotation_check(nll_float: float, nll_rotated: float) -> dict[str, float | bool]:
    return {
        "first_window_nll_float": nll_float,
        "first_window_nll_rotated_unquantized": nll_rotated,
        "abs_diff": abs(nll_rotated - nll_float),
        "equivalent": math.isclose(nll_rotated, nll_float, rel_tol=1e-4, abs_tol=1e-4),
    }


def add_prepare_args(parser: argparse.ArgumentParser, peer: str) -> None:
    """The arguments of a two-step peer's ``prepare`` step (:func:`write_windows`)."""
    add_common_args(parser, peer)
    parser.add_argument("--calib-corpus", default="wikitext2-valid")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seqlen", type=int, default=2048)
    parser.add_argument("--calib-seed", type=int, default=0)


def write_windows(args: argparse.Namespace, script: str) -> int:
    """torq's float model folder, evaluation windows and calibration windows, in one file:
    the ``prepare`` step of a peer whose own environment cannot hold torq's."""
    if args.out is None:
        raise SystemExit(f"{script} prepare: --out is required (the file `run` reads)")
    if args.model in TINY_MODELS:
        raise SystemExit(f"{script} prepare: a random smoke-test model has no folder")
    subject = load_subject(args)
    calib = calibration_tokens(args, subject)
    payload = {
        "model": args.model,
        "model_folder": str(subject.describe["path"]),
        "describe": subject.describe,
        "windows": subject.windows.clone(),
        "max_windows": args.max_windows,
        "seqlen": args.seqlen,
        "calib": calib.clone(),
        "calibration": {
            "corpus": args.calib_corpus,
            "n_samples": args.calib_samples,
            "seqlen": args.calib_seqlen,
            "seed": args.calib_seed,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(out)
    shapes = f"{tuple(subject.windows.shape)} evaluation, {tuple(calib.shape)} calibration"
    print(f"wrote {out}: {shapes}")
    return 0


def mxfp4_ste(x: torch.Tensor, fmt: Any) -> torch.Tensor:
    """MXFP4 quantize-dequantize along the last dim with the straight-through gradient that
    the peers' integer quantizers use (FlatQuant's ``round_ste``, SpinQuant's
    ``STEQuantize``): forward the quantized value, backward the identity."""
    from torq.experimental import fake_quantize

    return x + (fake_quantize(x, fmt) - x).detach()


def legacy_llama_config(folder: str | Path) -> Any:
    """torq's float folder's Llama config as an older transformers (4.4x) reads it, with the
    RoPE base carried over from the newer ``rope_parameters`` into ``rope_theta`` (without
    it, 4.45 would use 10000 where SmolLM2 has 100000)."""
    import json

    import transformers

    raw = json.loads((Path(folder) / "config.json").read_text())
    config = transformers.LlamaConfig.from_pretrained(str(folder))
    rope = raw.get("rope_parameters")
    if rope is not None:
        if rope.get("rope_type", "default") != "default":
            kind = rope["rope_type"]
            raise SystemExit(f"peer_common: RoPE type {kind!r} is not carried over")
        config.rope_theta = float(rope["rope_theta"])
    return config


def two_step_parser(
    doc: str, peer: str, run_help: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line of a two-step peer: ``prepare`` (:func:`write_windows`) and ``run``,
    which reads the file ``prepare`` wrote; the caller adds the peer's own ``run`` options."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="step", required=True)
    add_prepare_args(
        sub.add_parser("prepare", help="torq's environment: model folder, windows"), peer
    )
    go = sub.add_parser("run", help=run_help)
    go.add_argument("--windows", type=Path, required=True, help="the file `prepare` wrote")
    go.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--no-progress", action="store_true", help="hide progress bars")
    go.add_argument("--out", required=True, help="the result JSON")
    return parser, go


def save_run_record(
    args: argparse.Namespace,
    peer: str,
    data: dict[str, Any],
    record: dict[str, Any],
    versions: dict[str, str | None],
    **extra: Any,
) -> None:
    """A two-step peer's ``run`` record: what it ran, on which model and windows, with what."""
    payload = {
        "peer": peer,
        "created": now_iso(),
        "command": command_line(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {"name": data["model"], **data["describe"]},
        "eval": {
            "dataset": "wikitext-2-raw test",
            "seqlen": data["seqlen"],
            "n_windows": int(data["windows"].shape[0]),
            "harness": "torq.eval.perplexity",
        },
        **record,
        "versions": versions,
        **extra,
        "machine": machine_info(),
    }
    write_json_atomic(Path(args.out), payload)


class _Checkout(importlib.abc.MetaPathFinder):
    """Finds the top-level packages and modules of a peer's source checkout after every
    other finder: an installed library is never shadowed by the checkout, and the checkout
    is never put on the import path."""

    def __init__(self, repo: Path) -> None:
        self.repo = str(repo)

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None:  # a submodule: found on its package's own path
            return None
        return importlib.machinery.PathFinder.find_spec(name, [self.repo])


def import_from_checkout(repo: Path, *names: str) -> list[Any]:
    """The modules ``names`` of a peer's source checkout ``repo`` (its own imports of its
    other top-level packages are found there too); refused in one line when an installed
    module of the same name is found instead."""
    if not any(isinstance(f, _Checkout) and f.repo == str(repo) for f in sys.meta_path):
        sys.meta_path.append(_Checkout(repo))
    modules = [importlib.import_module(n) for n in names]
    for m in modules:
        where = Path(getattr(m, "__file__", "") or "").resolve()
        if not where.is_relative_to(repo.resolve()):
            raise SystemExit(f"error: imported {m.__name__} from {where}, not from {repo}")
    return modules
