"""The TORQ transform ``T`` in its structured form, applied online and fused offline.

An activation ``x ∈ R^d``, ``d = B·K``, is viewed as a ``B×K`` matrix (block ``b`` is
elements ``b·K … b·K+K−1``). The forward transform (Algorithm 3, steps 2–3) is

    ``Y[:, k] = R_k X[:, k]``  (inter-block, one ``B×B`` per position ``k``),
    ``Z = Y R_intra``          (intra-block, one ``K×K`` shared by all blocks),

costing ``O(d·(B + K))`` per token instead of a dense ``d×d`` product. Because ``T`` is
orthogonal, ``W' = W Tᵀ`` (Algorithm 3, step 5, option B) satisfies ``W' T x = W x``;
row ``o`` of ``W'`` is ``T`` applied to row ``o`` of ``W``, so fusion reuses the forward.

Optionally a per-channel scale ``s`` runs first (``x ↦ R (x ⊘ s)``, torq's balancing
step, :mod:`torq.rotations.balance`). ``T`` is then no longer orthogonal; the fused weight
is ``W' = W T⁻¹ = W diag(s) Rᵀ`` (row ``o``: ``R (w_o ⊙ s)``), so still ``W' T x = W x``.

Optionally a channel permutation ``π`` runs after the scale (``x ↦ R P_π (x ⊘ s)``,
``(P_π x)_i = x_{π(i)}``): which channels share a block (:mod:`torq.rotations.balance`'s
block-mass balancing). Then ``W' = W diag(s) P_πᵀ Rᵀ``: the columns of ``W diag(s)`` gathered
by ``π`` before the rotations.

:class:`BlockRotation` is the one online-transform interface: it applies ``T``
(``forward``), fuses ``T⁻¹`` into a weight (:meth:`~BlockRotation.fuse_inverse`),
conjugates a GPTQ Hessian (:meth:`~BlockRotation.conjugate_hessian`), drops the channel
scale that a preceding norm absorbed (:meth:`~BlockRotation.without_channel_scale`), says
what form the GPU kernels and compressed-tensors can take it in
(:meth:`~BlockRotation.kernel_form`), and is saved and loaded as its buffers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from torq.rotations.hadamard import hadamard_matrix

# What the kernels can take a transform as (BlockRotation.kernel_form): one block matrix for
# every block (inside any kernel, and compressed-tensors' transform), the integer GEMV's
# fused TORQ pre-pass, or only as this module run before the kernel.
KernelForm = Literal["block_matrix", "prepass", "module"]


# the online transforms a checkpoint can hold, by the ``kind`` its manifest names: each
# class answers for itself what it saves (``saved_state``) and how it is built back
# (``from_saved``), so saving and reading loop over this table (:func:`saved_transform`,
# :func:`transform_from_saved`) and a new transform is its class alone
SAVED_TRANSFORMS: dict[str, type[nn.Module]] = {}
_T = TypeVar("_T", bound=type)


def saved_as(kind: str) -> Callable[[_T], _T]:
    """Register an online transform class under ``kind`` in :data:`SAVED_TRANSFORMS`."""

    def register(cls: _T) -> _T:
        if kind in SAVED_TRANSFORMS:
            raise ValueError(f"online transform kind '{kind}' is registered twice")
        cls.kind = kind  # type: ignore[attr-defined]
        SAVED_TRANSFORMS[kind] = cls
        return cls

    return register


def saved_transform(t: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What a checkpoint keeps of the online transform ``t``: its manifest entry (its
    ``kind`` and shape) and its tensors by name; a transform of no registered kind is
    refused with a message naming the kinds."""
    kind = getattr(type(t), "kind", None)
    if SAVED_TRANSFORMS.get(kind) is not type(t):
        raise ValueError(
            f"cannot save an online transform of type {type(t).__name__}; the kinds saved "
            f"are {', '.join(c.__name__ for c in SAVED_TRANSFORMS.values())}"
        )
    entry, tensors = t.saved_state()  # type: ignore[operator]
    return {"kind": kind, **entry, "tensors": list(tensors)}, tensors


