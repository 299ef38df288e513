"""Optional compiled MXFP4 fake-quantization kernel for float32 on CPU.

A few dozen lines of C, built once per machine with the system C compiler (well under
a second; no torch headers) into a cache directory and called through ``ctypes`` on
the tensors' memory. Several threads each take a contiguous range of blocks; ctypes
drops the GIL during the call. When there is no compiler, the build fails, or the
environment sets ``TORQ_CPU_KERNEL=0``, :func:`load_kernel` returns ``None`` and
callers use the pure-torch paths, which are also the tests' oracle for this kernel.

The arithmetic is that of :mod:`torq.formats.kernels` in the scaled domain: exact
power-of-two scaling, ``(v + M) - M`` rounding to nearest-even on the E2M1 grid, the
sign or-ed back. It is compiled without fast-math and without FMA contraction, and it
clears the x86 flush-to-zero / denormals-are-zero bits while it runs, because the
E8M0 scale 2**-127 is a float32 subnormal.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torq.formats.config import SCALE_MODES, FormatSpec
from torq.formats.kernels import check_fast_path_tensors
from torq.paths import cache_dir

# Below this many blocks per thread, handing work to another thread costs more than it saves.
MIN_BLOCKS_PER_THREAD = 4096

_SCALE_MODE_IDS = {mode: i for i, mode in enumerate(SCALE_MODES)}

_C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* 2**(e - 127) for a biased exponent e in [0, 254]; e = 0 is the subnormal 2**-127. */
static inline float pow2_biased(int32_t e) {
    return bits_to_float(e == 0 ? 0x00400000u : (uint32_t)e << 23);
}

/* One block. scale_mode: 0 = ocp floor(log2 amax) - 2, 1 = paper floor(log2 amax),
   2 = rceil ceil(log2(amax / 6)), 3 = nearest (ocp, +1 when the significand >= 1.75);
   all clamped to the E8M0 range. */
static inline __attribute__((always_inline)) void quantize_block(
        const uint32_t *restrict xb, uint32_t *restrict yb, const int64_t block_size,
        const int32_t scale_mode) {
    uint32_t amax = 0;
    for (int64_t k = 0; k < block_size; ++k) {
        const uint32_t a = xb[k] & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    const int32_t field = (int32_t)(amax >> 23);
    if (field == 255) {
        for (int64_t k = 0; k < block_size; ++k) yb[k] = 0x7FC00000u;
        return;
    }
    int32_t e = scale_mode == 1 ? field : field - 2;
    if (scale_mode == 2 && (amax & 0x7FFFFFu) > 0x400000u) e += 1;
    if (scale_mode == 3 && (amax & 0x7FFFFFu) >= 0x600000u) e += 1;
    if (e < 0) e = 0;
    const float scale = pow2_biased(e);
    const float inverse = pow2_biased(254 - e);
    for (int64_t k = 0; k < block_size; ++k) {
        const uint32_t u = xb[k];
        float v = bits_to_float(u & 0x7FFFFFFFu) * inverse;
        v = v < 6.0f ? v : 6.0f;
        uint32_t m = float_to_bits(v) & 0x7F800000u;
        m = (m > (127u << 23) ? m : (127u << 23)) + (22u << 23);
        const float magic = bits_to_float(m);
        const float r = (v + magic) - magic;
        yb[k] = float_to_bits(r * scale) | (u & 0x80000000u);
    }
}

void torq_mxfp4_fake_quantize_f32(const float *x, float *y, int64_t n_blocks,
                                  int64_t block_size, int32_t scale_mode) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);
#endif
    const uint32_t *xi = (const uint32_t *)x;
    uint32_t *yi = (uint32_t *)y;
    /* Constant block sizes let the compiler unroll the block into whole vectors. */
    if (block_size == 32) {
        for (int64_t b = 0; b < n_blocks; ++b)
            quantize_block(xi + b * 32, yi + b * 32, 32, scale_mode);
    } else if (block_size == 16) {
        for (int64_t b = 0; b < n_blocks; ++b)
            quantize_block(xi + b * 16, yi + b * 16, 16, scale_mode);
    } else {
        for (int64_t b = 0; b < n_blocks; ++b)
            quantize_block(xi + b * block_size, yi + b * block_size, block_size, scale_mode);
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(csr);
#endif
}
"""

