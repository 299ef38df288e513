"""GPTQ over a whole ``down_proj`` against GPTQ on each of its ``E`` slices of inputs alone,
as each expert of a MoE made from the dense MLP gets it (``benchmarks/moe_from_dense.py``):
the squared relative output error ``‖(W − Q) h‖² / ‖W h‖²`` of SmolLM2-135M's ``down_proj``
(weights only, MXFP4) on one held-back calibration window, for RTN, GPTQ on all inputs and
GPTQ per slice, one line per layer.

    TORQ_DATA_DIR=../shared/data .venv/bin/python -m benchmarks.diagnostics.gptq_split 5 10 20

Environment: ``E`` slices (default 8), ``NC`` calibration windows (default 3: all but the
last fit the Hessian), ``T`` threads (default 1).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.diagnostics.diag_common import calib_windows, setup
from torq.experimental import GPTQConfig, fake_quantize, get_format, gptq_quantize


def down_inputs(model: torch.nn.Module, index: int, windows: torch.Tensor) -> list[torch.Tensor]:
    """Layer ``index``'s ``down_proj`` inputs, one ``[tokens, width]`` tensor a window."""
    inputs: list[torch.Tensor] = []

    def keep(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inputs.append(args[0].reshape(-1, args[0].shape[-1]).double())

    hook = model.model.layers[index].mlp.down_proj.register_forward_pre_hook(keep)
    try:
        for w in windows:
            model(input_ids=w[None])
    finally:
        hook.remove()
    return inputs


def output_error(weight: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``‖(W − Q) h‖² / ‖W h‖²`` over the tokens ``h``."""
    return float(((h @ (weight - q).T).norm() / (h @ weight.T).norm()) ** 2)


def split_gptq(weight: torch.Tensor, hessian: torch.Tensor, slices: int) -> torch.Tensor:
    """GPTQ on each of ``slices`` equal slices of the inputs alone (its own Hessian block)."""
    fmt, width = get_format("mxfp4"), weight.shape[1] // slices
    parts = []
    for e in range(slices):
        cut = slice(e * width, (e + 1) * width)
        q, _ = gptq_quantize(weight[:, cut], hessian[cut, cut], fmt, GPTQConfig())
        parts.append(q)
    return torch.cat(parts, 1)


@torch.no_grad()
def main(layers: list[int]) -> None:
    lm = setup(1)
    model = lm.model.eval()
    windows = calib_windows(lm, 3)
    slices = int(os.environ.get("E", "8"))
    fmt = get_format("mxfp4")
    for index in layers:
        inputs = down_inputs(model, index, windows)
        fit, test = torch.cat(inputs[:-1]), inputs[-1]
        weight = model.model.layers[index].mlp.down_proj.weight.double()
        whole, _ = gptq_quantize(weight, fit.T @ fit / fit.shape[0], fmt, GPTQConfig())
        split = split_gptq(weight, fit.T @ fit / fit.shape[0], slices)
        rtn = fake_quantize(weight.float(), fmt).double()
        print(
            f"layer {index}: RTN {output_error(weight, rtn, test):.5f}, GPTQ on all "
            f"{weight.shape[1]} inputs {output_error(weight, whole, test):.5f}, GPTQ per "
            f"slice of {weight.shape[1] // slices} {output_error(weight, split, test):.5f}",
            flush=True,
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [5, 10, 20])
