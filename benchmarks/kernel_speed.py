"""MXFP4 W4A4 kernels on a GPU: decode and prefill speed against bf16, bandwidth, memory,
the online transform's cost, and an end-to-end decode of a Llama-3-8B-shaped model.

Run on a CUDA machine: ``python -m benchmarks.kernel_speed --out results/bench_kernels.json``.
Every speed figure is a ratio against ``torch.nn.functional.linear`` in bf16 measured in
the same run. Timing: each measured call sequence is captured in a CUDA graph (so the
Python launch overhead is out, for bf16 and MXFP4 alike), cycling through enough copies of
the weights and inputs that they do not fit in L2; the graph is replayed many times, each
replay timed with CUDA events, and the median replay over the number of calls is the time
per call. Correctness of every kernel configuration is checked against the fake-quant
reference on the same run before it is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import save
from torq.experimental import (
    TUNED_CONFIGS,
    BlockRotation,
    KernelConfig,
    MXFP4Weight,
    dequantize_weight_fp8,
    hadamard_matrix,
    mxfp4_linear,
    quantize_activation,
    quantize_activation_fp8,
    reference_linear,
)
from torq.experimental import config as kernel_config

# Llama-3-8B: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, 32 layers.
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
}
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in K, out N)


def _k(bm, bn, bk, split=1, warps=4, stages=3, kind="dot", a_mode=0, swap=False) -> KernelConfig:
    return KernelConfig(bm, bn, bk, split, warps, stages, kind, a_mode, swap)


def _g(bn, bk, split=1, warps=4, a_mode=1, pf=True, pdl=False, stages=3, ev=False) -> KernelConfig:
    return KernelConfig(
        1, bn, bk, split, warps, stages, "gemv_i8", a_mode, False, pf, pdl, evict_first=ev
    )


# batch 1 only: the integer GEMV. With its int8 pre-pass (a_mode 1) the weight stream is
# the only work, so small tiles keep many loads in flight; quantizing in the matmul
# (a_mode 0) needs wide tiles and split-K to amortize it. ``pf``: the next weight tile is
# loaded before the current one is multiplied; ``pdl``: programmatic dependent launch.
# The versions measured before these are in docs/kernels.md.
GEMV_CANDIDATES = [
    _g(8, 1024, pf=False),
    _g(8, 1024),
    _g(8, 1024, pdl=True),
    _g(16, 1024, pf=False),
    _g(16, 1024, pf=False, pdl=True),
    _g(16, 1024),
    _g(4, 1024),
    _g(4, 1024, pdl=True),
    _g(8, 2048),
    _g(16, 2048),
    _g(16, 2048, pdl=True),
    _g(8, 512),
    _g(32, 1024, 4),
    _g(64, 512, 8, warps=8, a_mode=0, pf=False),
    # third GPU session: more launches with programmatic dependent launch, the evict-first
    # hint on the weight stream, one K tile per row at K = 4096, other stage counts
    _g(16, 1024, pf=False, pdl=True, ev=True),
    _g(16, 2048, pdl=True, ev=True),
    _g(4, 1024, pdl=True, ev=True),
    _g(8, 1024, pdl=True, ev=True),
    _g(32, 1024, pf=False, pdl=True),
    _g(16, 512, pf=False, pdl=True),
    _g(16, 2048, pf=False, pdl=True),
    _g(8, 2048, pdl=True),
    _g(16, 1024, warps=8, pf=False, pdl=True),
    _g(32, 1024, warps=8, pf=False, pdl=True),
    _g(8, 4096, pdl=True),
    _g(4, 4096, pdl=True),
    _g(4, 4096, pf=False, pdl=True),
    _g(16, 4096, warps=8, pf=False, pdl=True),
    _g(16, 1024, pf=False, pdl=True, stages=1),
    _g(16, 1024, pf=False, pdl=True, stages=4),
    _g(8, 1024, pdl=True, stages=1),
    _g(16, 1024, pdl=True, ev=True),
    _g(16, 2048, pf=False, pdl=True, ev=True),
    _g(32, 1024, pf=False, pdl=True, ev=True),
    _g(8, 2048, pdl=True, ev=True),
    _g(4, 4096, pf=False, pdl=True, ev=True),
    _g(8, 512, pdl=True, ev=True),
    _g(16, 1024, warps=8, pf=False, pdl=True, ev=True),
    _g(4, 4096, pf=False, pdl=True, ev=True, warps=2),
    _g(4, 4096, pf=False, pdl=True, ev=True, warps=8),
    _g(2, 4096, pf=False, pdl=True, ev=True),
    _g(8, 4096, pf=False, pdl=True, ev=True),
    _g(4, 4096, pf=False, pdl=True, ev=True, stages=1),
    _g(4, 2048, pf=False, pdl=True, ev=True),
    # one launch: each program quantizes its own K range (no pre-pass), split-K
    _g(64, 512, 8, warps=8, a_mode=0, pf=False, ev=True),
    _g(64, 256, 16, warps=8, a_mode=0, pf=False, ev=True),
    _g(32, 512, 8, a_mode=0, pf=False, ev=True),
    _g(32, 1024, 4, a_mode=0, pf=False, ev=True),
    _g(64, 1024, 4, warps=8, a_mode=0, pf=False, ev=True),
    _g(128, 512, 8, warps=8, a_mode=0, pf=False, ev=True),
    _g(64, 256, 8, a_mode=0, pf=False),
    _g(64, 512, 4, warps=8, a_mode=0),
]


def _r(rows, bn, bk, warps=4, pf=True, pdl=True, ev=False) -> KernelConfig:
    return KernelConfig(rows, bn, bk, 1, warps, 3, "gemv_i8", 1, False, pf, pdl, evict_first=ev)


# 2–4 tokens: the integer GEMV with one weight lookup shared by the tokens
ROWS_CANDIDATES = [
    _r(4, 8, 1024),
    _r(4, 16, 1024),
    _r(4, 16, 1024, pf=False),
    _r(4, 32, 512),
    _r(4, 16, 512),
    _r(4, 8, 512),
    _r(4, 32, 1024, warps=8),
    _r(4, 16, 2048),
    _r(4, 8, 1024, ev=True),
    _r(4, 16, 1024, ev=True),
    _r(4, 16, 1024, pf=False, ev=True),
    _r(4, 16, 2048, ev=True),
    _r(4, 32, 1024, warps=8, ev=True),
]
DECODE_CANDIDATES = [
    _k(16, 64, 256, split=2, a_mode=2, swap=True),
    _k(16, 64, 256, split=4, a_mode=2, swap=True),
    _k(16, 64, 512, split=4, a_mode=0, swap=True),
    _k(16, 64, 256, kind="dot_scaled", a_mode=2),
    _k(16, 32, 256, split=2, kind="dot_scaled", a_mode=2),
    _k(16, 32, 256, split=4, kind="dot_scaled", a_mode=2),
    _k(16, 16, 256, split=4, kind="dot_scaled", a_mode=2),
    _k(16, 32, 256, split=4, a_mode=2),
    _k(16, 16, 512, split=4, a_mode=2),
    _k(16, 32, 256, split=4, a_mode=0),
    _k(16, 32, 256, split=4, kind="dot_scaled", a_mode=0),
]


def _f(bm, bk, w_tile=(32, 256), warps=4, fast=False) -> KernelConfig:
    return KernelConfig(bm, 0, bk, 1, warps, 3, "fp8_gemm", w_tile=w_tile, fast_accum=fast)


PREFILL_CANDIDATES = [
    # FP8 path: E4M3 operands with power-of-two row scales, the row-scaled FP8 GEMM
    # one activation row per program, read once (block_k ≥ K); exact and fast accumulation
    _f(1, 4096, (32, 512), warps=8),
    _f(1, 4096, (32, 512), warps=8, fast=True),
    _f(1, 16384, (32, 512), warps=8),
    _f(1, 16384, (32, 512), warps=8, fast=True),
    _f(1, 4096, (32, 256), warps=8),
    _f(1, 16384, (32, 256), warps=8),
    _f(1, 4096, (8, 1024), warps=8),
    _f(1, 4096),
    _f(4, 1024),  # four rows per program, two passes over each row
    # bf16 path: MXFP4 values in bf16, the bf16 GEMM (and hand-written tensor-core kernels)
    _k(0, 0, 32, kind="dequant_gemm"),
    _k(32, 256, 32, kind="dequant_gemm", a_mode=1),
    _k(16, 512, 32, kind="dequant_gemm", a_mode=1),
    _k(64, 256, 32, kind="dequant_gemm", a_mode=1),
    _k(64, 512, 32, kind="dequant_gemm"),
    _k(16, 1024, 32, kind="dequant_gemm", a_mode=1),
    _k(128, 128, 64, warps=8, a_mode=2, swap=True),
    _k(128, 256, 64, warps=8, a_mode=2, swap=True),
    _k(256, 128, 64, warps=8, a_mode=2, swap=True),
    _k(128, 128, 128, warps=8, a_mode=2, swap=True),
    _k(128, 128, 64, warps=4, a_mode=2, swap=True),
    _k(128, 128, 64, warps=8, a_mode=2),
    _k(256, 128, 64, warps=8, a_mode=2),
    _k(128, 256, 64, warps=8, a_mode=2),
    _k(128, 128, 64, warps=8, stages=4, a_mode=2),
    _k(128, 128, 32, warps=8, stages=4, a_mode=2),
    _k(256, 128, 32, warps=8, stages=4, a_mode=2),
    _k(128, 128, 128, warps=8, kind="dot_scaled", a_mode=2),
]
# (output blocks per program, input blocks per step) tried for the fused TORQ pre-pass
TORQ_TILES = [(2, 64), (4, 64), (8, 64), (2, 128), (4, 128), (4, 32), (1, 128)]
L2_FLUSH_BYTES = 4 * 50 * 2**20  # cycle through > 4× a 50 MB L2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def graph_time(calls: list[Callable[[], object]], replays: int = 50) -> float:
    """Median seconds per call of ``calls`` captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def measured_bandwidth() -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a device-to-device copy of 1 GiB counting bytes
    read plus written, and a sum over 2 GiB (bytes read)."""
    n = 2**30 // 2
    src = torch.empty(2 * n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    t_copy = graph_time([lambda: dst.copy_(src[:n])], replays=20)
    acc = torch.empty((), dtype=torch.float32, device="cuda")
    t_read = graph_time([lambda: torch.sum(src, dim=0, dtype=torch.float32, out=acc)], replays=20)
    return 4 * n / t_copy, 4 * n / t_read


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(L2_FLUSH_BYTES / nbytes))


def make_weights(k: int, n: int, copies: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [
        (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16() for _ in range(copies)
    ]


def sweep(
    candidates: list[KernelConfig],
    pairs: list[tuple[torch.Tensor, MXFP4Weight]],
    ref: torch.Tensor,
    label: str,
) -> tuple[float, KernelConfig, float, list[dict[str, Any]]]:
    """Check each launch configuration against ``ref`` (the first pair's reference output),
    time the correct ones over ``pairs``; return the fastest (seconds, config, rel. error)
    and every try."""
    best: tuple[float, KernelConfig, float] | None = None
    tried = []
    for cfg in candidates:
        try:
            y = mxfp4_linear(pairs[0][0], pairs[0][1], config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # recorded in the JSON, the sweep goes on
            tried.append({"config": cfg.__dict__, "error": repr(exc)[:300]})
            print(f"  {label} {cfg}: FAILED {exc!r}"[:400], flush=True)
            continue
        err = rel_err(y.float(), ref)
        ok = err < 1e-2 and not torch.isnan(y).any()
        t = graph_time(
            [(lambda xx=xx, ww=ww, c=cfg: mxfp4_linear(xx, ww, config=c)) for xx, ww in pairs]
        )
        tried.append({"config": cfg.__dict__, "seconds": t, "rel_err": err, "ok": ok})
        print(
            f"  {label} {cfg.kind} a{cfg.a_mode} bm{cfg.block_m} bn{cfg.block_n} "
            f"bk{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} pf{int(cfg.prefetch)} "
            f"pdl{int(cfg.pdl)} ev{int(cfg.evict_first)} st{cfg.num_stages} wt{cfg.w_tile} "
            f"fa{int(cfg.fast_accum)}: "
            f"{t * 1e6:.1f} us err {err:.1e}{'' if ok else ' WRONG'}",
            flush=True,
        )
        if ok and (best is None or t < best[0]):
            best = (t, cfg, err)
    assert best is not None, f"no {label} configuration was correct"
    return (*best, tried)


def decode_and_prefill(
    bandwidth: float, quick: bool, batches: tuple[int, ...] = (1, 4, 16), prefill: bool = True
) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {"decode": [], "prefill": [], "configs": {}}
    for k, n in SHAPES:
        bf16_bytes = n * k * 2
        packed_bytes = n * k // 2 + n * k // 32
        copies = copies_for(packed_bytes)
        w_float = make_weights(k, n, copies, gen)
        w_packed = [MXFP4Weight.from_float(w) for w in w_float]
        for batch in batches:
            xs = [
                torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
                for _ in range(copies)
            ]
            ref_b = reference_linear(xs[0].float(), w_packed[0])
            pairs = list(zip(xs, w_packed, strict=True))
            small = GEMV_CANDIDATES if batch == 1 else ROWS_CANDIDATES if batch <= 4 else []
            candidates = small + DECODE_CANDIDATES
            t_q, cfg, err, tried = sweep(
                candidates[: 3 if quick else None], pairs, ref_b, f"decode {k}->{n}"
            )
            out["configs"][f"decode {k}->{n} batch {batch}"] = tried
            t_bf16 = graph_time(
                [
                    (lambda xx=xx, ww=ww: F.linear(xx, ww))
                    for xx, ww in zip(xs, w_float, strict=True)
                ]
            )
            TUNED_CONFIGS[(batch, n, k)] = cfg
            out["decode"].append(
                {
                    "shape": f"{k}->{n}",
                    "batch": batch,
                    "bf16_us": t_bf16 * 1e6,
                    "mxfp4_us": t_q * 1e6,
                    "speedup": t_bf16 / t_q,
                    "mxfp4_bw_fraction": (packed_bytes + batch * k * 2) / t_q / bandwidth,
                    "bf16_bw_fraction": (bf16_bytes + batch * k * 2) / t_bf16 / bandwidth,
                    "rel_err_vs_reference": err,
                    "config": cfg.__dict__,
                    "bytes_bf16": bf16_bytes,
                    "bytes_mxfp4": packed_bytes,
                }
            )
            print(out["decode"][-1], flush=True)
        if not prefill:
            continue
        # prefill at 2048 tokens
        m = 2048
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        ref_p = reference_linear(xs[0].float(), w_packed[0])
        t_bf16 = graph_time(
            [
                (lambda xx=xx, ww=ww: F.linear(xx, ww))
                for xx, ww in zip(xs, w_float[:2], strict=True)
            ]
        )
        bestp = sweep(
            PREFILL_CANDIDATES[: 2 if quick else None],
            list(zip(xs, w_packed[:2], strict=True)),
            ref_p,
            f"prefill {k}->{n}",
        )
        triedp = bestp[3]
        out["configs"][f"prefill {k}->{n}"] = triedp
        TUNED_CONFIGS[(m, n, k)] = bestp[1]
        t_pre = graph_time([(lambda xx=xx: quantize_activation(xx)) for xx in xs])
        ok_tries = [t for t in triedp if t.get("ok")]
        bf16_path = min(
            (t["seconds"] for t in ok_tries if t["config"]["kind"] != "fp8_gemm"), default=None
        )
        fp8_path = min(
            (t["seconds"] for t in ok_tries if t["config"]["kind"] == "fp8_gemm"), default=None
        )
        fp8_exact_path = min(
            (
                t["seconds"]
                for t in ok_tries
                if t["config"]["kind"] == "fp8_gemm" and not t["config"]["fast_accum"]
            ),
            default=None,
        )
        parts = fp8_parts(xs, w_packed[:2], bestp[1], ref_p) if bestp[1].kind == "fp8_gemm" else {}
        out["prefill"].append(
            {
                "shape": f"{k}->{n}",
                "tokens": m,
                "bf16_us": t_bf16 * 1e6,
                "mxfp4_us": bestp[0] * 1e6,
                "ratio_bf16_over_mxfp4": t_bf16 / bestp[0],
                "prepass_us": t_pre * 1e6,
                "bf16_path_us": None if bf16_path is None else bf16_path * 1e6,
                "fp8_path_us": None if fp8_path is None else fp8_path * 1e6,
                "fp8_exact_accum_path_us": None if fp8_exact_path is None else fp8_exact_path * 1e6,
                "ratio_bf16_over_fp8_exact_accum": None
                if fp8_exact_path is None
                else t_bf16 / fp8_exact_path,
                **parts,
                "bf16_tflops": 2 * m * n * k / t_bf16 / 1e12,
                "mxfp4_tflops": 2 * m * n * k / bestp[0] / 1e12,
                "rel_err_vs_reference": bestp[2],
                "config": bestp[1].__dict__,
            }
        )
        print(out["prefill"][-1], flush=True)
        del w_float, w_packed
        torch.cuda.empty_cache()
    return out


def fp8_parts(
    xs: list[torch.Tensor], ws: list[MXFP4Weight], cfg: KernelConfig, ref: torch.Tensor
) -> dict[str, float]:
    """The FP8 path's three steps timed alone (µs): activation pre-pass, weight decode, GEMM;
    and the GEMM's error against the reference rounded to bf16, with and without the fast
    (tensor-core only) accumulation."""
    a_tile, warps = (cfg.block_m, cfg.block_k), cfg.num_warps
    acts = [quantize_activation_fp8(x, None, a_tile, warps) for x in xs]
    dec = [dequantize_weight_fp8(w, cfg.w_tile, warps) for w in ws]

    def gemm(a: tuple[torch.Tensor, ...], d: tuple[torch.Tensor, ...], fast: bool) -> torch.Tensor:
        return torch._scaled_mm(
            a[0], d[0].T, a[1], d[1], out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    ref_bf16 = ref.bfloat16().float()
    res = {
        f"fp8_gemm_err_vs_bf16_ref_fast{int(fast)}": rel_err(
            gemm(acts[0], dec[0], fast).float(), ref_bf16
        )
        for fast in (False, True)
    }
    res["fp8_act_prepass_us"] = 1e6 * graph_time(
        [(lambda x=x: quantize_activation_fp8(x, None, a_tile, warps)) for x in xs]
    )
    res["fp8_weight_decode_us"] = 1e6 * graph_time(
        [(lambda w=w: dequantize_weight_fp8(w, cfg.w_tile, warps)) for w in ws]
    )
    res["fp8_gemm_us"] = 1e6 * graph_time(
        [(lambda a=a, d=d: gemm(a, d, cfg.fast_accum)) for a, d in zip(acts, dec, strict=True)]
    )
    return res


def _torq_rotation(k: int, gen: torch.Generator) -> BlockRotation:
    """A TORQ transform of width ``k`` with random orthogonal rotations (bf16): balancing
    scale, one ``B×B`` inter-block rotation per position, one 32×32 intra-block rotation."""
    b = k // 32
    r_inter = torch.linalg.qr(torch.randn(32, b, b, device="cuda", generator=gen))[0]
    r_intra = torch.linalg.qr(torch.randn(32, 32, device="cuda", generator=gen))[0]
    scale = torch.rand(k, device="cuda", generator=gen) + 0.5
    return BlockRotation(32, r_inter, r_intra, dtype=torch.bfloat16, channel_scale=scale).cuda()


def transform_cost() -> list[dict[str, Any]]:
    """The online transform's cost against the layer's own matmul: the 32×32 block
    transform fused in the kernels, and TORQ's transform (balancing scale, inter-block,
    intra-block) as a torch module and, for one token, fused into the GEMV's pre-pass."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = hadamard_matrix(32, dtype=torch.float32).cuda()
    rows = []
    for k, n, tokens in ((4096, 4096, (1, 16, 2048)), (14336, 4096, (1,))):
        copies = copies_for(n * k // 2)
        w_float = make_weights(k, n, copies, gen)
        w_packed = [MXFP4Weight.from_float(w) for w in w_float]
        rot = _torq_rotation(k, gen)
        for m in tokens:
            xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
            pairs = list(zip(xs, w_packed, strict=True))
            t_plain = graph_time([(lambda xx=xx, ww=ww: mxfp4_linear(xx, ww)) for xx, ww in pairs])
            t_block = graph_time(
                [(lambda xx=xx, ww=ww: mxfp4_linear(xx, ww, block_transform=h)) for xx, ww in pairs]
            )
            t_module = graph_time([(lambda xx=xx, rr=rot: rr(xx)) for xx in xs])
            tiles = TORQ_TILES if m == 1 else [kernel_config.TORQ_PREPASS_TILE]
            tile_times = {}
            for tile in tiles:
                kernel_config.TORQ_PREPASS_TILE = tile
                tile_times[tile] = graph_time(
                    [
                        (lambda xx=xx, ww=ww, rr=rot: mxfp4_linear(xx, ww, rotation=rr))
                        for xx, ww in pairs
                    ]
                )
            best_tile = min(tile_times, key=tile_times.get)
            t_torq = tile_times[best_tile]
            kernel_config.TORQ_PREPASS_TILE = best_tile
            ref = reference_linear(xs[0].float(), w_packed[0], block_transform=h)
            y = mxfp4_linear(xs[0], w_packed[0], block_transform=h)
            # the fused pre-pass sums in float32: the reference runs the module in float32
            rot32 = BlockRotation(
                32, rot.r_inter, rot.r_intra, dtype=torch.float32, channel_scale=rot.channel_scale
            )
            ref_t = reference_linear(rot32(xs[0].float()), w_packed[0])
            y_t = mxfp4_linear(xs[0], w_packed[0], rotation=rot)
            rows.append(
                {
                    "shape": f"{k}->{n}",
                    "tokens": m,
                    "matmul_us": t_plain * 1e6,
                    "with_fused_32x32_us": t_block * 1e6,
                    "fused_32x32_overhead": t_block / t_plain - 1,
                    "torq_module_us": t_module * 1e6,
                    "torq_module_over_matmul": t_module / t_plain,
                    "with_torq_us": t_torq * 1e6,
                    "torq_overhead": t_torq / t_plain - 1,
                    "torq_fused_in_prepass": m == 1,
                    "torq_prepass_tile_us": {str(t): v * 1e6 for t, v in tile_times.items()},
                    "rel_err_with_hadamard": rel_err(y.float(), ref),
                    "rel_err_with_torq": rel_err(y_t.float(), ref_t),
                }
            )
            print(rows[-1], flush=True)
        del w_float, w_packed
        torch.cuda.empty_cache()
    return rows


class _Decoder(torch.nn.Module):
    """A Llama-shaped decoder for one-token steps against a fixed-size KV cache."""

    def __init__(
        self,
        cfg: dict[str, int],
        packed: bool,
        context: int,
        gen: torch.Generator,
        torq: bool = False,
    ):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.h, self.kvh, self.hd = h, kvh, d // h
        self.eps = cfg["rms_norm_eps"]
        self.layers = []
        dev = "cuda"

        def lin(n: int, k: int) -> Any:
            w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16()
            return MXFP4Weight.from_float(w) if packed else w

        for _ in range(cfg["num_hidden_layers"]):
            self.layers.append(
                {
                    "q": lin(d, d),
                    "k": lin(kvh * self.hd, d),
                    "v": lin(kvh * self.hd, d),
                    "o": lin(d, d),
                    "gate": lin(f, d),
                    "up": lin(f, d),
                    "down": lin(d, f),
                    "rot": (
                        {
                            "attn": _torq_rotation(d, gen),
                            "o": _torq_rotation(d, gen),
                            "mlp": _torq_rotation(d, gen),
                            "down": _torq_rotation(f, gen),
                        }
                        if torq
                        else {}
                    ),
                    "n1": torch.ones(d, device=dev, dtype=torch.bfloat16),
                    "n2": torch.ones(d, device=dev, dtype=torch.bfloat16),
                    "kc": torch.randn(
                        1, kvh, context + 1, self.hd, device=dev, generator=gen
                    ).bfloat16(),
                    "vc": torch.randn(
                        1, kvh, context + 1, self.hd, device=dev, generator=gen
                    ).bfloat16(),
                }
            )
        self.embed = (
            torch.randn(cfg["vocab_size"], d, device=dev, generator=gen) * 0.02
        ).bfloat16()
        self.head = self.embed  # tied; lm_head stays bf16 in both variants
        self.norm = torch.ones(d, device=dev, dtype=torch.bfloat16)
        self.packed = packed
        self.context = context

    def _lin(self, x: torch.Tensor, w: Any, rot: BlockRotation | None = None) -> torch.Tensor:
        return mxfp4_linear(x, w, rotation=rot) if self.packed else F.linear(x, w)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).bfloat16() * w

    def step(self, token: torch.Tensor) -> torch.Tensor:
        x = self.embed[token].view(1, -1)
        for layer in self.layers:
            rot = layer["rot"]
            a = self._rms(x, layer["n1"])
            q = self._lin(a, layer["q"], rot.get("attn")).view(1, self.h, 1, self.hd)
            k = self._lin(a, layer["k"], rot.get("attn")).view(1, self.kvh, 1, self.hd)
            v = self._lin(a, layer["v"], rot.get("attn")).view(1, self.kvh, 1, self.hd)
            layer["kc"][:, :, self.context : self.context + 1].copy_(k)
            layer["vc"][:, :, self.context : self.context + 1].copy_(v)
            att = F.scaled_dot_product_attention(q, layer["kc"], layer["vc"], enable_gqa=True)
            x = x + self._lin(att.reshape(1, -1), layer["o"], rot.get("o"))
            a = self._rms(x, layer["n2"])
            g = self._lin(a, layer["gate"], rot.get("mlp"))
            u = self._lin(a, layer["up"], rot.get("mlp"))
            x = x + self._lin(F.silu(g) * u, layer["down"], rot.get("down"))
        return F.linear(self._rms(x, self.norm), self.head)

    def weight_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                w = layer[name]
                total += w.nbytes if self.packed else w.numel() * 2
        return total


