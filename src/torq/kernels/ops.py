"""torq's W4A4 product as a PyTorch operator, ``torch.ops.torq.mxfp4_linear``.

``torch.compile`` cannot trace into a Triton launch chosen in Python by token count, so
without an operator each of torq's layers would be a graph break: the decoder layer split
into pieces compiled apart (and, since a layer's index is a constant of the key-value
cache's update, the piece after each break compiled once per layer). Registered with
``torch.library.custom_op`` and a shape function, the product is one node of the graph:
the whole model compiles as one graph (``fullgraph=True``) around it, and the node runs
:func:`~torq.kernels.dispatch.mxfp4_linear` (the Triton kernels on a GPU, the reference on a
CPU) on the layer's own tensors.

The online transform goes in as tensors when the kernels can run it
(:func:`~torq.kernels.launch.fusable_in_prepass`: a channel scale and inter- and
intra-block rotations on blocks of 32, fused into the integer GEMV's pre-pass); any other
transform is run by its module before the operator, compiled with the model's code.
"""

from __future__ import annotations

import torch

from torq.kernels.config import BLOCK
from torq.kernels.dispatch import mxfp4_linear
from torq.kernels.weight import MXFP4Weight
from torq.rotations.transform import BlockRotation

# written out, not inferred from the annotations: older torch (2.4) cannot read annotations
# that `from __future__ import annotations` leaves as strings
SCHEMA = (
    "(Tensor x, Tensor codes, Tensor scales, SymInt in_features, Tensor? bias, "
    "Tensor? block_transform, Tensor? channel_scale, Tensor? r_inter, Tensor? r_intra, "
    "Tensor? fp8_row_exponents, Tensor? fp8_row_scale, bool fp8_exact, bool nearest, "
    "str backend) -> Tensor"
)


@torch.library.custom_op("torq::mxfp4_linear", mutates_args=(), schema=SCHEMA)
def mxfp4_linear_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    channel_scale: torch.Tensor | None,
    r_inter: torch.Tensor | None,
    r_intra: torch.Tensor | None,
    fp8_row_exponents: torch.Tensor | None,
    fp8_row_scale: torch.Tensor | None,
    fp8_exact: bool,
    nearest: bool,
    backend: str,
) -> torch.Tensor:
    """``y = Q(T x) · Q(W)ᵀ + b`` (Algorithm 3, option B) for a packed MXFP4 ``W``
    (``codes``, ``scales``; :class:`~torq.kernels.weight.MXFP4Weight`), ``T`` the
    transform of ``channel_scale``, ``r_inter`` and ``r_intra`` (none: no transform), as
    :func:`~torq.kernels.dispatch.mxfp4_linear` computes it."""
    weight = MXFP4Weight(codes, scales, in_features, fp8_row_exponents, fp8_exact, fp8_row_scale)
    rotation = None
    if channel_scale is not None or r_inter is not None or r_intra is not None:
        rotation = BlockRotation.from_checked(BLOCK, channel_scale, r_inter, r_intra)
    return mxfp4_linear(
        x,
        weight,
        bias,
        block_transform,
        backend=backend,  # type: ignore[arg-type]
        rotation=rotation,
        nearest=nearest,
    )


@mxfp4_linear_op.register_fake
def _(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    *_args: object,
) -> torch.Tensor:
    """The output's shape and dtype: ``x``'s leading dimensions, one column per weight row."""
    return x.new_empty((*x.shape[:-1], codes.shape[0]))
