"""The accuracy/perplexity figure (the paper's Figure 1 for our runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from torq.errors import TorqError
from torq.eval.figure import (
    _log_axis,
    _overlap_area,
    _place_labels,
    accuracy_perplexity_figure,
)


def _result(points: list[tuple[str, float, float]]) -> dict:
    rows = [{"method": m, "ppl": p, "zeroshot": {"average": a / 100}} for m, p, a in points]
    return {"rows": rows, "config": {"model": "tiny", "weight_format": "mxfp4"}, "eval": {}}


# a crowded family: five methods within 3 perplexity and 1.5 accuracy points, as the TORQ
# variants sit, plus the spread-out baselines
CROWDED = [
    ("fp", 22.0, 42.9),
    ("torq", 32.9, 38.1),
    ("torq-had32", 33.4, 37.9),
    ("torq-inter", 34.0, 38.3),
    ("torq-intra", 33.1, 37.6),
    ("torq+gptq", 31.5, 38.0),
    ("had32", 66.0, 34.6),
    ("rtn", 110.5, 33.4),
    ("quarot", 160.0, 31.9),
]


def test_labels_of_close_points_do_not_overlap() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=150)
    points = [(p, a, m) for m, p, a in CROWDED]
    for x, y, m in points:
        ax.scatter([x], [y], s=60, label=m)
    ax.set_xscale("log")
    ax.set_xlabel("WikiText-2 perplexity")
    ax.set_ylabel("average zero-shot accuracy, %")
    ax.set_title("crowded")
    fig.tight_layout()
    labels = _place_labels(fig, ax, points)
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    # the text's own box (an annotation's extent would include its leader line)
    for t in labels:
        t.update_positions(renderer)
    boxes = [Text.get_window_extent(t, renderer) for t in labels]
    assert sorted(t.get_text() for t in labels) == sorted(m for m, _, _ in CROWDED)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        for b in boxes[i + 1 :]:
            assert _overlap_area((a.x0, a.y0, a.x1, a.y1), (b.x0, b.y0, b.x1, b.y1)) == 0
    plt.close(fig)


def test_log_axis_ticks_read_as_plain_numbers() -> None:
    """Perplexities 22–160 on a log axis: tick labels such as "30" and "100", no
    scientific notation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=150)
    ax.scatter([22.0, 32.9, 160.0], [42.9, 38.1, 31.9])
    _log_axis(ax)
    fig.canvas.draw()
    shown = [
        t.get_text()
        for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
        if t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]
    ]
    plt.close(fig)
    assert "100" in shown and len(shown) >= 3
    assert all(text.replace(".", "").isdigit() for text in shown), shown


def test_figure_is_written(tmp_path: Path) -> None:
    out = accuracy_perplexity_figure(_result(CROWDED), tmp_path / "sub" / "fig.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figure_needs_a_row_with_both_scores(tmp_path: Path) -> None:
    result = {"rows": [{"method": "fp", "ppl": 20.0, "zeroshot": None}], "config": {}}
    with pytest.raises(TorqError, match="no row has both"):
        accuracy_perplexity_figure(result, tmp_path / "fig.png")
