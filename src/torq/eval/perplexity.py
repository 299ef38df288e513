"""WikiText-2 perplexity as the paper's tables report it (method-notes §3).

The raw test split is tokenized once as one string and cut into non-overlapping windows of
``seqlen`` tokens (the tail that does not fill a window is dropped). Every window predicts
its tokens 1..L-1 from the preceding ones; PPL = exp(mean token NLL) over all windows.
Because every window has the same length, this equals exp of the mean of the model's own
``labels=`` loss over the windows.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from torq.errors import TorqError
from torq.eval.store import EvalStore
from torq.models.fingerprint import check_fingerprint, logits_fingerprint


@dataclass
class PerplexityResult:
    """Perplexity with what it was measured on and how fast."""

    ppl: float
    mean_nll: float
    n_windows: int
    seqlen: int
    n_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def windows_from_text(
    text: str, tokenizer: Any, seqlen: int = 2048, max_windows: int | None = None
) -> torch.Tensor:
    """Tokenize ``text`` once and cut it into ``[n_windows, seqlen]`` non-overlapping windows."""
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
    total_nll = 0.0
    start = time.perf_counter()
    bar = tqdm(total=n, desc=desc, unit="win", disable=not progress, leave=False)
    for i in range(0, n, batch_size):
        if all(str(j) in done for j in range(i, min(i + batch_size, n))):
            total_nll += sum(done[str(j)] for j in range(i, min(i + batch_size, n)))
            bar.update(min(batch_size, n - i))
            continue
        batch = windows[i : i + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits
        try:
            per_window = window_nll(logits, batch, first=i)
        except TorqError:
            bar.close()
            raise
        total_nll += sum(per_window)
        if saved is not None:
            done.update({str(i + b): v for b, v in enumerate(per_window)})
            saved["seconds"] = earlier_seconds + time.perf_counter() - start
            store.write(name, saved)  # type: ignore[union-attr]
        bar.update(batch.shape[0])
    bar.close()
    seconds = earlier_seconds + time.perf_counter() - start
    return perplexity_from_nll(total_nll, n, seqlen, seconds)


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


def perplexity_from_nll(
    total_nll: float, n_windows: int, seqlen: int, seconds: float
) -> PerplexityResult:
    """PPL = exp(mean token NLL) over ``n_windows`` windows of ``seqlen`` tokens."""
    mean_nll = total_nll / (n_windows * (seqlen - 1))
    return PerplexityResult(
        ppl=math.exp(mean_nll),
        mean_nll=mean_nll,
        n_windows=n_windows,
        seqlen=seqlen,
        n_tokens=n_windows * seqlen,
        seconds=seconds,
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
