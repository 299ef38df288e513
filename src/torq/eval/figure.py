"""The paper's Figure 1, for our runs: average zero-shot accuracy against WikiText-2
perplexity, one point per method (matplotlib, PNG)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torq.errors import TorqError


def accuracy_perplexity_figure(result: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG scatter of (Wiki2 PPL, average accuracy) per method of a ``torq eval``
    result record; the FP row is marked. Needs every row's perplexity and zero-shot scores."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TorqError("the figure needs matplotlib: pip install 'torq-mx[eval]'") from None
    rows = [r for r in result["rows"] if r.get("zeroshot") and r.get("ppl") is not None]
    if not rows:
        raise TorqError("no row has both a perplexity and zero-shot scores to plot")
    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=150)
    for r in rows:
        x, y = r["ppl"], 100 * r["zeroshot"]["average"]
        is_fp = r["method"] == "fp"
        ax.scatter([x], [y], s=60, marker="*" if is_fp else "o", zorder=3)
        ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ppls = [r["ppl"] for r in rows]
    if max(ppls) / min(ppls) > 4:
        ax.set_xscale("log")
    ax.set_xlabel("WikiText-2 perplexity (2048 tokens, lower is better)")
    ax.set_ylabel("average zero-shot accuracy, % (higher is better)")
    cfg = result.get("config", {})
    limit = result.get("eval", {}).get("zeroshot_limit")
    subset = f", first {limit} per task" if limit else ""
    ax.set_title(f"{cfg.get('model', '')}, W4A4 {cfg.get('weight_format', '')}{subset}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    if not math.isfinite(out.stat().st_size) or out.stat().st_size == 0:
        raise TorqError(f"failed to write {out}")
    return out
