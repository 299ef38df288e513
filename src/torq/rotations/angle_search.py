"""The intra-block rotation's angle search (Appendices A.4 and A.6) and the E2M1 codebook it
works on: the occupancy loss ``L_code`` of Section 5.2.2 (one bin per positive codeword, the
decision boundaries between them), the block scales of the S-step, and for each Givens pair
the globally optimal angle, found by an exact sweep over the critical angles where a value
crosses a decision boundary (``objective="occupancy"``) or by the quantization MSE on a grid
(``objective="mse"``). :mod:`torq.rotations.intra_block` runs Algorithm 2 with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from torq.formats.config import SCALE_MODES, get_format
from torq.formats.constants import (
    E2M1_VALUES,
)
from torq.formats.reference import mx_scale_exponent

# J of Section 5.2.2: one bin per positive E2M1 codeword. A codeword's index parity is its
# mantissa bit, which is what round-half-to-even needs.
N_CODES = len(E2M1_VALUES)


_HALF_PI = math.pi / 2


# Intervals narrower than this are numerical artefacts of near-coincident critical angles:
# their midpoint cannot be placed reliably on the intended side of both ends.
_MIN_INTERVAL = 1e-12


@dataclass(frozen=True)
class AngleSearchResult:
    """One R-step's angles for ``P`` disjoint pairs, solved in sequence (Algorithm 2, l. 7–10).

    ``losses[l]`` is the objective re-evaluated directly after pair ``l`` was applied (or left
    alone); ``sweep_losses[l]`` is the minimum the search itself predicted for that pair.
    ``z_norm`` is the input with all accepted rotations applied.
    """

    pairs: tuple[tuple[int, int], ...]
    angles: Tensor
    losses: Tensor
    sweep_losses: Tensor
    z_norm: Tensor


def decision_boundaries(dtype: torch.dtype = torch.float64, device: Any = None) -> Tensor:
    """The decision boundaries ``d_1 … d_{J−1}`` of Section 5.2.2: midpoints of the codewords."""
    mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return (mags[1:] + mags[:-1]) / 2


def code_index(z_norm: Tensor) -> Tensor:
    """Index ``j`` of the E2M1 codeword each element rounds to under Eq. (1) (Section 4).

    Round to nearest with ties to even mantissa and saturation at ±6, so ``p̂_j`` counts
    exactly the codes MXFP4 would emit. Magnitudes only: signs share a bin.
    """
    return _code_bins(z_norm).long()


def _code_bins(z_norm: Tensor) -> Tensor:
    """:func:`code_index` as ``int8`` (what counting needs: an eighth of the memory)."""
    mag = z_norm.abs()
    bounds = decision_boundaries(torch.float64).tolist()
    # Counting the boundaries below each value is several times faster than bucketize for
    # seven boundaries. A tie on boundary i goes to the even code: up when i is odd.
    idx = torch.zeros(mag.shape, dtype=torch.int8, device=mag.device)
    for i, bound in enumerate(bounds):
        idx += (mag >= bound) if i % 2 else (mag > bound)
    return idx


def quantize_e2m1(z_norm: Tensor) -> Tensor:
    """``Q_mxFP4`` of Eq. (1) on already-scaled values: nearest E2M1 code, RNE, saturating."""
    mags = torch.tensor(E2M1_VALUES, dtype=z_norm.dtype, device=z_norm.device)
    return torch.sign(z_norm) * mags[code_index(z_norm)]


def codebook_histogram(z_norm: Tensor, per_column: bool = False) -> Tensor:
    """Codeword counts ``N_j`` (Section 5.2.2) of a normalized ``(N, K)`` matrix.

    Returns ``(J,)`` counts over all elements, or ``(K, J)`` counts per column
    (``N_j^(k)`` of Appendix A.5) when ``per_column``.
    """
    idx = _code_bins(z_norm)
    if not per_column:
        return torch.bincount(idx.reshape(-1), minlength=N_CODES)
    n_cols = z_norm.shape[-1]
    # int32 bins (column · J + code) instead of int64: half the memory, the same counts
    offset = torch.arange(n_cols, dtype=torch.int32, device=idx.device) * N_CODES
    flat = (idx.to(torch.int32) + offset).reshape(-1)
    return torch.bincount(flat, minlength=n_cols * N_CODES).view(n_cols, N_CODES)


def codebook_occupancy_loss(z_norm: Tensor) -> Tensor:
    """``L_code = Σ_j (p̂_j − 1/J)²``, the occupancy loss defined in Section 5.2.2.

    ``z_norm`` is ``Z S⁻¹``: every element of every row counts once. Returns a float64 scalar.
    """
    counts = codebook_histogram(z_norm)
    return torch.tensor(_occupancy_from_counts(counts, z_norm.numel()), dtype=torch.float64)


def block_scales(z: Tensor, scale_mode: str = "ocp") -> Tensor:
    """S-step of Section 5.2.3 (Algorithm 2's "Eq. (5)"): a power-of-two scale per row.

    Returns shape ``(N,)`` for ``z`` of shape ``(N, K)``, by the quantizer's rule:

    ``"ocp"`` (default): ``2^(⌊log2 amax⌋ − 2)``, the OCP MX rule (method notes §1), which
    the paper's ``clip_to_pow2(amax / c_max)`` approximates;
    ``"paper"``: ``2^⌊log2 amax⌋``, the paper's Section 4 formula as written;
    ``"rceil"``: ``2^⌈log2(amax / 6)⌉``; ``"nearest"``: ``"ocp"`` plus one binade when the
    significand of amax is at least 1.75. Exponents are clamped to E8M0's range; an all-zero
    row gets the smallest E8M0 scale ``2^−127`` (non-zero, and its elements stay in bin 0).
    """
    _check_choice("scale_mode", scale_mode, SCALE_MODES)
    amax = z.abs().amax(dim=-1)
    # the quantizer's own rule (torq.formats.reference), so the two cannot drift apart
    exponent = mx_scale_exponent(amax, get_format("mxfp4", scale_mode))
    return torch.ldexp(torch.ones_like(amax), exponent)


def quantization_mse_loss(z: Tensor, scales: Tensor) -> Tensor:
    """``L_MSE`` of Appendix A.6, normalized: ``‖Z − S·Q(Z/S)‖²_F / ‖Z‖²_F`` with ``S`` fixed.

    Dividing by ``‖Z‖² = ‖Y‖²`` (rotation-invariant) makes the value unit-free, so one ``tol``
    serves both objectives; the minimizer is unchanged. Returns a float64 scalar.
    """
    scaled = z / scales.unsqueeze(-1)
    err = (scales.unsqueeze(-1) * (scaled - quantize_e2m1(scaled))).pow(2).sum()
    energy = z.pow(2).sum()
    value = err / energy if energy > 0 else err
    return value.to(torch.float64)


def givens(
    size: int,
    p: int,
    q: int,
    theta: float,
    dtype: torch.dtype = torch.float64,
    device: Any = None,
) -> Tensor:
    """The Givens matrix ``G_(p,q)(θ)`` of Algorithm 2 (line 9) in this module's convention.

    ``Z G`` rotates columns ``p, q``: ``z_p ← cosθ z_p + sinθ z_q``, ``z_q ← −sinθ z_p + cosθ
    z_q``, i.e. Appendix A.4's ``(r cos(φ−θ), r sin(φ−θ))``.
    """
    if not (0 <= p < size and 0 <= q < size) or p == q:
        raise ValueError(f"need two distinct columns in [0, {size}), got ({p}, {q})")
    g = torch.eye(size, dtype=dtype, device=device)
    c, s = math.cos(theta), math.sin(theta)
    g[p, p] = c
    g[q, q] = c
    g[q, p] = s
    g[p, q] = -s
    return g


def exact_angle_search(
    z_norm: Tensor,
    pairs: Sequence[tuple[int, int]],
    inplace: bool = False,
    batched: bool | None = None,
) -> AngleSearchResult:
    """Exact solver of Appendix A.4 for the R-step's ``P`` disjoint pairs (Algorithm 2, l. 7–10).

    For each pair, every crossing of ``|r cos(φ−θ)|`` or ``|r sin(φ−θ)|`` over a decision
    boundary is one event that moves one count to the adjacent bin. Both magnitudes feed one
    histogram and ``θ + π/2`` swaps them (up to sign), so ``L_code`` has period ``π/2``: each
    (sample, boundary) with ``r > d`` gives exactly one up- and one down-event in ``[0, π/2)``.
    Sorting the ``M`` events and accumulating their ±1 moves gives the histogram on every
    interval in ``O(M log M)``; the loss is taken at interval interiors (midpoints), the
    widest optimal interval wins, and ``θ = 0`` is always a candidate.

    The events of all ``P`` pairs are built in one vectorized pass (disjoint columns do not
    change each other's events), and what of each sweep depends on the pair's own columns
    only (the sort, its own counts on every interval) is computed for all pairs side by side
    on torch's threads; the sweeps then finish in sequence, each on the histogram left by the
    pairs before it, exactly Algorithm 2's inner loop (:func:`_sweep_numerators`). A rotation
    is kept only if the loss re-counted directly at its angle is strictly lower, so the loss
    never rises.
    ``inplace`` rotates ``z_norm`` itself (the result's ``z_norm`` is then that tensor)
    instead of a copy. ``batched`` prepares the pairs' sweeps as one padded ``[P, events]``
    computation (:func:`_batched_sweeps`: one sort, a few large kernels, for a GPU) instead of
    one pair per thread; by default on every device but the CPU. Both give the same angles,
    losses and rotated sample, bit for bit.
    """
    _check_pairs(pairs, z_norm.shape[-1])
    zn = z_norm if inplace else z_norm.clone()
    n_elems = zn.numel()
    col_counts = codebook_histogram(zn, per_column=True)
    total_counts = col_counts.sum(dim=0)
    current = _occupancy_numerator(total_counts, n_elems)
    if batched is None:
        batched = zn.device.type != "cpu"
    if batched:
        sweeps = _batched_sweeps(zn, pairs)
    else:
        sweeps = _prepare_sweeps(zn, pairs, _pair_events(zn, pairs))
    angles, losses, sweep_losses = [], [], []
    scale = float(N_CODES * n_elems) ** 2
    for (p, q), sweep in zip(pairs, sweeps, strict=True):
        base = total_counts - col_counts[p] - col_counts[q]
        theta, predicted = 0.0, current
        if sweep.angle.numel():
            nums = _sweep_numerators(sweep, base, n_elems)
            widths = sweep.widths()
            best = _best_interval(nums, widths)
            if best is not None and int(nums[best]) < current:
                theta = float(_fold(sweep.angle[best] + widths[best] / 2))
                predicted = int(nums[best])
            del nums, widths
        if theta != 0.0:
            new_p, new_q = _rotate_pair(zn[:, p], zn[:, q], theta)
            cp, cq = codebook_histogram(new_p), codebook_histogram(new_q)
            verified = _occupancy_numerator(base + cp + cq, n_elems)
            if verified < current:
                zn[:, p], zn[:, q] = new_p, new_q
                col_counts[p], col_counts[q] = cp, cq
                total_counts = base + cp + cq
                current = verified
            else:
                theta = 0.0
        angles.append(theta)
        losses.append(current / scale)
        sweep_losses.append(predicted / scale)
    return _search_result(pairs, angles, losses, sweep_losses, zn)


def mse_angle_search(
    z_norm: Tensor,
    scales: Tensor,
    pairs: Sequence[tuple[int, int]],
    grid: int = 128,
    refine: int = 32,
) -> AngleSearchResult:
    """Angle search for the ``L_MSE`` objective of Appendix A.6 with ``S`` fixed.

    The MSE is continuous and piecewise quadratic in ``θ`` (not piecewise constant), so there
    is no finite candidate set: ``grid`` angles over one period ``[0, π/2)`` (``θ = 0``
    included), then ``refine`` angles across the two grid cells around the best. Pairs are
    solved in sequence like :func:`exact_angle_search`; a rotation is kept only if it
    strictly lowers the pair's re-computed error. Losses are normalized as in
    :func:`quantization_mse_loss`.
    """
    _check_pairs(pairs, z_norm.shape[-1])
    zn = z_norm.clone()
    weight = scales.pow(2)
    col_err = (weight.unsqueeze(-1) * (zn - quantize_e2m1(zn)).pow(2)).sum(dim=0)
    energy = float((weight.unsqueeze(-1) * zn.pow(2)).sum())
    norm = energy if energy > 0 else 1.0
    step = _HALF_PI / grid
    coarse = torch.arange(grid, dtype=zn.dtype, device=zn.device) * step
    angles, losses, sweep_losses = [], [], []
    for p, q in pairs:
        u, v = zn[:, p], zn[:, q]
        start = float(_pair_mse(u, v, weight, coarse[:1])[0])
        errs = _pair_mse(u, v, weight, coarse)
        centre = coarse[int(torch.argmin(errs))]
        fine = centre + torch.linspace(-step, step, refine, dtype=zn.dtype, device=zn.device)
        fine_errs = _pair_mse(u, v, weight, fine)
        cand = torch.cat([coarse, fine])
        cand_errs = torch.cat([errs, fine_errs])
        best = int(torch.argmin(cand_errs))
        theta, predicted = 0.0, start
        if float(cand_errs[best]) < start:
            theta, predicted = float(cand[best]), float(cand_errs[best])
            new_u, new_v = _rotate_pair(u, v, theta)
            verified = float(_pair_mse(new_u, new_v, weight, coarse[:1])[0])
            if verified < start:
                zn[:, p], zn[:, q] = new_u, new_v
                col_err[p] = (weight * (new_u - quantize_e2m1(new_u)).pow(2)).sum()
                col_err[q] = (weight * (new_v - quantize_e2m1(new_v)).pow(2)).sum()
            else:
                theta = 0.0
        predicted_total = float(col_err.sum()) - float(col_err[p] + col_err[q]) + predicted
        angles.append(theta)
        losses.append(float(col_err.sum()) / norm)
        sweep_losses.append(predicted_total / norm)
    return _search_result(pairs, angles, losses, sweep_losses, zn)


def _rotate_pair(u: Tensor, v: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    c, s = math.cos(theta), math.sin(theta)
    return c * u + s * v, c * v - s * u


def _occupancy_from_counts(counts: Tensor, n_elems: int) -> float:
    return _occupancy_numerator(counts, n_elems) / float(N_CODES * n_elems) ** 2


def _occupancy_numerator(counts: Tensor, n_elems: int) -> int:
    # J²T²·L_code as an exact integer: comparisons between candidate angles never round.
    return int((N_CODES * counts.to(torch.int64) - n_elems).pow(2).sum())


def _fold(angle: Tensor) -> Tensor:
    folded = torch.remainder(angle, _HALF_PI)
    # remainder of a tiny negative number can round up to the period itself.
    return torch.where(folded >= _HALF_PI, folded - _HALF_PI, folded)


def _pair_columns(z_norm: Tensor, pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """Each pair's two columns, pair-major ``[P, N]``: each pair's slice contiguous for the
    masked selections and row-wise steps of the sweeps."""
    ps = [p for p, _ in pairs]
    qs = [q for _, q in pairs]
    return z_norm[:, ps].T.contiguous(), z_norm[:, qs].T.contiguous()


def _crossings(z_norm: Tensor, pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Every pair's value ``(r cos φ, r sin φ)`` of each block against each decision boundary
    ``d_i``: ``φ`` (``[P, N, 1]``), ``α = arccos(d_i / r)`` and whether ``r > d_i`` (both
    ``[P, N, J−1]``). Where ``r > d_i``, the magnitudes cross ``d_i`` at ``φ ± α``."""
    u, v = _pair_columns(z_norm, pairs)
    r = torch.hypot(u, v).unsqueeze(-1)
    phi = torch.atan2(v, u).unsqueeze(-1)
    del u, v
    bounds = decision_boundaries(z_norm.dtype, z_norm.device)
    crosses = r > bounds
    # atan2(√((r−d)(r+d)), d) is arccos(d/r) without arccos's lost digits near d ≈ r.
    # In place: the same element-wise operations, one [P, N, 7] temporary fewer at a time
    # (on an 8B model's down_proj group, N is about a million blocks).
    alpha = r - bounds
    alpha.mul_(r + bounds).clamp_min_(0).sqrt_().atan2_(bounds)
    return phi, alpha, crosses


def _event_codes(crosses: Tensor) -> Tensor:
    """``i + 1`` for boundary ``d_i``, along the last dimension of ``crosses``."""
    n_bounds = crosses.shape[-1]
    return torch.arange(1, n_bounds + 1, dtype=torch.int8, device=crosses.device)


def _pair_events(z_norm: Tensor, pairs: Sequence[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """Critical angles in ``[0, π/2)`` of every pair, each with a signed event code.

    The code is ``±(i + 1)`` for a crossing of boundary ``d_i``: ``+`` when the magnitude
    rises through it (a count moves from bin ``i`` to ``i + 1``), ``−`` when it falls.
    """
    phi, alpha, crosses = _crossings(z_norm, pairs)
    code = _event_codes(crosses).expand_as(crosses)
    out = []
    for pair in range(len(pairs)):
        mask = crosses[pair]
        ph, al = phi[pair].expand_as(mask)[mask], alpha[pair][mask]
        c = code[pair][mask]
        out.append((torch.cat([_fold(ph - al), _fold(ph + al)]), torch.cat([c, -c])))
    return out


def _occupancy_sweep(
    u: Tensor,
    v: Tensor,
    ev_angle: Tensor,
    ev_code: Tensor,
    base: Tensor,
    n_elems: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loss on every interval between consecutive critical angles, in one sorted sweep.

    Returns the interval midpoints (in ``[0, π/2)``), the exact integer numerators
    ``J²T²·L_code`` and the interval widths, one entry per sorted event (the interval
    after it, the last one wrapping round to the first event plus ``π/2``).
    """
    sweep = _prepare_sweep(u, v, ev_angle, ev_code)
    widths = sweep.widths()
    return _fold(sweep.angle + widths / 2), _sweep_numerators(sweep, base, n_elems), widths


@dataclass(frozen=True)
class _PairSweep:
    """The part of a pair's sweep that its own two columns decide: the events in increasing
    angle and, after each, ``Σ_j o_j²`` of the pair's own codeword counts ``o``."""

    angle: Tensor
    code: Tensor
    own_start: Tensor  # [J] the pair's own counts before the first event
    own_square: Tensor  # [events] Σ_j o_j² after each event, exact (int64)

    def widths(self) -> Tensor:
        """Each interval's width, the last one wrapping round to the first event + π/2."""
        return torch.diff(self.angle, append=self.angle[:1] + _HALF_PI)


def _prepare_sweep(u: Tensor, v: Tensor, ev_angle: Tensor, ev_code: Tensor) -> _PairSweep:
    """Sort a pair's events and count its own two columns' codewords on every interval."""
    ev_angle, ev_code = _sort_events(ev_angle, ev_code)
    widths = torch.diff(ev_angle, append=ev_angle[:1] + _HALF_PI)
    n_events = ev_angle.numel()
    own_square = torch.empty(n_events, dtype=torch.int64, device=u.device)
    if not n_events:
        own = codebook_histogram(u) + codebook_histogram(v)
        return _PairSweep(ev_angle, ev_code, own, own_square)
    # One histogram counted directly anchors the running sums; it is taken inside the
    # widest gap, the angle safest from landing on the wrong side of an event.
    gap = int(torch.argmax(widths))
    su, sv = _rotate_pair(u, v, float(ev_angle[gap] + widths[gap] / 2))
    del widths
    # the net moves of events 0..gap, added straight into the bins (no [events, J] table)
    moved = torch.zeros(N_CODES, dtype=torch.int64, device=u.device)
    for start in range(0, gap + 1, _SWEEP_CHUNK):
        code = ev_code[start : min(start + _SWEEP_CHUNK, gap + 1)].long()
        rise, bound = code.sign(), code.abs() - 1
        moved.index_add_(0, bound, -rise).index_add_(0, bound + 1, rise)
    own_start = codebook_histogram(su) + codebook_histogram(sv) - moved
    del su, sv
    # the counts after event i: the start plus the moves of events 0..i, exact integers,
    # accumulated a chunk of events at a time (a [events, J] table of a million-block
    # sample is half a gigabyte)
    # (in int32: a pair's own counts are at most 2N; squared in int64)
    running = own_start.to(torch.int32)
    for start in range(0, n_events, _SWEEP_CHUNK):
        counts = _event_moves(ev_code[start : start + _SWEEP_CHUNK]).cumsum_(dim=0)
        counts += running
        running = counts[-1].clone()
        wide = counts.long()
        del counts
        chunk = wide.mul_(wide).sum(dim=1)
        own_square[start : start + chunk.numel()] = chunk
    return _PairSweep(ev_angle, ev_code, own_start, own_square)


def _prepare_sweeps(
    zn: Tensor, pairs: Sequence[tuple[int, int]], events: list[tuple[Tensor, Tensor]]
) -> list[_PairSweep]:
    """:func:`_prepare_sweep` of every pair, side by side on torch's threads (the pairs'
    columns are disjoint; NumPy's sort and torch's kernels release the GIL). Each pair's
    unsorted events are let go as soon as its sorted ones exist."""
    pending: list[tuple[Tensor, Tensor] | None] = list(events)
    events.clear()

    def prepare(i: int) -> _PairSweep:
        ev = pending[i]
        pending[i] = None
        assert ev is not None
        p, q = pairs[i]
        return _prepare_sweep(zn[:, p], zn[:, q], *ev)

    workers = min(torch.get_num_threads(), len(pairs))
    if workers <= 1:
        return [prepare(i) for i in range(len(pairs))]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(prepare, range(len(pairs))))


def _batched_sweeps(zn: Tensor, pairs: Sequence[tuple[int, int]]) -> list[_PairSweep]:
    """:func:`_prepare_sweep` of every pair as one padded computation, for accelerators.

    The per-pair path launches a sort and a running count for each pair, small steps that
    leave a GPU idle between launches. Here every pair's events sit in one row of a
    ``[P, 2·N·(J−1)]`` table (a (sample, boundary) that is not crossed holds angle ``+∞``
    and code 0, so it sorts last and moves no count), sorted along the rows in one call; the
    anchor histograms, the moves before each anchor and the running counts are computed for
    all rows at once, a chunk of events at a time. The events and their order are the
    per-pair path's (equal angles aside, which only bound zero-width intervals that are
    never chosen), and the anchors are computed with the same scalar arithmetic, so the
    sweeps give the same numerators on every usable interval.
    """
    n_pairs = len(pairs)
    phi, alpha, crosses = _crossings(zn, pairs)
    never = torch.full((), math.inf, dtype=zn.dtype, device=zn.device)
    angle = torch.cat(
        [
            torch.where(crosses, _fold(phi - alpha), never).reshape(n_pairs, -1),
            torch.where(crosses, _fold(phi + alpha), never).reshape(n_pairs, -1),
        ],
        dim=1,
    )
    del phi, alpha
    code = _event_codes(crosses)
    code = torch.where(crosses, code, torch.zeros_like(code)).reshape(n_pairs, -1)
    code = torch.cat([code, -code], dim=1)
    counts = 2 * crosses.reshape(n_pairs, -1).sum(dim=1)
    del crosses
    angle, order = torch.sort(angle, dim=1)
    code = code.gather(1, order)
    del order
    count_list = [int(c) for c in counts.tolist()]
    width = max(count_list)
    angle, code = angle[:, :width], code[:, :width]

    # each row's interval widths, its last one wrapping round to its first event + π/2, and
    # its anchor (the midpoint of its widest interval) as _prepare_sweep takes it: a Python
    # float, whose cosine and sine are taken by math below (a row without events: 0)
    position = torch.arange(width, device=zn.device)
    gap = torch.zeros_like(counts)
    anchors = [0.0] * n_pairs
    if width:
        first = angle[:, :1] + _HALF_PI
        following = torch.cat([angle[:, 1:], first], dim=1)
        following.scatter_(1, (counts - 1).clamp_min(0)[:, None], first)
        valid = position < counts[:, None]
        widths = torch.where(valid, following - angle, torch.full_like(angle, -1.0))
        del following, first, valid
        gap = torch.argmax(widths, dim=1)
        at_gap = angle.gather(1, gap[:, None]).squeeze(1).tolist()
        gap_width = widths.gather(1, gap[:, None]).squeeze(1).tolist()
        del widths
        anchors = [
            a + w / 2 if n else 0.0 for a, w, n in zip(at_gap, gap_width, count_list, strict=True)
        ]
    u, v = _pair_columns(zn, pairs)
    cos = torch.tensor([math.cos(t) for t in anchors], dtype=zn.dtype, device=zn.device)
    sin = torch.tensor([math.sin(t) for t in anchors], dtype=zn.dtype, device=zn.device)
    su = cos[:, None] * u + sin[:, None] * v
    sv = cos[:, None] * v - sin[:, None] * u
    own_start = codebook_histogram(su.T, per_column=True) + codebook_histogram(
        sv.T, per_column=True
    )
    del su, sv, u, v

    step = max(1, _SWEEP_CHUNK // max(1, n_pairs))
    # the net moves of events 0..anchor, added straight into each row's bins (no [events,
    # J] table; a padding event, code 0, adds 0), taken off the anchor's counts
    moved = torch.zeros(n_pairs, N_CODES, dtype=torch.int64, device=zn.device)
    for start in range(0, width, step):
        stop = min(start + step, width)
        chunk = code[:, start:stop].long() * (position[start:stop] <= gap[:, None])
        rise, bound = chunk.sign(), (chunk.abs() - 1).clamp_min(0)
        moved.scatter_add_(1, bound, -rise).scatter_add_(1, bound + 1, rise)
    own_start = own_start - moved
    # the counts after each event, a chunk of events at a time
    own_square = torch.empty(n_pairs, width, dtype=torch.int64, device=zn.device)
    running = own_start.to(torch.int32)
    for start in range(0, width, step):
        stop = min(start + step, width)
        delta = _event_moves(code[:, start:stop].reshape(-1)).view(n_pairs, stop - start, -1)
        delta = delta.cumsum_(dim=1)
        delta += running[:, None, :]
        running = delta[:, -1].clone()
        wide = delta.long()
        del delta
        own_square[:, start:stop] = wide.mul_(wide).sum(dim=2)
    return [
        _PairSweep(angle[i, :n], code[i, :n], own_start[i], own_square[i, :n])
        for i, n in enumerate(count_list)
    ]


def _sweep_numerators(sweep: _PairSweep, base: Tensor, n_elems: int) -> Tensor:
    """``J²T²·L_code`` after each of a pair's events, the other columns' counts being
    ``base``: with ``c = base + o``, ``Σ_j (J c_j − T)² = J² Σ_j c_j² − J T²`` (the counts
    sum to ``T``) and ``Σ_j c_j² = Σ base² + 2 base·o + Σ o²``. An event moves one of the
    pair's counts across boundary ``i``, so ``base·o`` changes by ``±(base_{i+1} − base_i)``:
    one running sum, exact integers like the rest."""
    base = base.to(torch.int64)
    step = base[1:] - base[:-1]
    code = sweep.code.long()
    cross = step[code.abs() - 1].mul_(code.sign()).cumsum_(dim=0)
    del code
    cross.add_(int((base * sweep.own_start).sum())).mul_(2)
    cross += sweep.own_square
    cross.add_(int(base.pow(2).sum()))
    return cross.mul_(N_CODES * N_CODES).sub_(N_CODES * n_elems**2)


# events per chunk of the sweep's running counts: 1M events × J int32 = 32 MiB (and the
# same in int64 to square them)
_SWEEP_CHUNK = 1 << 20


def _event_moves(ev_code: Tensor) -> Tensor:
    """``[events, J]`` int32: each event's ±1 moves of one count between adjacent bins."""
    ev_code = ev_code.to(torch.int32)
    rise = ev_code.sign()
    # a padding event (code 0, the batched sweeps') moves nothing: any bin will do
    bound = (ev_code.abs() - 1).clamp_min(0).long()
    delta = torch.zeros(ev_code.numel(), N_CODES, dtype=torch.int32, device=ev_code.device)
    delta.scatter_(1, torch.stack([bound, bound + 1], 1), torch.stack([-rise, rise], 1))
    return delta


def _sort_events(ev_angle: Tensor, ev_code: Tensor) -> tuple[Tensor, Tensor]:
    """The events in increasing angle. On the CPU through NumPy's argsort, which runs
    vectorized sorting networks (3-4x faster than ``torch.sort`` on 10^5-10^6 float64 angles,
    the sweep's largest cost; ``benchmarks/intra_speed.py``). Equal angles may come in either
    order: only the zero-width intervals between them see it, and those are never chosen."""
    if ev_angle.device.type != "cpu":
        ev_angle, order = torch.sort(ev_angle)
        return ev_angle, ev_code[order]
    order = torch.from_numpy(np.argsort(ev_angle.numpy()))
    return ev_angle[order], ev_code[order]


def _best_interval(nums: Tensor, widths: Tensor) -> int | None:
    usable = widths > _MIN_INTERVAL
    if not bool(usable.any()):
        return None
    masked = torch.where(usable, nums, torch.full_like(nums, torch.iinfo(nums.dtype).max))
    best = masked.min()
    # Among equally good intervals the widest midpoint is the most robust angle.
    tied = usable & (nums == best)
    return int(torch.argmax(torch.where(tied, widths, torch.full_like(widths, -1.0))))


def _pair_mse(u: Tensor, v: Tensor, weight: Tensor, thetas: Tensor) -> Tensor:
    """Weighted E2M1 squared error of columns ``(u, v)`` rotated by each of ``thetas``."""
    out = torch.empty_like(thetas)
    # Chunk the (N, angles) products to bound memory at a few million elements.
    chunk = max(1, (1 << 21) // max(1, u.numel()))
    for start in range(0, thetas.numel(), chunk):
        th = thetas[start : start + chunk]
        c, s = torch.cos(th), torch.sin(th)
        ru = u[:, None] * c + v[:, None] * s
        rv = v[:, None] * c - u[:, None] * s
        err = (ru - quantize_e2m1(ru)).pow(2) + (rv - quantize_e2m1(rv)).pow(2)
        out[start : start + chunk] = weight @ err
    return out


def _search_result(
    pairs: Sequence[tuple[int, int]],
    angles: list[float],
    losses: list[float],
    sweep_losses: list[float],
    zn: Tensor,
) -> AngleSearchResult:
    as_tensor = {"dtype": torch.float64}
    return AngleSearchResult(
        pairs=tuple((int(p), int(q)) for p, q in pairs),
        angles=torch.tensor(angles, **as_tensor),
        losses=torch.tensor(losses, **as_tensor),
        sweep_losses=torch.tensor(sweep_losses, **as_tensor),
        z_norm=zn,
    )


def _check_pairs(pairs: Sequence[tuple[int, int]], n_cols: int) -> None:
    seen: set[int] = set()
    for p, q in pairs:
        if not (0 <= p < n_cols and 0 <= q < n_cols) or p == q:
            raise ValueError(f"pair ({p}, {q}) is not two distinct columns of {n_cols}")
        if p in seen or q in seen:
            raise ValueError(f"pairs must be disjoint; column reused in {list(pairs)}")
        seen.update((p, q))


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