def end_to_end(context: int, layers: int | None) -> dict[str, Any]:
    cfg = dict(LLAMA3_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    res: dict[str, Any] = {"config": cfg, "context": context, "batch": 1}
    token = torch.tensor([11], device="cuda")
    logits = {}
    for name, packed, torq in (
        ("bf16", False, False),
        ("mxfp4", True, False),
        ("mxfp4+torq", True, True),
    ):
        gen = torch.Generator(device="cuda").manual_seed(5)
        torch.cuda.reset_peak_memory_stats()
        model = _Decoder(cfg, packed, context, gen, torq)
        t = graph_time([lambda model=model: model.step(token)], replays=30)
        logits[name] = model.step(token).float()
        res[name] = {
            "step_ms": t * 1e3,
            "tokens_per_s": 1 / t,
            "linear_weight_GB": model.weight_bytes() / 1e9,
            "rotation_GB": sum(
                t.numel() * t.element_size()
                for layer in model.layers
                for r in layer["rot"].values()
                for t in r.buffers()
            )
            / 1e9,
            "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9,
        }
        print(name, res[name], flush=True)
        del model
        torch.cuda.empty_cache()
    res["speedup"] = res["mxfp4"]["tokens_per_s"] / res["bf16"]["tokens_per_s"]
    res["speedup_torq"] = res["mxfp4+torq"]["tokens_per_s"] / res["bf16"]["tokens_per_s"]
    res["logit_cosine"] = float(F.cosine_similarity(logits["bf16"], logits["mxfp4"]).mean())
    return res


def device_info() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        smi = "nvidia-smi not found"
    import triton

    return {
        "name": props.name,
        "sms": props.multi_processor_count,
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def markdown(rec: dict[str, Any]) -> str:
    bw = rec["bandwidth_GBps"]
    lines = [
        f"Device: {rec['device']['nvidia_smi']} · torch {rec['device']['torch']} · "
        f"triton {rec['device']['triton']} · measured read bandwidth {bw:.0f} GB/s "
        f"(copy, read + write: {rec['copy_bandwidth_GBps']:.0f} GB/s); % of bw below is of "
        "the read bandwidth",
        "",
        "#### Decode (MXFP4 W4A4 vs bf16 `F.linear`)",
        "",
        "| K→N | batch | bf16 µs | MXFP4 µs | speed-up | MXFP4 % of bw | bf16 % | rel. err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rec["decode"]:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['bf16_us']:.1f} | {r['mxfp4_us']:.1f} | "
            f"{r['speedup']:.2f}× | {100 * r['mxfp4_bw_fraction']:.0f}% | "
            f"{100 * r['bf16_bw_fraction']:.0f}% | {r['rel_err_vs_reference']:.1e} |"
        )
    lines += (
        []
        if not rec["prefill"]
        else [
            "",
            "#### Prefill, 2048 tokens",
            "",
            "| K→N | bf16 µs | MXFP4 µs | bf16/MXFP4 | path | FP8 path µs (act / weight / GEMM) "
            "| FP8, exact accumulation µs | bf16-values path µs | bf16 TFLOP/s | MXFP4 TFLOP/s "
            "| rel. err |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    )

    def us(v: float | None) -> str:
        return "–" if v is None else f"{v:.0f}"

    for r in rec["prefill"]:
        parts = (
            f" ({r['fp8_act_prepass_us']:.0f} / {r['fp8_weight_decode_us']:.0f} / "
            f"{r['fp8_gemm_us']:.0f})"
            if "fp8_gemm_us" in r
            else ""
        )
        lines.append(
            f"| {r['shape']} | {r['bf16_us']:.0f} | {r['mxfp4_us']:.0f} | "
            f"{r['ratio_bf16_over_mxfp4']:.2f}× | {r['config']['kind']} | "
            f"{us(r.get('fp8_path_us'))}{parts} | {us(r.get('fp8_exact_accum_path_us'))} | "
            f"{us(r.get('bf16_path_us'))} | "
            f"{r['bf16_tflops']:.0f} | {r['mxfp4_tflops']:.0f} | "
            f"{r['rel_err_vs_reference']:.1e} |"
        )
    if rec.get("transform"):
        lines += [
            "",
            "#### Online transforms against the layer's matmul",
            "",
            "| K→N | tokens | matmul µs | + 32×32 block transform | TORQ module µs "
            "| TORQ module / matmul | with TORQ µs | TORQ overhead |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rec["transform"]:
            where = " (fused)" if r["torq_fused_in_prepass"] else ""
            lines.append(
                f"| {r['shape']} | {r['tokens']} | {r['matmul_us']:.1f} | "
                f"{100 * r['fused_32x32_overhead']:+.0f}% | {r['torq_module_us']:.1f} | "
                f"{r['torq_module_over_matmul']:.2f} | {r['with_torq_us']:.1f}{where} | "
                f"{100 * r['torq_overhead']:+.0f}% |"
            )
    if rec.get("end_to_end"):
        e = rec["end_to_end"]
        lines += [
            "",
            f"#### End to end: Llama-3-8B-shaped decoder ({e['config']['num_hidden_layers']} "
            f"layers, random weights), batch 1, context {e['context']}",
            "",
            "| weights | step ms | tokens/s | linear weights GB | peak GB |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name in ("bf16", "mxfp4", "mxfp4+torq"):
            r = e[name]
            lines.append(
                f"| {name} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r['linear_weight_GB']:.2f} | {r['peak_memory_GB']:.2f} |"
            )
        lines.append("")
        lines.append(
            f"Speed-up {e['speedup']:.2f}× (with TORQ's online transform before every "
            f"linear, fused into the pre-pass: {e['speedup_torq']:.2f}×); mean cosine of "
            f"the bf16 and mxfp4 logits {e['logit_cosine']:.3f} (same random weights)."
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/bench_kernels.json")
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--e2e-layers", type=int, default=None, help="fewer layers (default 32)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-transform", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_speed.py needs a CUDA GPU")
    t0 = time.time()
    bw_copy, bw = measured_bandwidth()
    rec: dict[str, Any] = {
        "kind": "torq.bench.kernels",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "device": device_info(),
        "bandwidth_GBps": bw / 1e9,
        "copy_bandwidth_GBps": bw_copy / 1e9,
    }
    print(rec, flush=True)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    rec.update(decode_and_prefill(bw, args.quick, batches, not args.skip_prefill))
    if not args.skip_transform:
        rec["transform"] = transform_cost()
    if not args.skip_e2e:
        rec["end_to_end"] = end_to_end(args.context, args.e2e_layers)
    rec["wall_seconds"] = time.time() - t0
    save(args.out, rec, markdown(rec))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
