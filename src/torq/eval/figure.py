"""The paper's Figure 1, for our runs: average zero-shot accuracy against WikiText-2
perplexity, one point per method (matplotlib, PNG)."""

from __future__ import annotations

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
    points = [(r["ppl"], 100 * r["zeroshot"]["average"], r["method"]) for r in rows]
    for x, y, method in points:
        ax.scatter([x], [y], s=60, marker="*" if method == "fp" else "o", zorder=3, label=method)
    ppls = [x for x, _, _ in points]
    if max(ppls) / min(ppls) > 4:
        _log_axis(ax)
    ax.set_xlabel("WikiText-2 perplexity (2048 tokens, lower is better)")
    ax.set_ylabel("average zero-shot accuracy, % (higher is better)")
    cfg = result.get("config", {})
    limit = result.get("eval", {}).get("zeroshot_limit")
    drawn = result.get("eval", {}).get("zeroshot_subset")
    subset = (
        f", {drawn['n']} per task (seed {drawn['seed']})"
        if drawn
        else f", first {limit} per task"
        if limit
        else ""
    )
    ax.set_title(f"{cfg.get('model', '')}, W4A4 {cfg.get('weight_format', '')}{subset}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    _place_labels(fig, ax, points)  # after the layout: it needs the final display boxes
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    if out.stat().st_size == 0:
        raise TorqError(f"failed to write {out}")
    return out


def _log_axis(ax: Any) -> None:
    """A logarithmic perplexity axis whose ticks read as plain numbers (20, 30, 100), not
    matplotlib's default scientific notation (2×10¹, 10²)."""
    from matplotlib.ticker import LogFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(LogFormatter())
    ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


# label offsets in points, tried in this order: beside the marker (right, then left), then
# further up and down, with a leader line (methods of one family sit close together)
_OFFSETS = [(dx, dy) for dy in (4, -11, 14, -21, 24, -31, 34, -41) for dx in (6, -6)]


def _place_labels(fig: Any, ax: Any, points: list[tuple[float, float, str]]) -> list[Any]:
    """Name each point, choosing for each label the first offset in ``_OFFSETS`` whose box
    stays inside the axes and overlaps no label placed before it and no marker (when none
    does, the one inside the axes that overlaps least)."""
    fig.canvas.draw()  # fixes the axis limits and scales, so display boxes are final
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    half = 4.0 * fig.dpi / 72  # a marker's half-width in pixels (s=60 pt² → ≈8 pt across)
    markers = []
    for x, y, _ in points:
        px, py = ax.transData.transform((x, y))
        markers.append((px - half, py - half, px + half, py + half))
    # each label takes its marker's colour, so that close points stay told apart
    colours = {c.get_label(): c.get_facecolor()[0] for c in ax.collections}
    placed: list[tuple[float, float, float, float]] = []
    labels = []
    for x, y, method in sorted(points, key=lambda p: (-p[1], p[0])):
        colour = colours.get(method, "black")
        best: tuple[float, tuple[int, int], tuple[float, ...]] | None = None
        first: tuple[float, ...] | None = None
        for dx, dy in _OFFSETS:
            text = _label(ax, method, (x, y), (dx, dy), colour, leader=False)
            box = text.get_window_extent(renderer)
            text.remove()
            extent = (box.x0, box.y0, box.x1, box.y1)
            first = extent if first is None else first
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1
            if not (inside and frame.y0 <= box.y0 and box.y1 <= frame.y1):
                continue
            clash = sum(_overlap_area(extent, other) for other in placed + markers)
            if best is None or clash < best[0]:
                best = (clash, (dx, dy), extent)
            if clash == 0:
                break
        offset, extent = (_OFFSETS[0], first) if best is None else best[1:]
        placed.append(extent)
        labels.append(_label(ax, method, (x, y), offset, colour, leader=True))
    return labels


def _label(
    ax: Any,
    method: str,
    xy: tuple[float, float],
    offset: tuple[int, int],
    colour: Any,
    leader: bool,
) -> Any:
    """``method``'s label at ``offset`` points from ``xy``; with ``leader``, the far offsets
    get a thin line to their point (the boxes are measured without it)."""
    dx, dy = offset
    line = {"arrowstyle": "-", "lw": 0.5, "color": colour} if leader and abs(dy) > 12 else None
    return ax.annotate(
        method,
        xy,
        textcoords="offset points",
        xytext=offset,
        fontsize=8,
        color=colour,
        ha="left" if dx > 0 else "right",
        arrowprops=line,
    )


def _overlap_area(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return max(width, 0.0) * max(height, 0.0)
