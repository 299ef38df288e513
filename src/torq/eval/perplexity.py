"""WikiText-2 perplexity as the paper's tables report it (method-notes §3).

The raw test split is tokenized once as one string and cut into non-overlapping windows of
``seqlen`` tokens (the tail that does not fill a window is dropped). Every window predicts
its tokens 1..L-1 from the preceding ones; PPL = exp(mean token NLL) over all windows.
Because every window has the same length, this equals exp of the mean of the model's own
``labels=`` loss over the windows.

A measurement too long for the whole test can take a seeded random sample of its windows
(:func:`sample_windows`): every row of a run scores the same windows, each window's NLL is
kept (:attr:`PerplexityResult.window_nll`), and :func:`paired_log_ratio` estimates the
whole test's PPL ratio of two rows from their per-window differences, with its error.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from torq.errors import TorqError
from torq.eval.store import EvalStore
from torq.models.fingerprint import check_fingerprint, logits_fingerprint
from torq.seeding import seeded_subset_ids


@dataclass
class PerplexityResult:
    """Perplexity with what it was measured on and how fast."""

    ppl: float
    mean_nll: float
    n_windows: int
    seqlen: int
    n_tokens: int
    seconds: float
    # each window's summed NLL of its tokens 1..L-1, in window order: two rows on the same
    # windows compare window by window (:func:`paired_log_ratio`)
    window_nll: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def windows_from_text(
    text: str, tokenizer: Any, seqlen: int = 2048, max_windows: int | None = None
) -> torch.Tensor:
    """Tokenize ``text`` once and cut it into ``[n_windows, seqlen]`` non-overlapping windows
    (the first ``max_windows`` of them when given)."""
    if seqlen < 2:
        raise TorqError(f"seqlen must be at least 2, got {seqlen}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = ids.numel() // seqlen
    if n == 0:
        raise TorqError(f"the text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    if max_windows is not None:
        if max_windows < 1:
            raise TorqError(f"max_windows must be positive, got {max_windows}")
        n = min(n, max_windows)
    return ids[: n * seqlen].view(n, seqlen)


def window_sample_ids(total: int, n: int, seed: int) -> list[int]:
    """The ``n`` windows of ``total`` drawn with ``seed`` (sorted; all when ``n ≥ total``):
    :func:`torq.seeding.seeded_subset_ids`, the zero-shot subsets' draw."""
    if n < 1:
        raise TorqError(f"a window sample needs at least one window, got {n}")
    return seeded_subset_ids(total, n, seed)


def sample_windows(windows: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """A seeded random sample of ``n`` of ``windows`` (:func:`window_sample_ids`) and the
    indices it took. Drawn at random, its mean NLL is an unbiased estimate of the whole
    test's, where the first ``n`` windows follow the text's order (one article after
    another)."""
    ids = window_sample_ids(int(windows.shape[0]), n, seed)
    return windows[ids], ids


@dataclass
class PairedRatio:
    """The whole test's ``PPL_b / PPL_a`` from a window sample (:func:`paired_log_ratio`)."""

    ratio: float  # exp of the mean per-token NLL difference on the sample
    low: float  # 95 % interval of the whole test's ratio
    high: float
    log_se: float  # standard error of ln(ratio)
    n_windows: int
    population: int | None  # the test's window count (finite-population correction)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_log_ratio(
    nll_a: list[float], nll_b: list[float], seqlen: int, population: int | None = None
) -> PairedRatio:
    """Estimate ``PPL_b / PPL_a`` over the whole test from two rows' per-window NLLs on the
    same window sample (window by window, so the windows' shared difficulty cancels).

    With windows of equal length, ``ln(PPL_b / PPL_a)`` over the whole test is the mean over
    its windows of ``d_i = (nll_b[i] − nll_a[i]) / (seqlen − 1)``; the sample's mean of
    ``d_i`` estimates it with standard error ``s_d / √n · √((N − n) / (N − 1))`` (``N``: the
    ``population`` of windows, sampled without replacement; no correction when ``None``),
    and the interval is ``exp(mean ± 1.96 se)`` (normal approximation)."""
    if len(nll_a) != len(nll_b):
        raise TorqError(f"the rows scored different windows ({len(nll_a)} and {len(nll_b)})")
    n = len(nll_a)
    if n < 2:
        raise TorqError(f"a paired estimate needs at least two windows, got {n}")
    d = torch.tensor(nll_b, dtype=torch.float64) - torch.tensor(nll_a, dtype=torch.float64)
    d = d / (seqlen - 1)
    mean = float(d.mean())
    se = float(d.std(unbiased=True)) / math.sqrt(n)
    if population is not None:
        if population < n:
            raise TorqError(f"a sample of {n} windows from a test of {population}")
        se *= math.sqrt((population - n) / (population - 1)) if population > 1 else 0.0
    return PairedRatio(
        ratio=math.exp(mean),
        low=math.exp(mean - 1.96 * se),
        high=math.exp(mean + 1.96 * se),
        log_se=se,
        n_windows=n,
        population=population,
    )


