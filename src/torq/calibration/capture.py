"""Layer-by-layer calibration capture: statistics of every linear-layer input group.

The layer-streaming driver (:mod:`torq.driver`) runs the model one decoder layer at a time
over all calibration windows (as GPTQ does) and calls :func:`capture_layer` on each layer,
so memory holds one layer's hidden states for the calibration set and its statistics —
never all activations of all layers.

For each *group* of linear layers that read the same tensor (q/k/v; gate/up; o_proj;
down_proj; discovered by identity of the input tensor, so no per-architecture table is
needed) two statistics are streamed:

* the ``K`` per-position block covariances ``Σ_k = E[x[:, k] x[:, k]ᵀ]`` (``B×B``, float64),
  the input of the inter-block rotation (§5.1);
* a bounded uniform random sample of whole token vectors (reservoir sampling), from which
  the intra-block solver (§5.2) draws its blocks after the inter-block rotation.

Fused MoE experts (one 3-D weight per projection, :func:`~torq.surgery.qlinear.
is_fused_experts`) are an :class:`ExpertsGroup` with :class:`ExpertsStatistics`: the expert
input (the hidden state every expert reads, all tokens) as one group, and each expert's
``down_proj`` input (that expert's ``act(gate)·up`` on the tokens routed to it) per expert
and pooled over the experts.

``sequential=True`` feeds each layer the outputs of the already-quantized earlier layers;
``sequential=False`` feeds it the float model's activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torq.calibration.data import ARITHMETICS
from torq.calibration.hidden import HiddenStates
from torq.models.architecture import is_fused_experts
from torq.models.streaming import ModelLayers, embed_windows


@dataclass
class LinearGroup:
    """Linear layers of one decoder layer that read the same input tensor."""

    name: str
    members: list[str]
    width: int


class BlockStatistics:
    """Streaming ``Σ_k`` (per-position block covariance) and a token reservoir for one group."""

    def __init__(
        self,
        width: int,
        block_size: int,
        reservoir: int,
        seed: int,
        hessian: bool = False,
        cross: bool = False,
        device: torch.device | str = "cpu",
        products: torch.dtype = torch.float64,
    ) -> None:
        if width % block_size:
            raise ValueError(
                f"input width {width} is not a multiple of the block size {block_size}"
            )
        self.width = width
        # the dtype of each batch's products (float64: exact; float32: TF32 on a CUDA GPU
        # under ``calibration_arithmetic("tf32")``); the sums are float64 either way
        self.products = products
        self.block_size = block_size
        self.n_blocks = width // block_size
        # the sums live on ``device``, where the activations are (an update from elsewhere
        # moves them there): on a GPU they are summed there, never copied to the host per
        # batch (an 8B down_proj's Σ x xᵀ is 1.6 GB)
        like = {"dtype": torch.float64, "device": device}
        self.cov = torch.zeros(block_size, self.n_blocks, self.n_blocks, **like)
        self.count = 0
        self.capacity = reservoir
        self.sample = torch.empty(0, width, dtype=torch.float32)
        self._seen = 0
        self._gen = torch.Generator().manual_seed(seed)
        # Σ x xᵀ over the tokens (float64), for GPTQ; only when asked for
        self.xtx = torch.zeros(width, width, **like) if hessian else None
        # Σ (x_float − x) xᵀ with the float model's inputs beside these (GPTAQ's cross term,
        # :func:`torq.surgery.gptq.gptq_quantize`); only when asked for
        self.xtx_cross = torch.zeros(width, width, **like) if cross else None
        # the tokens the cross term has seen: those with the float model's inputs beside them
        self.cross_count = 0

    @property
    def device(self) -> torch.device:
        """Where the sums are kept (and :meth:`hessian` and :meth:`cross_term` are returned)."""
        return self.cov.device

    def _to(self, device: torch.device) -> None:
        self.cov = self.cov.to(device)
        if self.xtx is not None:
            self.xtx = self.xtx.to(device)
        if self.xtx_cross is not None:
            self.xtx_cross = self.xtx_cross.to(device)

    @torch.no_grad()
    def update(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        """Add the tokens ``x``; with the cross term, ``reference`` holds the float model's
        inputs of the same tokens (``None``: these tokens add to the Hessian only)."""
        x = x.detach().reshape(-1, self.width)
        if not torch.isfinite(x).all():
            raise ValueError("calibration activations contain NaN or Inf")
        if x.device != self.cov.device:
            self._to(x.device)
        xb = x.to(self.products).reshape(-1, self.n_blocks, self.block_size)
        self.cov += torch.einsum("tbk,tck->kbc", xb, xb).to(torch.float64)
        xp = xb.reshape(-1, self.width)
        if self.xtx is not None:
            self.xtx += (xp.T @ xp).to(torch.float64)
        if self.xtx_cross is not None and reference is not None:
            diff = reference.detach().reshape(-1, self.width).to(self.products) - xp
            self.xtx_cross += (diff.T @ xp).to(torch.float64)
            self.cross_count += x.shape[0]
        self.count += x.shape[0]
        self._reservoir(x)

    def _reservoir(self, x: torch.Tensor) -> None:
        """Algorithm R over the tokens ``x`` (on any device): only the rows the sample
        takes are copied to the host."""
        free = self.capacity - self.sample.shape[0]
        if free > 0:
            self.sample = torch.cat([self.sample, x[:free].float().cpu()])
            self._seen += min(free, x.shape[0])
            x = x[free:]
        if x.shape[0] == 0:
            return
        # Algorithm R, vectorized: the s-th item seen (1-based) replaces a uniformly random
        # slot with probability capacity / s.
        seen = self._seen + torch.arange(1, x.shape[0] + 1, dtype=torch.float64)
        slots = (torch.rand(x.shape[0], generator=self._gen, dtype=torch.float64) * seen).long()
        keep = slots < self.capacity
        if keep.any():
            # Several items of one batch may draw the same slot; in Algorithm R the last of
            # them holds it. An indexed assignment with repeated indices leaves the winner
            # to the threads (a different sample from run to run), so the winner is chosen
            # first: the largest item index per slot (a max, whatever order it is taken in).
            items = torch.nonzero(keep).squeeze(1)
            winner = torch.full((self.capacity,), -1, dtype=torch.long)
            winner.scatter_reduce_(0, slots[items], items, reduce="amax")
            taken = torch.nonzero(winner >= 0).squeeze(1)
            rows = winner[taken]
            self.sample[taken] = x[rows.to(x.device)].float().cpu()
        self._seen += x.shape[0]

    def covariance(self) -> torch.Tensor:
        """``Σ_k`` as an expectation (``[K, B, B]``), on the CPU (small: the inter-block
        solver takes it to its own device)."""
        return self.cov.cpu() / max(self.count, 1)

    def hessian(self) -> torch.Tensor:
        """``E[x xᵀ]`` (``[d, d]``, float64, on :attr:`device`): GPTQ's Hessian up to a
        constant factor."""
        if self.xtx is None:
            raise ValueError("these statistics were captured without the Hessian")
        return self.xtx / max(self.count, 1)

    def cross_term(self) -> torch.Tensor | None:
        """``E[(x_float − x) xᵀ]`` (``[d, d]``, float64, on :attr:`device`; the Hessian's
        scale), over the tokens that had the float model's inputs beside them, or ``None``
        when captured without them."""
        if self.xtx_cross is None:
            return None
        if self.count and not self.cross_count:
            raise ValueError("the cross term needs the float model's inputs")
        return self.xtx_cross / max(self.cross_count, 1)


@dataclass
class ExpertsGroup(LinearGroup):
    """A fused-experts module (``members``: its one path in the layer); ``width`` is the
    hidden size its experts read, ``intermediate`` each expert's ``down_proj`` input."""

    num_experts: int = 0
    intermediate: int = 0


