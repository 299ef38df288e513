"""GPTQ weight quantization on the grid of a block-scaled 4-bit format.

GPTQ (Frantar et al., 2023) quantizes a weight ``W [N, K]`` one input column at a time
and pushes each column's error onto the columns not yet quantized, weighted by the
inverse Hessian of the layer's reconstruction loss ``‖W X − Ŵ X‖²``, ``H = 2 X Xᵀ`` over the
calibration inputs ``X``. Here the grid is the target format's: the blocks of 32 (16 for
NVFP4) run along the input dimension, and each block's scale is fitted when GPTQ reaches the
block's first column, from the block's weights as the earlier columns' updates left them
(or, with ``act_order``, from the original weights, since columns are then visited out of
block order). Dampening adds ``damp · mean(diag H)`` to the diagonal (``damp_scale=
"largest-eigenvalue"``: ``damp · λmax(H)``, Qronos's reference damping). With
``scale_search="mse"`` (MR-GPTQ's MSE-chosen scales, Egiazarian et al., 2025) each MX
block's power-of-two scale is the one of ``2^(e−1), 2^e, 2^(e+1)`` (``e`` the format's rule)
that rounds the block with the least ``Σ |w − q|^p`` (``p = mse_norm``, 2.4 as in FP-Quant);
an NVFP4 block's E4M3 scale the one of the rule's and its two neighbouring E4M3 values. NVFP4's
Four Over Six (``scale_mode="4over6"``) chooses between the scales that map the block's amax
onto 6 and onto 4 by the squared error.

With an online transform ``T`` (TORQ, Hadamard), the layer computes ``W' (T x)``, so the
Hessian is that of the transformed inputs, ``T H Tᵀ``:
:meth:`torq.rotations.transform.BlockRotation.conjugate_hessian`.

Asymmetric calibration (GPTAQ, Li et al., ICML 2025: ``asymmetry`` ``α > 0``): the inputs
``X̃`` are the quantized model's and the target is the float model's output ``W X``, the
loss ``‖Ŵ X̃ − W X‖²``. With ``H = X̃ X̃ᵀ`` and ``C = (X − X̃) X̃ᵀ`` it is
``(Ŵ − T) H (Ŵ − T)ᵀ`` up to a constant, ``T = W + W C H⁻¹``: the same quadratic as GPTQ's
about a shifted target, so GPTQ run from ``T`` is the greedy column-by-column solution of
the asymmetric loss. GPTAQ's own code damps the asymmetric term by ``α = 0.25``; here
``T = W + α W C H⁻¹`` (``α = 1``: the loss exactly, which is Qronos, Zhang et al., ICLR 2026:
its first step corrects every weight to the quantized inputs by least squares, ``T``, and
its later steps are GPTQ's on ``X̃ X̃ᵀ``). A group whose full correction ``‖W C H⁻¹‖``
exceeds ``max_shift · ‖W‖`` keeps GPTQ's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torq.formats import FormatSpec
from torq.formats.constants import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    FOUR_OVER_SIX_EXPANSION,
)
from torq.formats.packing import exact_pow2
from torq.formats.reference import (
    mx_scale_exponent,
    round_to_e2m1,
    round_to_e4m3,
    round_to_int4,
)
from torq.knobs import knob
from torq.surgery.qlinear import nvfp4_weight_tensor_scale

SCALE_SEARCHES: tuple[str, ...] = ("amax", "mse")
# what ``damp`` multiplies: GPTQ's mean of H's diagonal, or H's largest eigenvalue (Qronos's
# reference code, Brevitas's ``qronos.py``: its ``alpha`` times a power-iteration estimate)
DAMP_SCALES: tuple[str, ...] = ("mean-diagonal", "largest-eigenvalue")
# power iterations for λmax(H): Brevitas's count, which its Qronos rows were made with
POWER_ITERATIONS = 30
# settings added after results were kept under keys without them: at their defaults they
# stay out of a method's settings key (:meth:`GPTQConfig.key`), so those keys still match
_KEYLESS_AT_DEFAULT = {
    "scale_search": "amax",
    "mse_norm": 2.4,
    "asymmetry": 0.0,
    "max_shift": 1.0,
    "damp_scale": "mean-diagonal",
    "input_noise": False,
}


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ's knobs (defaults: the GPTQ paper's)."""

    damp: float = knob(0.01, flag="--gptq-damp", type=float, help="GPTQ dampening (× mean diag H)")
    damp_scale: str = "mean-diagonal"
    act_order: bool = knob(
        False,
        flag="--act-order",
        action="store_true",
        help="GPTQ: columns by decreasing Hessian diagonal",
    )
    lazy_batch: int = 128
    # how each block's scale is chosen: the format's rule from the block's amax, or the
    # candidate exponent around it with the least Σ|w − q|^mse_norm (MR-GPTQ)
    scale_search: str = knob(
        "amax",
        flag="--gptq-scales",
        choices=SCALE_SEARCHES,
        help="GPTQ: each block's scale by the format's rule from its amax, or the scale "
        "around it (MX: a power of two; NVFP4: an E4M3 value) that rounds the block with the "
        "least error (as mr-gptq)",
    )
    mse_norm: float = 2.4
    # GPTAQ's asymmetric calibration (module doc): the weight of the float model's output
    # in the target, 0 (GPTQ: the quantized inputs' own output) to 1; it needs the inputs
    # of both models (:class:`torq.calibration.capture.BlockStatistics`' cross term)
    asymmetry: float = 0.0
    # the largest full correction ‖W C H⁻¹‖ / ‖W‖ trusted: beyond it the quantized model's
    # inputs are too far from the float model's for the float output to be a target, and
    # the group keeps GPTQ's (WUSH's transform with GPTAQ diverged from layer 1 on, full
    # corrections 3.0 and growing; the balanced Hadamard's stay under 0.8 on SmolLM2:
    # docs/recipes.md). Unweighted by ``asymmetry``, so one bound serves GPTAQ and Qronos.
    max_shift: float = 1.0
    # the Hessian of the inputs the weight multiplies at inference, Q_a(T x), not T x: its
    # diagonal raised by the activation quantizer's error power per channel, E[(Q_a(T x) −
    # T x)²] measured on the group's token sample (the error's own correlations across
    # channels and with T x are left out). Qronos's reference sums its statistics after
    # the layer's activation quantizer (Brevitas's ``gpxq.py``); a research setting
    input_noise: bool = False

    def __post_init__(self) -> None:
        if not self.damp >= 0:
            raise ValueError(f"damp must be >= 0, got {self.damp}")
        if self.damp_scale not in DAMP_SCALES:
            raise ValueError(f"damp_scale must be one of {DAMP_SCALES}, got {self.damp_scale!r}")
        if self.scale_search not in SCALE_SEARCHES:
            raise ValueError(f"scale_search must be one of {SCALE_SEARCHES}")
        if not self.mse_norm > 0:
            raise ValueError(f"mse_norm must be > 0, got {self.mse_norm}")
        if not 0.0 <= self.asymmetry <= 1.0:
            raise ValueError(f"asymmetry is a weight in [0, 1], got {self.asymmetry}")
        if not self.max_shift > 0:
            raise ValueError(f"max_shift must be > 0, got {self.max_shift}")
        if self.lazy_batch < 1 or self.lazy_batch % 32:
            raise ValueError(f"lazy_batch must be a positive multiple of 32, got {self.lazy_batch}")


