"""Layer-by-layer calibration capture: statistics of every linear-layer input group.

The model is run one decoder layer at a time over all calibration windows (as GPTQ does),
so peak memory is the model, one layer's hidden states for the calibration set, and the
statistics — never all activations of all layers.

For each *group* of linear layers that read the same tensor (q/k/v; gate/up; o_proj;
down_proj; discovered by identity of the input tensor, so no per-architecture table is
needed) two statistics are streamed:

* the ``K`` per-position block covariances ``Σ_k = E[x[:, k] x[:, k]ᵀ]`` (``B×B``, float64),
  the input of the inter-block rotation (§5.1);
* a bounded uniform random sample of whole token vectors (reservoir sampling), from which
  the intra-block solver (§5.2) draws its blocks after the inter-block rotation.

``sequential=True`` feeds each layer the outputs of the already-quantized earlier layers;
``sequential=False`` feeds it the float model's activations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from torq.models.architecture import decoder_layers


class _StopForward(Exception):
    pass


@dataclass
class LinearGroup:
    """Linear layers of one decoder layer that read the same input tensor."""

    name: str
    members: list[str]
    width: int


class BlockStatistics:
    """Streaming ``Σ_k`` (per-position block covariance) and a token reservoir for one group."""

    def __init__(
        self, width: int, block_size: int, reservoir: int, seed: int, hessian: bool = False
    ) -> None:
        if width % block_size:
            raise ValueError(
                f"input width {width} is not a multiple of the block size {block_size}"
            )
        self.width = width
        self.block_size = block_size
        self.n_blocks = width // block_size
        self.cov = torch.zeros(block_size, self.n_blocks, self.n_blocks, dtype=torch.float64)
        self.count = 0
        self.capacity = reservoir
        self.sample = torch.empty(0, width, dtype=torch.float32)
        self._seen = 0
        self._gen = torch.Generator().manual_seed(seed)
        # Σ x xᵀ over the tokens (float64), for GPTQ; only when asked for
        self.xtx = torch.zeros(width, width, dtype=torch.float64) if hessian else None

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.width)
        if not torch.isfinite(x).all():
            raise ValueError("calibration activations contain NaN or Inf")
        xb = x.to(torch.float64).reshape(-1, self.n_blocks, self.block_size)
        self.cov += torch.einsum("tbk,tck->kbc", xb, xb).cpu()
        if self.xtx is not None:
            x64 = xb.reshape(-1, self.width)
            self.xtx += (x64.T @ x64).cpu()
        self.count += x.shape[0]
        self._reservoir(x.float().cpu())

    def _reservoir(self, x: torch.Tensor) -> None:
        free = self.capacity - self.sample.shape[0]
        if free > 0:
            self.sample = torch.cat([self.sample, x[:free]])
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
            self.sample[slots[keep]] = x[keep]
        self._seen += x.shape[0]

    def covariance(self) -> torch.Tensor:
        """``Σ_k`` as an expectation (``[K, B, B]``)."""
        return self.cov / max(self.count, 1)

    def hessian(self) -> torch.Tensor:
        """``E[x xᵀ]`` (``[d, d]``, float64): GPTQ's Hessian up to a constant factor."""
        if self.xtx is None:
            raise ValueError("these statistics were captured without the Hessian")
        return self.xtx / max(self.count, 1)


@dataclass
class CaptureTimes:
    forward_seconds: float = 0.0
    solve_seconds: float = 0.0
    per_layer: list[dict[str, float]] = field(default_factory=list)


def capture_layer_inputs(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 1
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states entering decoder layer 0 for every batch of windows, and each layer's kwargs.

    All windows have the same length and no padding, so each layer's keyword arguments
    (position embeddings, attention mask, ...) are the same for every batch; they are read
    per layer from one full forward, because layers may differ (Gemma 3 alternates sliding
    and global attention, with their own masks and rotary tables).
    """
    layers = decoder_layers(model)
    hidden: list[torch.Tensor] = []
    layer_kwargs: list[dict[str, Any]] = [{} for _ in layers]
    first = True
    device = next(model.parameters()).device

    def make_hook(index: int) -> Callable[[nn.Module, tuple, dict], None]:
        def grab(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if index == 0:
                hidden.append((args[0] if args else kwargs["hidden_states"]).detach())
            if first:
                kw = {
                    k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values")
                }
                kw["use_cache"] = False
                layer_kwargs[index] = kw
            else:
                raise _StopForward

        return grab

    handles = [
        layer.register_forward_pre_hook(make_hook(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], batch_size):
                with contextlib.suppress(_StopForward):
                    model(input_ids=windows[i : i + batch_size].to(device), use_cache=False)
                first = False
    finally:
        for h in handles:
            h.remove()
    return hidden, layer_kwargs


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


LayerSolver = Callable[
    [int, nn.Module, list[LinearGroup], dict[str, BlockStatistics]], dict[str, Any]
]


@torch.no_grad()
def calibrate_layerwise(
    model: nn.Module,
    windows: torch.Tensor,
    solve_layer: LayerSolver,
    block_size: int = 32,
    reservoir: int = 2048,
    sequential: bool = False,
    seed: int = 0,
    progress: bool = True,
    hessian: bool = False,
) -> tuple[list[dict[str, Any]], CaptureTimes]:
    """Capture statistics layer by layer and let ``solve_layer`` transform each layer in place.

    ``solve_layer(index, layer, groups, stats)`` builds and fuses the layer's transforms and
    quantizes it; it returns a JSON-able record. With ``sequential`` the next layer's inputs
    are recomputed through the quantized layer; otherwise they come from the float layer.
    With ``hessian`` each group's statistics also hold ``Σ x xᵀ`` (for GPTQ).
    """
    times = CaptureTimes()
    t0 = time.perf_counter()
    hidden, layer_kwargs = capture_layer_inputs(model, windows)
    times.forward_seconds += time.perf_counter() - t0
    layers = decoder_layers(model)
    records = []
    bar = tqdm(total=len(layers), desc="calibrate", unit="layer", disable=not progress, leave=False)
    for li, layer in enumerate(layers):
        t_fwd = time.perf_counter()
        kwargs = layer_kwargs[li]
        groups = discover_groups(layer, hidden[0], kwargs)
        stats = {
            g.name: BlockStatistics(
                g.width, block_size, reservoir, seed=seed * 1000 + li * 10 + gi, hessian=hessian
            )
            for gi, g in enumerate(groups)
        }
        modules = dict(layer.named_modules())
        handles = []
        for g in groups:

            def hook(_m: nn.Module, args: tuple, _s: BlockStatistics = stats[g.name]) -> None:
                _s.update(args[0])

            handles.append(modules[g.members[0]].register_forward_pre_hook(hook))
        outputs = []
        try:
            for hs in hidden:
                out = _layer_output(layer(hs, **kwargs))
                if not sequential:
                    outputs.append(out)
        finally:
            for h in handles:
                h.remove()
        fwd = time.perf_counter() - t_fwd
        t_solve = time.perf_counter()
        record = solve_layer(li, layer, groups, stats)
        solve = time.perf_counter() - t_solve
        if sequential:
            t_seq = time.perf_counter()
            outputs = [_layer_output(layer(hs, **kwargs)) for hs in hidden]
            fwd += time.perf_counter() - t_seq
        hidden = outputs
        times.forward_seconds += fwd
        times.solve_seconds += solve
        times.per_layer.append({"forward_seconds": fwd, "solve_seconds": solve})
        records.append({"layer": li, "groups": [g.__dict__ for g in groups], **record})
        bar.update(1)
    bar.close()
    return records, times