def transform_from_saved(entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The online transform of a manifest ``entry`` and its ``tensors`` (an entry without a
    kind, as the first checkpoints wrote, is a :class:`BlockRotation`)."""
    kind = entry.get("kind", "block_rotation")
    if kind not in SAVED_TRANSFORMS:
        raise ValueError(
            f"unknown online transform kind '{kind}'; known: {', '.join(SAVED_TRANSFORMS)}"
        )
    return SAVED_TRANSFORMS[kind].from_saved(entry, tensors)  # type: ignore[attr-defined]


@saved_as("block_rotation")
class BlockRotation(nn.Module):
    """The online forward transform ``z = T x`` (channel scale, inter-block, intra-block)."""

    def __init__(
        self,
        block_size: int,
        r_inter: torch.Tensor | None = None,
        r_intra: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        channel_scale: torch.Tensor | None = None,
        intra_factors: Sequence[torch.Tensor] | None = None,
        channel_perm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if r_inter is None and r_intra is None and channel_scale is None and channel_perm is None:
            raise ValueError("BlockRotation needs an inter-block or an intra-block rotation")
        if channel_perm is not None:
            n = channel_perm.numel()
            if (
                channel_perm.dim() != 1
                or channel_perm.dtype != torch.int64
                or n % block_size
                or not torch.equal(
                    torch.sort(channel_perm).values, torch.arange(n, device=channel_perm.device)
                )
            ):
                raise ValueError(
                    f"channel_perm must be an int64 permutation of 0..d-1 with d a multiple of "
                    f"{block_size}, got {tuple(channel_perm.shape)} {channel_perm.dtype}"
                )
            if channel_scale is not None and channel_scale.numel() != n:
                raise ValueError("channel_perm and channel_scale differ in width")
        if channel_scale is not None:
            if channel_scale.dim() != 1 or channel_scale.numel() % block_size:
                raise ValueError(
                    f"channel_scale must be 1-D with a multiple of {block_size} entries, "
                    f"got {tuple(channel_scale.shape)}"
                )
            if not (torch.isfinite(channel_scale).all() and (channel_scale > 0).all()):
                raise ValueError("channel_scale must be finite and positive")
        if r_inter is not None and (
            r_inter.dim() != 3
            or r_inter.shape[0] != block_size
            or r_inter.shape[1] != r_inter.shape[2]
        ):
            raise ValueError(f"r_inter must be [K={block_size}, B, B], got {tuple(r_inter.shape)}")
        if r_intra is not None and tuple(r_intra.shape) != (block_size, block_size):
            raise ValueError(
                f"r_intra must be [{block_size}, {block_size}], got {tuple(r_intra.shape)}"
            )
        factors = list(intra_factors or [])
        if len(factors) > 2:
            raise ValueError(f"at most two intra_factors are supported, got {len(factors)}")
        if factors:
            if r_intra is None:
                raise ValueError("intra_factors need the r_intra they factor")
            kron = factors[0].to(torch.float64)
            for f in factors[1:]:
                kron = torch.kron(kron, f.to(torch.float64))
            if kron.shape != r_intra.shape or not torch.allclose(
                kron, r_intra.to(torch.float64), atol=1e-6
            ):
                raise ValueError("the Kronecker product of intra_factors is not r_intra")
        self.block_size = block_size
        self.n_factors = len(factors) if len(factors) > 1 else 0
        for i, f in enumerate(factors if self.n_factors else []):
            self.register_buffer(f"intra_factor{i}", f.to(dtype).contiguous(), persistent=False)
        self.n_blocks = r_inter.shape[1] if r_inter is not None else None
        self.register_buffer("r_inter", None if r_inter is None else r_inter.to(dtype).contiguous())
        self.register_buffer("r_intra", None if r_intra is None else r_intra.to(dtype).contiguous())
        if channel_scale is not None and self.n_blocks is None:
            self.n_blocks = channel_scale.numel() // block_size
        self.register_buffer(
            "channel_scale",
            None if channel_scale is None else channel_scale.to(dtype).contiguous(),
        )
        if channel_perm is not None:
            # registered only when there is one: modules saved before it existed, and
            # accelerate's offload (which cannot place a None buffer), see none
            self.register_buffer("channel_perm", channel_perm.contiguous())
            if self.n_blocks is None:
                self.n_blocks = channel_perm.numel() // block_size

    @classmethod
    def from_checked(
        cls,
        block_size: int,
        channel_scale: torch.Tensor | None,
        r_inter: torch.Tensor | None,
        r_intra: torch.Tensor | None,
    ) -> BlockRotation:
        """The transform of a :class:`BlockRotation` made (and so checked) before, around its
        very tensors, without a permutation or Kronecker factors: no checks, no copies. A
        check reads a value back from the device, which a CUDA graph's capture forbids; this
        is how :mod:`torq.kernels.ops` rebuilds a layer's transform inside an operator."""
        t = cls.__new__(cls)
        nn.Module.__init__(t)
        t.block_size = block_size
        t.n_factors = 0
        t.n_blocks = (
            r_inter.shape[1]
            if r_inter is not None
            else None
            if channel_scale is None
            else channel_scale.numel() // block_size
        )
        t.register_buffer("r_inter", r_inter)
        t.register_buffer("r_intra", r_intra)
        t.register_buffer("channel_scale", channel_scale)
        return t

    def kernel_form(self, block: int = 32) -> KernelForm:
        """What the kernels of ``block``-element MX blocks can take ``T`` as:

        * ``"block_matrix"``: one ``block×block`` intra-block matrix shared by every block
          (no channel scale, permutation or inter-block rotation): any kernel runs it
          inside, and compressed-tensors writes it as a transform;
        * ``"prepass"``: channel scale, inter- and intra-block rotations on blocks of
          ``block``, no permutation (the pre-pass has no gather): the integer GEMV's fused
          TORQ pre-pass (Algorithm 3 in one kernel);
        * ``"module"``: anything else, run as this module before the kernel."""
        if self.block_size != block or getattr(self, "channel_perm", None) is not None:
            return "module"
        if self.r_inter is None and self.channel_scale is None and self.r_intra is not None:
            return "block_matrix"
        return "prepass"

    # the tensors a checkpoint keeps of it, those it has
    SAVED_TENSORS = (
        "r_inter",
        "r_intra",
        "channel_scale",
        "intra_factor0",
        "intra_factor1",
        "channel_perm",
    )

    def saved_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Its manifest entry and tensors (:func:`saved_transform`)."""
        tensors = {
            n: v.detach().cpu().contiguous()
            for n in self.SAVED_TENSORS
            if isinstance(v := getattr(self, n, None), torch.Tensor)
        }
        return {"block_size": self.block_size, "n_blocks": self.n_blocks}, tensors

    @classmethod
    def from_saved(cls, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> BlockRotation:
        """Built back from :meth:`saved_state`'s entry and tensors."""
        factors = [tensors[n] for n in ("intra_factor0", "intra_factor1") if n in tensors]
        dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
        return cls(
            entry["block_size"],
            r_inter=tensors.get("r_inter"),
            r_intra=tensors.get("r_intra"),
            dtype=dtype,
            channel_scale=tensors.get("channel_scale"),
            intra_factors=factors or None,
            channel_perm=tensors.get("channel_perm"),
        )

    def served_form(self) -> str | None:
        """What compressed-tensors calls this transform: ``"had32"`` when it is the
        32-block Hadamard alone, else ``None`` (:meth:`unserved_reason` says why)."""
        if self.kernel_form(32) == "block_matrix" and torch.equal(
            self.r_intra.cpu(), hadamard_matrix(32, dtype=self.r_intra.dtype)
        ):
            return "had32"
        return None

    def unserved_reason(self) -> str:
        """What in it compressed-tensors cannot hold, in words."""
        if self.channel_scale is not None:
            return "torq's channel balancing, done online (quantize with --fold-balance to fold it)"
        return "TORQ's calibrated rotations or QuaRot's full-width Hadamard"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        k = self.block_size
        if d % k or (self.n_blocks is not None and d != self.n_blocks * k):
            raise ValueError(
                f"input width {d} does not match the transform's {self.n_blocks}×{k} blocks"
            )
        lead = x.shape[:-1]
        perm = getattr(self, "channel_perm", None)
        scaled = False
        if perm is not None:
            if self.channel_scale is not None:
                x = x / self.channel_scale.to(x.dtype)
            x = x[..., perm]
            scaled = True
            if self.r_inter is None and self.r_intra is None:
                return x
        if self.r_inter is not None:
            return self._inter_first(x.reshape(-1, d // k, k), scaled).reshape(*lead, d)
        if self.channel_scale is not None and not scaled:
            x = x / self.channel_scale.to(x.dtype)
        y = x.reshape(-1, d // k, k)
        # getattr: a module pickled before the factored path existed has no n_factors
        if getattr(self, "n_factors", 0):
            y = self._kronecker_intra(y.reshape(-1, k))
        elif self.r_intra is not None:
            y = y @ self.r_intra.to(y.dtype)
        return y.reshape(*lead, d)

    @torch.no_grad()
    def fuse_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """``W' = W T⁻¹`` (Algorithm 3, option B: ``W Tᵀ`` for an orthogonal ``T``), computed
        in float64 and returned in W's dtype. With a channel scale ``s``, ``T⁻¹ = diag(s) Rᵀ``."""
        w64 = weight.detach().to(torch.float64)
        if self.channel_scale is not None:
            scale = self.channel_scale.to(device=w64.device, dtype=torch.float64)
            # in place on the float64 copy (the same products; one weight-sized copy fewer)
            own = w64.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
            w64 = w64.mul_(scale) if own else w64 * scale
        perm = getattr(self, "channel_perm", None)
        if perm is not None:
            w64 = w64[:, perm.to(w64.device)]
        if self.r_inter is None and self.r_intra is None:
            return w64.to(weight.dtype)
        t64 = BlockRotation(
            self.block_size,
            None if self.r_inter is None else self.r_inter.to(torch.float64),
            None if self.r_intra is None else self.r_intra.to(torch.float64),
            dtype=torch.float64,
        ).to(weight.device)
        return t64(w64).to(weight.dtype)

    @torch.no_grad()
    def conjugate_hessian(self, h: torch.Tensor) -> torch.Tensor:
        """``T H Tᵀ``: GPTQ's Hessian of the transformed inputs ``T x`` from that of ``x``
        (``H`` symmetric), in ``H``'s dtype and on its device."""
        # a copy in H's dtype and on H's device: moving or casting ``self`` would change the
        # caller's online module
        t = self
        dev = next((b.device for b in self.buffers()), None)
        floats = [b for b in self.buffers() if b.is_floating_point()]
        if (dev is not None and dev != h.device) or (floats and floats[0].dtype != h.dtype):
            t = copy.deepcopy(self).to(h.device)
            for name, b in list(t.named_buffers()):
                if b.is_floating_point():
                    setattr(t, name, b.to(h.dtype))
        th = t(h)  # rows of H transformed: (T Hᵀ)ᵀ = H Tᵀ since H is symmetric
        return t(th.T.contiguous())

    def without_channel_scale(self) -> BlockRotation | None:
        """``R`` (with the permutation, if any) of ``T x = R P (x ⊘ s)``: what stays online
        once ``⊘ s`` is done by the module that produces ``x`` (:mod:`torq.rotations.fold`);
        ``None`` when ``T`` is the scale alone. The rotations are the same tensors (same
        dtype, same values)."""
        perm = getattr(self, "channel_perm", None)
        if self.r_inter is None and self.r_intra is None and perm is None:
            return None
        return self.with_channel_scale(None)

    def with_channel_scale(self, channel_scale: torch.Tensor | None) -> BlockRotation:
        """This transform's rotations and permutation (the same tensors) with another
        channel scale (``None``: none)."""
        factors = [getattr(self, f"intra_factor{i}") for i in range(self.n_factors)]
        dtype = next((r.dtype for r in (self.r_inter, self.r_intra) if r is not None), None)
        dtype = dtype or torch.float32
        out = BlockRotation(
            self.block_size,
            self.r_inter,
            self.r_intra,
            dtype=dtype,
            channel_scale=None if channel_scale is None else channel_scale.to(dtype),
            intra_factors=factors or None,
            channel_perm=getattr(self, "channel_perm", None),  # stays online with the rotations
        )
        if out.n_blocks is None and self.n_blocks is not None:
            out.n_blocks = self.n_blocks  # the width check the scale gave
        return out

    def _kronecker_intra(self, y: torch.Tensor) -> torch.Tensor:
        """``y R_intra`` for ``R_intra = A ⊗ B``: with each row viewed as an ``a×b`` matrix
        ``Y``, the product is ``Aᵀ Y B``, i.e. ``n·k·(a + b)`` multiply-adds instead of
        ``n·k²``. ``Y B`` is one product over all rows; ``Aᵀ`` then acts on the ``a`` axis
        of a position-major copy, and a last copy restores token order."""
        fa = self.intra_factor0.to(y.dtype)
        fb = self.intra_factor1.to(y.dtype)
        n, k = y.shape
        a, b = fa.shape[0], fb.shape[0]
        yb = torch.mm(y.reshape(n * a, b), fb)
        z = torch.mm(fa.T, yb.view(n, a, b).transpose(0, 1).reshape(a, n * b))
        return z.view(a, n, b).transpose(0, 1).reshape(n, k)

    def _inter_first(self, x: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """``x [t, B, K]`` → ``T x`` as ``[t·B, K]`` (or ``[t, B, K]`` without ``R_intra``) in
        three passes over the activation: one copy to position-major ``[K, t, B]`` (with
        the channel scale divided in on the way), one batched product with the ``R_k``,
        and the intra-block product, which reads the position-major result transposed and
        writes the token-major output directly."""
        assert self.r_inter is not None
        k, t, b = x.shape[2], x.shape[0], x.shape[1]
        src = x.permute(2, 0, 1)  # [K, t, B], a view
        scale = None
        if self.channel_scale is not None and not scaled:  # (``scaled``: done already)
            scale = self.channel_scale.to(x.dtype).view(b, k).T[:, None, :]
        if x.requires_grad and torch.is_grad_enabled():
            xc = (src if scale is None else src / scale).contiguous()
        else:
            xc = torch.empty((k, t, b), dtype=x.dtype, device=x.device)
            if scale is None:
                xc.copy_(src)
            else:
                torch.div(src, scale, out=xc)
        # y[k, t, a] = Σ_b x[t, b, k] R_k[a, b]
        y = torch.bmm(xc, self.r_inter.to(x.dtype).transpose(1, 2))
        del xc  # (before the intra-block product: one activation-sized copy fewer at a time)
        if self.r_intra is None:
            return y.permute(1, 2, 0)
        # z[(t, a), j] = Σ_k y[k, (t, a)] R_intra[k, j]
        return torch.mm(y.view(k, t * b).T, self.r_intra.to(x.dtype))