def gptq_key(settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """GPTQ's settings (``asdict(GPTQConfig)``) as a method's settings key holds them:
    settings added later are left out at their defaults (:data:`_KEYLESS_AT_DEFAULT`)."""
    if settings is None:
        return None
    return {
        k: v
        for k, v in settings.items()
        if not (k in _KEYLESS_AT_DEFAULT and v == _KEYLESS_AT_DEFAULT[k])
    }


def largest_eigenvalue(h: torch.Tensor, steps: int = POWER_ITERATIONS) -> torch.Tensor:
    """λmax of the symmetric positive semi-definite ``h`` by ``steps`` power iterations from
    the all-ones vector (deterministic; a Hessian's dominant direction is its large-activation
    channels, which the all-ones start is not orthogonal to), as Qronos's reference estimates
    it; the Rayleigh quotient of the last iterate, a lower bound of λmax."""
    v = torch.ones(h.shape[0], dtype=h.dtype, device=h.device)
    v = v / v.norm()
    for _ in range(steps):
        hv = h @ v
        norm = hv.norm()
        if norm == 0:
            return norm
        v = hv / norm
    return v @ (h @ v)


def damp_reference(h: torch.Tensor, damp_scale: str) -> torch.Tensor:
    """What :class:`GPTQConfig`'s ``damp`` multiplies (``damp_scale``): H's mean diagonal
    (GPTQ) or its largest eigenvalue (Qronos's reference)."""
    if damp_scale == "mean-diagonal":
        return torch.diag(h).mean()
    if damp_scale == "largest-eigenvalue":
        return largest_eigenvalue(h)
    raise ValueError(f"damp_scale must be one of {DAMP_SCALES}, got {damp_scale!r}")


# E4M3's codes (float8_e4m3fn as a byte) of its smallest normal, 2**-6, and of 448
_E4M3_MIN_NORMAL_CODE = 0x08
_E4M3_MAX_CODE = 0x7E


class _BlockGrid:
    """The format's quantizer for one block of columns: fit the scales, round a column."""

    def __init__(
        self,
        fmt: FormatSpec,
        weight: torch.Tensor,
        config: GPTQConfig | None = None,
        tensor_scale: torch.Tensor | None = None,
    ) -> None:
        if fmt.name not in ("mxfp4", "mxint4", "nvfp4", "mxfp8"):
            raise ValueError(f"GPTQ supports mxfp4, mxint4, nvfp4 and mxfp8, not {fmt.name}")
        cfg = config or GPTQConfig()
        self.fmt = fmt
        self.search = cfg.scale_search
        self.norm = cfg.mse_norm
        # the scale QuantLinear keeps for the weight GPTQ starts from (the same function), or
        # the one given (shared by the linears an engine fuses)
        if fmt.name == "nvfp4" and tensor_scale is None:
            tensor_scale = nvfp4_weight_tensor_scale(weight)
        self.tensor_scale = tensor_scale if fmt.name == "nvfp4" else None

    def scales(self, block: torch.Tensor) -> torch.Tensor:
        """Per-row scale ``[N, 1]`` (float64) for a block ``[N, width]`` of columns."""
        amax = block.abs().amax(dim=1, keepdim=True)
        if self.fmt.name == "nvfp4":
            return self._nvfp4_scales(block, amax)
        rule = mx_scale_exponent(amax.float(), self.fmt)
        if self.search != "mse":
            return exact_pow2(rule, torch.float32).double()
        # of rule − 1, rule, rule + 1 (E8M0's range), the least Σ |w − q|^p; the rule first
        shifts = ((rule + shift).clamp(-127, 127) for shift in (0, 1, -1))
        return self._least_error(block, [exact_pow2(e, torch.float32).double() for e in shifts])

    def _nvfp4_scales(self, block: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """NVFP4's total scale per row: the rule's (the block amax onto 6); under Four Over
        Six (``scale_mode="4over6"``) the one with the amax onto 4 where it rounds these
        columns, as the earlier columns' updates left them, with the less squared error;
        under MSE search (MR-GPTQ) the least ``Σ |w − q|^p`` of the rule's E4M3 scale and
        its two neighbouring E4M3 values (MX's ±1 binade, in E4M3's steps)."""
        assert self.tensor_scale is not None
        raw = (amax.float() / E2M1_MAX) / self.tensor_scale
        rule = self._nvfp4_total(raw)
        candidates = [rule]
        if self.fmt.scale_mode == "4over6":
            candidates.append(self._nvfp4_total(raw * FOUR_OVER_SIX_EXPANSION))
        if self.search == "mse":
            code = raw.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
            code = code.view(torch.uint8).to(torch.int16)
            for step in (-1, 1):  # E4M3's positive normals have consecutive codes
                near = (code + step).clamp(_E4M3_MIN_NORMAL_CODE, _E4M3_MAX_CODE)
                near = near.to(torch.uint8).view(torch.float8_e4m3fn).float()
                candidates.append((near * self.tensor_scale).double())
        return self._least_error(block, candidates, self.norm if self.search == "mse" else 2.0)

    def _least_error(
        self, block: torch.Tensor, candidates: list[torch.Tensor], norm: float | None = None
    ) -> torch.Tensor:
        """Each row's scale, of the ``candidates`` ``[N, 1]``, that rounds ``block`` with the
        least ``Σ |w − q|^p`` (``p``: ``norm``, else ``mse_norm``); a tie keeps the first."""
        p = self.norm if norm is None else norm
        best, best_err = candidates[0], None
        for scale in candidates:
            err = (block - self.round(block / scale) * scale).abs().pow(p).sum(1, keepdim=True)
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best = torch.where(better, scale, best)
            best_err = torch.where(better, err, best_err)
        return best

    def _nvfp4_total(self, s: torch.Tensor) -> torch.Tensor:
        """NVFP4's total scale (float64) of raw block scales ``s``: E4M3-rounded, times the
        tensor scale, as :func:`torq.formats.reference.nvfp4_quantize_blocks` forms it."""
        s = s.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        return (s * self.tensor_scale).double()

    def quantize(self, column: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Round a column ``[N]`` with its rows' scales ``[N]``; back in float64."""
        return self.round(column / scale) * scale

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """Elements in units of their scale, onto the format's element grid."""
        if self.fmt.name == "mxint4":
            return round_to_int4(v)
        if self.fmt.name == "mxfp8":
            return round_to_e4m3(v)
        return round_to_e2m1(v)


def _quantize_columns(
    grid: _BlockGrid,
    w1: torch.Tensor,
    h1: torch.Tensor,
    q1: torch.Tensor,
    err1: torch.Tensor,
    loss: torch.Tensor,
    first: int,
    order: Any,
    k: int,
    block: int,
    static: torch.Tensor | None,
    scale: torch.Tensor,
) -> torch.Tensor:
    """GPTQ's inner loop (Frantar et al., Alg. 1) over the columns ``first…`` of one lazy
    batch, in place: ``w1`` the batch's weights (updated as columns are quantized), ``h1``
    its block of the inverse Hessian's Cholesky factor; writes the quantized columns into
    ``q1``, the scaled errors into ``err1`` and adds the proxy loss to ``loss``. Returns the
    scale in use after the batch."""
    for i in range(w1.shape[1]):
        orig = order[first + i]
        if static is not None:
            scale = static[:, orig // block : orig // block + 1]
        elif orig % block == 0:
            # the block's columns as the earlier columns' updates left them; a lazy
            # batch is a whole number of blocks, so the block lies inside it
            scale = grid.scales(w1[:, i : i + min(block, k - orig)])
        wc = w1[:, i]
        qc = grid.quantize(wc, scale[:, 0])
        q1[:, i] = qc
        d = h1[i, i]
        e = (wc - qc) / d
        loss += ((wc - qc) ** 2).sum() / d**2
        w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
        err1[:, i] = e
    return scale


# CUDA graphs for GPTQ's column loop (off: every batch runs eagerly, as on a CPU)
USE_CUDA_GRAPHS = True


def _graphs_usable(w: torch.Tensor, k: int, static: torch.Tensor | None, cfg: GPTQConfig) -> bool:
    """Whether the column loop may run as a CUDA graph: on a GPU, columns in block order
    (no ``act_order``), blocks that tile the width."""
    return USE_CUDA_GRAPHS and w.is_cuda and static is None and k >= cfg.lazy_batch


class _BatchGraph:
    """The column loop of one full lazy batch captured once as a CUDA graph on fixed
    buffers, replayed for every full batch of a weight (the loop's kernels depend only on
    the column's place in the batch, since a batch is a whole number of blocks)."""

    def __init__(
        self, grid: _BlockGrid, n: int, width: int, block: int, loss: torch.Tensor
    ) -> None:
        like = {"dtype": torch.float64, "device": loss.device}
        self.w1 = torch.zeros(n, width, **like)
        self.h1 = torch.eye(width, **like)
        self.q1 = torch.zeros(n, width, **like)
        self.err1 = torch.zeros(n, width, **like)
        self.loss = loss
        scale = torch.ones(n, 1, **like)
        order = range(width)

        def body(total: torch.Tensor) -> None:
            _quantize_columns(
                grid, self.w1, self.h1, self.q1, self.err1, total, 0, order, width, block,
                None, scale,
            )  # fmt: skip

        # one eager pass on a side stream first (lazy initialisation is not captured)
        stream = torch.cuda.Stream(loss.device)
        stream.wait_stream(torch.cuda.current_stream(loss.device))
        with torch.cuda.stream(stream):
            body(torch.zeros_like(loss))
        torch.cuda.current_stream(loss.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body(loss)

    @classmethod
    def build(
        cls, grid: _BlockGrid, n: int, width: int, block: int, loss: torch.Tensor
    ) -> _BatchGraph | None:
        """The graph, or ``None`` where it cannot be captured (the loop then runs eagerly)."""
        try:
            return cls(grid, n, width, block, loss)
        except RuntimeError:
            return None

    def run(self, w1: torch.Tensor, h1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: its weights and inverse-Hessian block in, ``(q1, err1)`` out (the
        graph's buffers, valid until the next run); the proxy loss added to ``loss``."""
        self.w1.copy_(w1)
        self.h1.copy_(h1)
        self.graph.replay()
        return self.q1, self.err1


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: FormatSpec,
    config: GPTQConfig | None = None,
    cross: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Quantize ``weight [N, K]`` with GPTQ on ``fmt``'s grid (Frantar et al., Alg. 1).

    ``hessian [K, K]`` is ``Σ x xᵀ`` (any positive scale) over the layer's calibration
    inputs. Returns the de-quantized weight (on the grid, in ``weight``'s dtype) and a record
    with GPTQ's proxy loss ``½ Σ (w − q)² / [L]_jj²`` (``L`` the Cholesky factor of ``H⁻¹``).
    With ``config.asymmetry > 0``, ``cross`` is ``C = Σ (x − x̃) x̃ᵀ`` (the same scale as
    ``hessian``, whose inputs are the quantized model's ``x̃``) and GPTQ starts from GPTAQ's
    target ``W + α W C H⁻¹`` (module doc); without ``cross`` it is GPTQ. ``tensor_scale``:
    NVFP4's FP32 tensor scale (default: the weight's own).
    """
    cfg = config or GPTQConfig()
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    if not torch.isfinite(hessian).all():
        raise ValueError("the Hessian holds NaN or Inf")
    block = fmt.block_size
    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float64).clone()
    grid = _BlockGrid(fmt, w, cfg, tensor_scale)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    # On the diagonal in place: the same sums as adding λI, without a k×k identity.
    h.diagonal().add_(cfg.damp * damp_reference(h, cfg.damp_scale))
    record: dict[str, float] = {}
    if cross is not None and cfg.asymmetry > 0:
        if cross.shape != (k, k):
            raise ValueError(f"the cross term must be [{k}, {k}], got {tuple(cross.shape)}")
        c = cross.detach().to(device=w.device, dtype=torch.float64)
        # Tᵀ = Wᵀ + α H⁻¹ (W C)ᵀ, H the damped Hessian (symmetric), by its Cholesky factor
        shift = torch.cholesky_solve((w @ c).T, torch.linalg.cholesky(h)).T
        shift[:, dead] = 0.0
        full = float(shift.norm() / w.norm().clamp_min(1e-30))
        record["asymmetric_shift"] = cfg.asymmetry * full
        if full <= cfg.max_shift:
            w += cfg.asymmetry * shift
        else:
            record["asymmetric_shift_refused"] = 1.0

    # Static scales (act_order): fitted from the original weight, block by block.
    n_blocks = (k + block - 1) // block
    static = (
        torch.cat([grid.scales(w[:, b * block : (b + 1) * block]) for b in range(n_blocks)], 1)
        if cfg.act_order
        else None
    )
    perm = torch.argsort(torch.diag(h), descending=True) if cfg.act_order else None
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]

    # the order on the host: reading it from a GPU tensor column by column would wait for
    # the device at every column
    order = perm.tolist() if perm is not None else range(k)
    hinv = torch.linalg.cholesky(h)
    hinv = torch.cholesky_inverse(hinv)
    hinv = torch.linalg.cholesky(hinv, upper=True)

    q_all = torch.zeros_like(w)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    scale = torch.ones(n, 1, dtype=torch.float64, device=w.device)
    # on a GPU the column loop of a whole lazy batch is one CUDA graph (the same kernels in
    # the same order: the same numbers), since launching its ~30 small kernels per column
    # from Python costs more than they compute
    graphed = (
        _BatchGraph.build(grid, n, cfg.lazy_batch, block, loss)
        if _graphs_usable(w, k, static, cfg)
        else None
    )
    for i1 in range(0, k, cfg.lazy_batch):
        i2 = min(i1 + cfg.lazy_batch, k)
        if graphed is not None and i2 - i1 == cfg.lazy_batch:
            q1, err1 = graphed.run(w[:, i1:i2], hinv[i1:i2, i1:i2])
        else:
            w1 = w[:, i1:i2].clone()
            q1, err1 = torch.zeros_like(w1), torch.zeros_like(w1)
            scale = _quantize_columns(
                grid, w1, hinv[i1:i2, i1:i2], q1, err1, loss, i1, order, k, block, static, scale
            )
        q_all[:, i1:i2] = q1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        inverse = torch.argsort(perm)
        q_all = q_all[:, inverse]
    return q_all.to(weight.dtype), {"proxy_loss": float(loss) / 2, **record}
