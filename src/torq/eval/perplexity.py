"""WikiText-2 perplexity as the paper's tables report it (method-notes §3).

The raw test split is tokenized once as one string and cut into non-overlapping windows of
``seqlen`` tokens (the tail that does not fill a window is dropped). Every window predicts
its tokens 1..L-1 from the preceding ones; PPL = exp(mean token NLL) over all windows.
Because every window has the same length, this equals exp of the mean of the model's own
``labels=`` loss over the windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from torq.errors import TorqError


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
) -> PerplexityResult:
    """Perplexity of a causal LM over token windows (method-notes §3)."""
    if windows.dim() != 2:
        raise TorqError(f"windows must be [n_windows, seqlen], got shape {tuple(windows.shape)}")
    device = next(model.parameters()).device
    n, seqlen = windows.shape
    total_nll = 0.0
    start = time.perf_counter()
    bar = tqdm(total=n, desc=desc, unit="win", disable=not progress, leave=False)
    for i in range(0, n, batch_size):
        batch = windows[i : i + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits
        nll = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            batch[:, 1:].reshape(-1),
            reduction="sum",
        )
        if not torch.isfinite(nll):
            bar.close()
            raise TorqError(f"non-finite loss in window {i}: the model produced NaN/Inf logits")
        total_nll += float(nll.double())
        bar.update(batch.shape[0])
    bar.close()
    seconds = time.perf_counter() - start
    predicted = n * (seqlen - 1)
    mean_nll = total_nll / predicted
    return PerplexityResult(
        ppl=math.exp(mean_nll),
        mean_nll=mean_nll,
        n_windows=n,
        seqlen=seqlen,
        n_tokens=n * seqlen,
        seconds=seconds,
    )
