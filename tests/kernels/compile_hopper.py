"""Compile the activation pre-pass kernels for Hopper (sm_90) without a GPU: Triton's
front end and ptxas, both scale rules. Run as a script, outside Triton's interpreter (the
test suite sets TRITON_INTERPRET=1, under which ``@triton.jit`` makes no compilable
function); prints one line a kernel and rule, ``ok`` or the error."""

from __future__ import annotations

import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import torq.kernels.triton_mxfp4 as tk
from torq.kernels import config as kc

BP, BB = kc.TORQ_PREPASS_TILE
# each kernel's pointer types and constexprs as the launchers give them (bf16 activations)
CASES = {
    "_mx_quantize_i8_kernel": (
        {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32"},
        {"PDL": False, "BM": 1, "BK": 512},
    ),
    "_mx_quantize_torq_i8_kernel": (
        {
            "x_ptr": "*bf16",
            "cs_ptr": "*fp32",
            "r_inter_ptr": "*fp32",
            "r_intra_ptr": "*fp32",
            "q_ptr": "*i8",
            "s_ptr": "*fp32",
        },
        {
            "HAS_SCALE": True,
            "HAS_INTER": True,
            "HAS_INTRA": True,
            "TRANS_INTRA": False,
            "PDL": False,
            "BA": BP,
            "BB": BB,
        },
    ),
    "_mx_gemv_i8_kernel": (
        {
            "x_ptr": "*bf16",
            "xq_ptr": "*i32",
            "xs_ptr": "*fp32",
            "t_ptr": "*fp32",
            "w_ptr": "*i32",
            "w_scales_ptr": "*u8",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
            "ws_ptr": "*fp32",
            "count_ptr": "*i32",
        },
        {
            "FUSED_QUANT": True,
            "HAS_T": True,
            "HAS_BIAS": False,
            "SPLIT_K": 1,
            "EVEN_K": True,
            "USE_ASM": True,
            "PREFETCH": True,
            "PDL": False,
            "STREAM": False,
            "BN": 16,
            "BK": 512,
        },
    ),
    "_mx_quantize_kernel": (
        {"x_ptr": "*bf16", "t_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8"},
        {"HAS_T": True, "WRITE_VALUES": False, "PERMUTED": False, "BM": 4, "BK": 64},
    ),
    "_mx_matmul_kernel": (
        {
            "a_ptr": "*bf16",
            "a_scales_ptr": "*bf16",
            "t_ptr": "*bf16",
            "w_ptr": "*u8",
            "w_scales_ptr": "*u8",
            "bias_ptr": "*bf16",
            "out_ptr": "*bf16",
        },
        {
            "A_MODE": 0,
            "HAS_T": True,
            "HAS_BIAS": True,
            "SPLIT_K": 1,
            "DOT_BF16": True,
            "DOT_SCALED": False,
            "EVEN_K": True,
            "SWAP_AB": False,
            "BM": 16,
            "BN": 32,
            "BK": 64,
        },
    ),
    "_mx_quantize_fp8_kernel": (
        {"x_ptr": "*bf16", "t_ptr": "*bf16", "out_ptr": "*u8", "row_scale_ptr": "*fp32"},
        {"HAS_T": True, "ONE_TILE": False, "HW_FP8": True, "BM": 4, "BK": 1024},
    ),
}


def compile_for_hopper(name: str, nearest: bool) -> None:
    fn = getattr(tk, name)
    pointers, constants = CASES[name]
    constants = {**constants, "NEAREST": nearest}
    signature, constexprs = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(fn.arg_names.index(p.name),)] = constants[p.name]
        else:
            signature[p.name] = pointers.get(p.name, "i32")
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    if "cubin" not in compiled.asm:
        raise RuntimeError("no cubin")


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in CASES:
        for nearest in (False, True):
            try:
                compile_for_hopper(name, nearest)
                print(f"{name} nearest={nearest} ok", flush=True)
            except Exception as exc:  # reported, and the test fails on it
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"{name} nearest={nearest} {type(exc).__name__}: {first}", flush=True)


if __name__ == "__main__":
    main()