@torch.no_grad()
def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "perplexity",
    store: EvalStore | None = None,
    name: str = "perplexity",
) -> PerplexityResult:
    """Perplexity of a causal LM over token windows (method-notes §3).

    ``store`` keeps each window's NLL as it is measured, as its record ``name``
    (:class:`~torq.eval.store.EvalStore`); the same call again after a stop measures only
    the windows it lacks (same windows and same model, checked by hash and logits
    fingerprint). ``seconds`` then counts the time of every session that contributed.
    """
    if windows.dim() != 2:
        raise TorqError(f"windows must be [n_windows, seqlen], got shape {tuple(windows.shape)}")
    device = next(model.parameters()).device
    n, seqlen = windows.shape
    saved = _open_kept(store, name, model, windows) if store is not None else None
    done: dict[str, float] = saved["nll"] if saved else {}
    earlier_seconds = saved["seconds"] if saved else 0.0
    nll: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=n, desc=desc, unit="win", disable=not progress, leave=False)
    for i in range(0, n, batch_size):
        if all(str(j) in done for j in range(i, min(i + batch_size, n))):
            nll.extend(done[str(j)] for j in range(i, min(i + batch_size, n)))
            bar.update(min(batch_size, n - i))
            continue
        batch = windows[i : i + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits
        try:
            per_window = window_nll(logits, batch, first=i)
        except TorqError:
            bar.close()
            raise
        nll.extend(per_window)
        if saved is not None:
            done.update({str(i + b): v for b, v in enumerate(per_window)})
            saved["seconds"] = earlier_seconds + time.perf_counter() - start
            store.write(name, saved)  # type: ignore[union-attr]
        bar.update(batch.shape[0])
    bar.close()
    seconds = earlier_seconds + time.perf_counter() - start
    return perplexity_from_nll(nll, seqlen, seconds)


# token rows per log-softmax in :func:`window_nll`
NLL_CHUNK = 256


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's loss ``−log p(target)`` in float32 (``[batch, positions]``), from the
    logits at those positions; a few hundred rows at a time, since the log-softmax of a whole
    window is another copy of its logits (400 MB for 2048 tokens of a 49k vocabulary). Each
    token's loss is its own row's, so the losses are the same either way."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    return torch.cat(
        [
            F.cross_entropy(
                flat[i : i + NLL_CHUNK].float(),
                flat_targets[i : i + NLL_CHUNK],
                reduction="none",
            )
            for i in range(0, flat_targets.numel(), NLL_CHUNK)
        ]
    ).view(targets.shape)


def summed_nll(nll: torch.Tensor, first: int = 0) -> list[float]:
    """Each window's summed NLL (float64 sums of its float32 per-token losses ``nll``,
    ``[windows, positions]``); a non-finite loss is an error naming the batch's ``first``
    window."""
    if not torch.isfinite(nll).all():
        raise TorqError(f"non-finite loss in window {first}: the model produced NaN/Inf logits")
    return nll.double().sum(dim=1).tolist()


def window_nll(logits: torch.Tensor, batch: torch.Tensor, first: int = 0) -> list[float]:
    """Each window's summed NLL of its tokens ``1..L-1`` (float64 sums of the float32
    per-token losses), from the logits of a batch of windows (``first``: the batch's first
    window, for the error message)."""
    return summed_nll(token_nll(logits[:, :-1], batch[:, 1:]), first)


def perplexity_from_nll(window_nll: list[float], seqlen: int, seconds: float) -> PerplexityResult:
    """PPL = exp(mean token NLL) over windows of ``seqlen`` tokens, from each window's summed
    NLL (:func:`window_nll`)."""
    n_windows = len(window_nll)
    mean_nll = sum(window_nll) / (n_windows * (seqlen - 1))
    return PerplexityResult(
        ppl=math.exp(mean_nll),
        mean_nll=mean_nll,
        n_windows=n_windows,
        seqlen=seqlen,
        n_tokens=n_windows * seqlen,
        seconds=seconds,
        window_nll=list(window_nll),
    )


def windows_digest(windows: torch.Tensor) -> str:
    """SHA-256 of the token windows (shape and ids): which evaluation a checkpoint is of."""
    h = hashlib.sha256(str(tuple(windows.shape)).encode())
    h.update(windows.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def _open_kept(
    store: EvalStore, name: str, model: nn.Module, windows: torch.Tensor
) -> dict[str, Any]:
    """What ``store`` kept of this model on these windows: read (and checked) or started."""
    fingerprint = logits_fingerprint(model, windows[:1, : min(64, windows.shape[1])])
    digest = windows_digest(windows)
    saved = store.read(name)
    where = f"{store} ({name})"
    if saved is not None:
        if saved.get("windows_sha256") != digest:
            raise TorqError(f"{where} holds other perplexity windows; remove it")
        check_fingerprint(saved["fingerprint"], fingerprint, where)
        return saved
    saved = {"windows_sha256": digest, "fingerprint": fingerprint, "nll": {}, "seconds": 0.0}
    store.write(name, saved)
    return saved