_BASE_FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
_NATIVE_FLAGS = ("-march=native",)


def _cache_dir() -> Path:
    return cache_dir() / "kernels"


def _cpu_signature() -> str:
    """Identifies the CPU, because ``-march=native`` code may not run on another one."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        text += "".join(
            line for line in lines if line.startswith(("model name", "flags", "Features"))
        )
    except OSError:
        pass
    return text


def _compile(compiler: str, source: Path, target: Path) -> bool:
    for extra in (_NATIVE_FLAGS, ()):
        cmd = [compiler, *_BASE_FLAGS, *extra, "-o", str(target), str(source)]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        if done.returncode == 0:
            return True
    return False


def _build() -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    key = hashlib.sha256(
        "\0".join((_C_SOURCE, *_BASE_FLAGS, *_NATIVE_FLAGS, compiler, _cpu_signature())).encode()
    ).hexdigest()[:16]
    directory = _cache_dir()
    library = directory / f"mxfp4_{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Build under temporary names and rename: concurrent processes may build at once.
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        source = Path(tmp) / "mxfp4.c"
        source.write_text(_C_SOURCE)
        built = Path(tmp) / "mxfp4.so"
        if not _compile(compiler, source, built):
            return None
        os.replace(built, library)
    return library


@functools.cache
def load_kernel() -> Callable[[int, int, int, int, int], None] | None:
    """The compiled kernel (built on first use), or ``None`` when unavailable."""
    if os.environ.get("TORQ_CPU_KERNEL", "1") == "0":
        return None
    try:
        library = _build()
        if library is None:
            warnings.warn(
                "torq.formats: no C compiler or the build failed; MXFP4 fake quantization "
                "on CPU uses the pure-torch path",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        function = ctypes.CDLL(str(library)).torq_mxfp4_fake_quantize_f32
    except (OSError, AttributeError) as error:
        warnings.warn(
            f"torq.formats: cannot load the CPU kernel ({error})", RuntimeWarning, stacklevel=2
        )
        return None
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int32,
    ]
    function.restype = None
    return function


@functools.cache
def _thread_pool(pid: int) -> ThreadPoolExecutor:
    """One pool per process: a forked child must not inherit its parent's dead threads."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="torq-mxfp4")


def mxfp4_fake_quantize_compiled(
    x: torch.Tensor, fmt: FormatSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MXFP4 quantize-dequantize (paper eq. 1, OCP rule per ``fmt.scale_mode``) of a
    contiguous float32 CPU tensor, size a multiple of the block size, by the compiled
    kernel on ``torch.get_num_threads()`` threads. ``out``, if given, must be another
    contiguous float32 CPU tensor of the same size. Raises ``RuntimeError`` if the
    kernel is unavailable.
    """
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the compiled MXFP4 CPU kernel is unavailable")
    # The kernel writes through a raw pointer: a wrong ``out`` would corrupt memory.
    out = check_fast_path_tensors(x, out, fmt.block_size)
    block = fmt.block_size
    n_blocks = x.numel() // block
    mode = _SCALE_MODE_IDS[fmt.scale_mode]
    threads = max(1, min(torch.get_num_threads(), n_blocks // MIN_BLOCKS_PER_THREAD))
    block_bytes = block * x.element_size()
    bounds = [n_blocks * i // threads for i in range(threads + 1)]
    ranges = [
        (x.data_ptr() + lo * block_bytes, out.data_ptr() + lo * block_bytes, hi - lo)
        for lo, hi in itertools.pairwise(bounds)
    ]
    # The calling thread takes the first range itself rather than waiting idle.
    futures = [
        _thread_pool(os.getpid()).submit(kernel, src, dst, count, block, mode)
        for src, dst, count in ranges[1:]
    ]
    src, dst, count = ranges[0]
    kernel(src, dst, count, block, mode)
    for future in futures:
        future.result()
    return out