class ExpertsStatistics:
    """The statistics of one :class:`ExpertsGroup` (module doc): ``input`` over all tokens;
    ``down[e]`` over expert ``e``'s routed tokens and ``down_shared`` over every routed
    (token, expert) pair; with ``hessian``, ``input_per_expert[e]`` holds ``Σ x xᵀ`` of the
    tokens routed to ``e`` (GPTQ's Hessian of that expert's ``gate_up_proj``; no sample)."""

    def __init__(
        self,
        group: ExpertsGroup,
        block_size: int,
        reservoir: int,
        seed: int,
        hessian: bool,
        products: torch.dtype = torch.float64,
    ) -> None:
        h, i, e = group.width, group.intermediate, group.num_experts

        def child(k: int) -> int:  # a stable seed for each expert's statistics
            return seed * 1000 + k + 1

        def stats(width: int, res: int, s: int, hess: bool = False) -> BlockStatistics:
            return BlockStatistics(width, block_size, res, s, hessian=hess, products=products)

        self.input = stats(h, reservoir, seed)
        self.down_shared = stats(i, reservoir, child(e))
        self.down = [stats(i, reservoir, child(k), hessian) for k in range(e)]
        self.input_per_expert = (
            [stats(h, 0, child(e + 1 + k), True) for k in range(e)] if hessian else None
        )

    @torch.no_grad()
    def update(
        self,
        experts: nn.Module,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        _top_k_weights: torch.Tensor | None = None,
    ) -> None:
        """One call of ``experts(hidden, top_k_index, top_k_weights)``: its input, and each
        chosen expert's ``down_proj`` input recomputed from the float weights."""
        x = hidden.reshape(-1, hidden.shape[-1])
        self.input.update(x)
        for e in torch.unique(top_k_index).tolist():
            if e < 0 or e >= len(self.down):
                continue
            tokens = torch.where(top_k_index == e)[0]
            xe = x[tokens]
            if self.input_per_expert is not None:
                self.input_per_expert[e].update(xe)
            gate, up = torch.nn.functional.linear(xe, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = experts.act_fn(gate) * up
            self.down[e].update(h)
            self.down_shared.update(h)


def discover_experts(layer: nn.Module) -> list[ExpertsGroup]:
    """The layer's fused-experts modules as groups."""
    out = []
    for name, mod in layer.named_modules():
        if is_fused_experts(mod):
            e, two_i, h = mod.gate_up_proj.shape
            out.append(
                ExpertsGroup(
                    name=name.rsplit(".", 1)[-1],
                    members=[name],
                    width=int(h),
                    num_experts=int(e),
                    intermediate=int(two_i) // 2,
                )
            )
    return out


def capture_layer_inputs(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 1
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states entering decoder layer 0 for every batch of windows, and each layer's
    kwargs (:func:`torq.models.streaming.embed_windows` on the model in memory)."""
    return embed_windows(ModelLayers(model), windows, batch_size)


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def discover_groups(
    layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]
) -> list[LinearGroup]:
    """Group the layer's linears by the identity of the tensor they read (one probe forward)."""
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}
    handles = []
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(_m: nn.Module, args: tuple, _name: str = name) -> None:
                x = args[0]
                entry = seen.setdefault(id(x), (x, []))
                entry[1].append(_name)

            handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            layer(hidden[:1, :8], **_slice_kwargs(kwargs, 8))
    finally:
        for h in handles:
            h.remove()
    groups = []
    for x, members in seen.values():
        name = "+".join(m.rsplit(".", 1)[-1] for m in members)
        groups.append(LinearGroup(name=name, members=members, width=x.shape[-1]))
    return groups


def _slice_kwargs(kwargs: dict[str, Any], length: int) -> dict[str, Any]:
    """Trim sequence-shaped keyword arguments to the first ``length`` positions."""
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k == "position_embeddings" and isinstance(v, tuple):
            out[k] = tuple(t[..., :length, :] for t in v)
        elif k == "attention_mask" and isinstance(v, torch.Tensor):
            out[k] = v[..., :length, :length]
        elif k in ("position_ids", "cache_position") and isinstance(v, torch.Tensor):
            out[k] = v[..., :length]
        elif isinstance(v, dict):
            out[k] = {
                kk: (
                    vv[..., :length, :length]
                    if isinstance(vv, torch.Tensor) and vv.dim() >= 2
                    else vv
                )
                for kk, vv in v.items()
            }
        else:
            out[k] = v
    return out


@contextmanager
def calibration_arithmetic(arithmetic: str) -> Iterator[None]:
    """The matrix products of a calibration step: ``"exact"`` turns TF32 off on CUDA
    (float32 forwards are float32 whatever the process set), ``"tf32"`` turns it on (the
    float32 products of the forwards and of the float32 statistics run as TF32 on a GPU
    that has it: about 7× float32's rate on a Hopper GPU, inputs rounded to 10 mantissa
    bits). The CPU has no TF32: there only the statistics' dtype differs. The previous
    settings come back on exit."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(
            f"calibration arithmetic must be one of {', '.join(ARITHMETICS)}, got {arithmetic!r}"
        )
    on = arithmetic == "tf32"
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


LayerSolver = Callable[
    [int, nn.Module, list[LinearGroup], dict[str, BlockStatistics]], dict[str, Any]
]


@torch.no_grad()
def capture_layer(
    index: int,
    layer: nn.Module,
    hidden: list[torch.Tensor] | HiddenStates,
    kwargs: dict[str, Any],
    block_size: int = 32,
    reservoir: int = 2048,
    seed: int = 0,
    hessian: bool = False,
    keep_outputs: bool = True,
    reference: list[torch.Tensor] | HiddenStates | None = None,
    arithmetic: str = "exact",
) -> tuple[list[LinearGroup], dict[str, Any], Any]:
    """One layer of the capture: its input groups (linears, then fused experts), their
    statistics (:class:`BlockStatistics`; :class:`ExpertsStatistics`) over ``hidden`` (every
    calibration batch) and, with ``keep_outputs``, the layer's outputs (the next layer's
    inputs). Group ``gi`` of layer ``index`` samples its reservoir with the seed
    ``seed·1000 + index·10 + gi``: a stable identity, whatever ran before.

    With ``reference`` (the float model's states of the same windows, ``hidden`` being the
    quantized model's), each linear group also sums GPTAQ's cross term from the float
    layer's inputs on ``reference`` (:meth:`BlockStatistics.cross_term`; fused experts: none),
    and the outputs returned are the float layer's on ``reference`` (the float model's next
    states; the quantized ones come from the layer once quantized).

    ``arithmetic`` (:data:`torq.calibration.data.ARITHMETICS`) sets the forwards' and the
    statistics' products (:func:`calibration_arithmetic`)."""
    products = torch.float32 if arithmetic == "tf32" else torch.float64
    groups: list[LinearGroup] = list(discover_groups(layer, hidden[0], kwargs))
    experts = discover_experts(layer)
    # the groups' sums where the layer computes (its inputs are there)
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    stats: dict[str, Any] = {
        g.name: BlockStatistics(
            g.width,
            block_size,
            reservoir,
            seed=seed * 1000 + index * 10 + gi,
            hessian=hessian,
            cross=reference is not None,
            device=device,
            products=products,
        )
        for gi, g in enumerate(groups)
    }
    modules = dict(layer.named_modules())
    handles = []
    # while the float model's states go through, each group's input is only held, for the
    # same tokens of the quantized model's states that follow
    held: dict[str, torch.Tensor] = {}
    holding = [False]
    for g in groups:

        def hook(
            _m: nn.Module, args: tuple, _s: BlockStatistics = stats[g.name], _n: str = g.name
        ) -> None:
            if holding[0]:
                held[_n] = args[0].detach()
            else:
                _s.update(args[0], held.pop(_n, None))

        handles.append(modules[g.members[0]].register_forward_pre_hook(hook))
    for gi, g in enumerate(experts, start=len(groups)):
        stats[g.name] = ExpertsStatistics(
            g, block_size, reservoir, seed * 1000 + index * 10 + gi, hessian, products
        )

        def experts_hook(m: nn.Module, args: tuple, _s: ExpertsStatistics = stats[g.name]) -> None:
            if not holding[0]:
                _s.update(m, *args)

        handles.append(modules[g.members[0]].register_forward_pre_hook(experts_hook))
    groups += experts
    outputs: Any = hidden.empty_like() if isinstance(hidden, HiddenStates) else []
    # the float model's states may cover only the first batches (``--gptaq-windows``): the
    # later ones add to the Hessian, not to the cross term
    if reference is not None and len(reference) > len(hidden):
        raise ValueError(f"{len(reference)} float batches for {len(hidden)} quantized ones")
    n_ref = 0 if reference is None else len(reference)
    pairs = ((h, reference[i] if i < n_ref else None) for i, h in enumerate(hidden))
    try:
        with calibration_arithmetic(arithmetic):
            for hs, ref in pairs:
                if ref is not None:
                    holding[0] = True
                    outputs.append(_layer_output(layer(ref, **kwargs)))
                    holding[0] = False
                out = _layer_output(layer(hs, **kwargs))
                if keep_outputs and reference is None:
                    outputs.append(out)
                held.clear()
    finally:
        for h in handles:
            h.remove()
    return groups, stats, outputs


@torch.no_grad()
def layer_outputs(
    layer: nn.Module, hidden: list[torch.Tensor] | HiddenStates, kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """``layer`` applied to every batch of hidden states (into a store of the same kind,
    :class:`~torq.calibration.hidden.HiddenStates`, when they come in one)."""
    if isinstance(hidden, HiddenStates):
        out = hidden.empty_like()
        for hs in hidden:
            out.append(_layer_output(layer(hs, **kwargs)))
        return out  # type: ignore[return-value]
    return [_layer_output(layer(hs, **kwargs)) for hs in hidden]
