"""What a GPU's TF32 calibration costs a model's accuracy, measured on a CPU: ``torq run``
with TF32's rounding emulated wherever a CUDA GPU would take TF32 products.

    python -m benchmarks.diagnostics.tf32_emulation --out tf32.json -- \\
        --methods default --max-windows 16 --calib-arithmetic tf32

Everything after ``--`` is ``torq run``'s arguments. On a GPU, ``--calib-arithmetic tf32``
(:func:`torq.calibration.capture.calibration_arithmetic`) turns on
``torch.backends.cuda.matmul.allow_tf32`` for the calibration's forward passes and
statistics: cuBLAS then rounds each float32 operand of a product to TF32 (a 10-bit
significand) and accumulates in float32. On a CPU the flag changes nothing, so here every
float32 matrix product (``linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``,
``baddbmm``, ``einsum``, and the query, key and value of ``scaled_dot_product_attention``)
taken while the flag is on has its operands rounded to TF32 first, to nearest, ties to
even. What this does not copy: a GPU's summation order, and whether a given cuBLAS kernel
rounds or truncates (truncation's error is about twice as large; one of each is about what
``tests/calibration/test_capture.py``'s GPU test allows). Writes ``--out`` (``torq run``'s
record with this command and the emulation added) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torq.experimental import read_record, write_record

# the products whose every tensor argument is an operand, and those whose first is added
OPERANDS = {
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
    torch.einsum,
}
ADDED_FIRST = {torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}


def round_to_tf32(x: Any) -> Any:
    """``x`` (a float32 tensor; anything else is returned as is) with its significand
    rounded to TF32's 10 bits, to nearest, ties to even (float32's 13 lowest bits)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    return rounded.view(torch.float32).view(x.shape)


class EmulatedTF32(TorchFunctionMode):
    """Round the operands of float32 products to TF32 while
    ``torch.backends.cuda.matmul.allow_tf32`` is on (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if torch.backends.cuda.matmul.allow_tf32:
            if func in OPERANDS:
                args = tuple(round_to_tf32(a) for a in args)
                if func is torch.einsum and len(args) == 2 and isinstance(args[1], list | tuple):
                    args = (args[0], [round_to_tf32(a) for a in args[1]])
            elif func in ADDED_FIRST:
                args = (args[0], *(round_to_tf32(a) for a in args[1:3]), *args[3:])
            elif func is F.scaled_dot_product_attention:
                args = tuple(round_to_tf32(a) if i < 3 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the record (JSON; markdown beside it)")
    args = ap.parse_args(argv[:split])
    run_args = argv[split + 1 :]
    from torq.experimental import main as torq_main

    out = Path(args.out)
    with EmulatedTF32():
        status = torq_main(["run", *run_args, "--out", str(out)])
    if status:
        raise SystemExit(status)
    record = read_record(out)
    record["command"] = "python -m benchmarks.diagnostics.tf32_emulation " + " ".join(argv)
    record["emulation"] = (
        "TF32 rounding (10-bit significand, nearest-even) of every float32 product's "
        "operands while torch.backends.cuda.matmul.allow_tf32 is on, on the CPU"
    )
    write_record(out, record)
    lines = [
        f"Command: `{record['command']}`",
        "",
        "| method | perplexity | quantize s |",
        "| --- | ---: | ---: |",
    ]
    for row in record["rows"]:
        lines.append(f"| {row['method']} | {row['ppl']:.3f} | {row['quantize_seconds']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
