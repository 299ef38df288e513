"""fake_quantize / quantize / dequantize: shapes, dtypes, padding, NaN, scale modes,
and the fast CPU paths against the reference."""

from __future__ import annotations

import pytest
import torch

import torq.formats as tf
from tests.formats.formats_testing import (
    ALL_SPECS,
    DTYPES,
    assert_bits_equal,
    edge_blocks,
    non_finite_blocks,
    random_activations,
)
from torq.formats import cpu_kernel, kernels
from torq.formats.reference import fake_quantize_reference, mx_quantize_blocks, to_blocks

SPEC_IDS = [f"{s.name}-{s.scale_mode}" for s in ALL_SPECS]
MXFP4_SPECS = ALL_SPECS[:4]
MXFP4_IDS = SPEC_IDS[:4]


def mixed_input(rows: int = 16, width: int = 256, seed: int = 0) -> torch.Tensor:
    """Random rows from every distribution plus the edge and non-finite blocks."""
    random = random_activations(rows=rows, width=width, seed=seed)
    special = torch.cat([edge_blocks(32), non_finite_blocks(32)])
    pad = (-special.numel()) % width
    special = torch.cat([special.view(-1), torch.zeros(pad)]).view(-1, width)
    return torch.cat([*random.values(), special])


def huge_blocks(width: int = 256) -> torch.Tensor:
    """Blocks with amax beyond 2**106, where the chunked path falls back."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, width, generator=g)
    x[::2] *= 2.0**110
    x[1, :32] *= 2.0**120
    x[3, 32:64] = 3.0e38
    return x


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shape", [(96,), (3, 64), (2, 3, 4, 48), (5, 1, 160)])
def test_any_leading_shape(spec: tf.FormatSpec, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    y = tf.fake_quantize(x, spec)
    assert y.shape == x.shape and y.dtype == x.dtype
    flat = tf.fake_quantize(x.reshape(-1, shape[-1]), spec)
    assert_bits_equal(y.reshape(flat.shape), flat)
    if spec.name != "nvfp4":  # an MX block depends on its own values only
        assert_bits_equal(tf.fake_quantize(x[..., :32], spec), y[..., :32])


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_of_quantize_equals_fake_quantize(
    spec: tf.FormatSpec, dtype: torch.dtype
) -> None:
    x = mixed_input(rows=4).to(dtype)
    y = tf.fake_quantize(x, spec)
    assert y.dtype == dtype
    assert_bits_equal(tf.dequantize(tf.quantize(x, spec), dtype), y)
    assert_bits_equal(fake_quantize_reference(x, spec), y)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_is_computed_in_float32(spec: tf.FormatSpec, dtype: torch.dtype) -> None:
    x = (torch.randn(8, 128) * 20).to(dtype)
    assert_bits_equal(tf.fake_quantize(x, spec), tf.fake_quantize(x.float(), spec).to(dtype))


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("width", [1, 7, 33, 50, 100])
def test_widths_not_a_multiple_of_the_block_are_zero_padded(
    spec: tf.FormatSpec, width: int
) -> None:
    x = torch.randn(3, width) * 4
    padded_width = -(-width // spec.block_size) * spec.block_size
    padded = torch.nn.functional.pad(x, (0, padded_width - width))
    y = tf.fake_quantize(x, spec)
    assert y.shape == x.shape
    assert_bits_equal(y, tf.fake_quantize(padded, spec)[:, :width])
    p = tf.quantize(x, spec)
    assert p.codes.shape == (3, padded_width // 2)
    assert_bits_equal(tf.dequantize(p), y)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_empty_tensors(spec: tf.FormatSpec) -> None:
    for shape in [(0, 64), (4, 0), (2, 0, 32)]:
        x = torch.empty(shape)
        assert tf.fake_quantize(x, spec).shape == shape
        assert tf.dequantize(tf.quantize(x, spec)).shape == shape


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_input_untouched_and_output_fresh(spec: tf.FormatSpec) -> None:
    x = torch.randn(4, 64, requires_grad=True)
    before = x.detach().clone()
    y = tf.fake_quantize(x, spec)
    assert torch.equal(x.detach(), before)
    assert not y.requires_grad
    assert y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_non_contiguous_input(spec: tf.FormatSpec) -> None:
    x = torch.randn(64, 96).t()
    assert_bits_equal(tf.fake_quantize(x, spec), tf.fake_quantize(x.contiguous(), spec))


@pytest.mark.parametrize(
    "spec",
    [s for s in ALL_SPECS if s.name != "nvfp4"],
    ids=[i for i in SPEC_IDS if not i.startswith("nvfp4")],
)
def test_mx_nan_or_inf_poisons_only_its_block(spec: tf.FormatSpec) -> None:
    x = torch.randn(3, 96)
    x[0, 40] = float("nan")
    x[1, 70] = float("inf")
    x[2, 5] = float("-inf")
    y = tf.fake_quantize(x, spec)
    nan_blocks = torch.isnan(y).view(3, 3, 32).all(-1)
    assert nan_blocks.tolist() == [[False, True, False], [False, False, True], [True, False, False]]
    assert not torch.isnan(y).view(3, 3, 32)[~nan_blocks].any()
    p = tf.quantize(x, spec)
    assert p.scales[~nan_blocks].lt(0xFF).all() and p.scales[nan_blocks].eq(0xFF).all()


def test_nvfp4_nan_poisons_the_whole_tensor() -> None:
    x = torch.randn(3, 64)
    x[1, 3] = float("nan")
    assert torch.isnan(tf.fake_quantize(x, "nvfp4")).all()
    assert not torch.isnan(tf.fake_quantize(x[[0, 2]], "nvfp4")).any()


def test_idempotent() -> None:
    x = torch.randn(32, 256) * 5
    for name in ("mxfp4", "mxint4"):
        once = tf.fake_quantize(x, name)
        assert_bits_equal(tf.fake_quantize(once, name), once)


def _magnitude_indices(x: torch.Tensor, spec: tf.FormatSpec) -> torch.Tensor:
    codes = tf.quantize(x, spec).codes
    return torch.stack((codes & 0x7, (codes >> 4) & 0x7), dim=-1)


def test_paper_scale_never_uses_3_4_6() -> None:
    """s_b = 2**floor(log2 amax) leaves every |z / s_b| < 2: codes for 3, 4, 6 unused."""
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    paper = _magnitude_indices(x, tf.get_format("mxfp4", "paper"))
    ocp = _magnitude_indices(x, tf.get_format("mxfp4", "ocp"))
    assert paper.max() <= 4  # index 4 is the value 2
    assert (ocp >= 5).any()


def test_ocp_scale_has_several_times_smaller_mse_than_paper() -> None:
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    mse = {
        mode: (tf.fake_quantize(x, tf.get_format("mxfp4", mode)) - x).pow(2).mean().item()
        for mode in tf.SCALE_MODES
    }
    assert mse["paper"] > 3 * mse["ocp"]
    assert mse["rceil"] < mse["paper"]


def test_rceil_never_clips_and_is_at_most_one_binade_above_ocp() -> None:
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(2)) * 7
    ocp = tf.quantize(x, tf.get_format("mxfp4", "ocp")).scales.int()
    rceil = tf.quantize(x, tf.get_format("mxfp4", "rceil")).scales.int()
    assert ((rceil - ocp) >= 0).all() and ((rceil - ocp) <= 1).all()
    scale = torch.exp2(rceil.double() - 127).repeat_interleave(32, dim=-1)
    assert (x.double().abs() <= 6 * scale).all()


def test_mxfp4_error_is_within_half_a_grid_step() -> None:
    x = torch.randn(64, 256) * 3
    blocks = to_blocks(x, 32, torch.float32)
    mx = mx_quantize_blocks(blocks, tf.get_format("mxfp4"))
    scaled = blocks * torch.exp2(-mx.exponent.float())
    step = torch.where(scaled.abs() < 2, 0.5, torch.where(scaled.abs() < 4, 1.0, 2.0))
    assert ((mx.q - scaled.clamp(-6, 6)).abs() <= step / 2).all()


# ---- the fast CPU paths must give the reference's bits ----


def _fast_path_inputs() -> list[torch.Tensor]:
    return [mixed_input(), huge_blocks(), torch.zeros(4, 256), -torch.zeros(2, 64)]


@pytest.mark.parametrize("spec", MXFP4_SPECS, ids=MXFP4_IDS)
def test_chunked_torch_path_matches_reference(spec: tf.FormatSpec, monkeypatch) -> None:
    for chunk in (kernels.CHUNK_ELEMENTS, 64, 96):
        monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", chunk)
        for x in _fast_path_inputs():
            y = kernels.mxfp4_fake_quantize_chunked(x.contiguous(), spec)
            assert_bits_equal(y, fake_quantize_reference(x, spec))


@pytest.mark.parametrize("block_size", [16, 64])
def test_chunked_torch_path_other_block_sizes(block_size: int) -> None:
    for mode in tf.SCALE_MODES:
        spec = tf.FormatSpec("mxfp4", block_size, mode)
        x = mixed_input(rows=2)
        assert_bits_equal(
            kernels.mxfp4_fake_quantize_chunked(x, spec), fake_quantize_reference(x, spec)
        )


def test_chunked_torch_path_rejects_bad_input() -> None:
    spec = tf.get_format("mxfp4")
    with pytest.raises(ValueError):
        kernels.mxfp4_fake_quantize_chunked(torch.ones(4, 32).double(), spec)
    with pytest.raises(ValueError):
        kernels.mxfp4_fake_quantize_chunked(torch.ones(40), spec)
    with pytest.raises(ValueError):
        kernels.mxfp4_fake_quantize_chunked(torch.ones(32, 4).t(), spec)


needs_kernel = pytest.mark.skipif(
    cpu_kernel.load_kernel() is None, reason="no C compiler: the compiled kernel is optional"
)


@needs_kernel
@pytest.mark.parametrize("spec", MXFP4_SPECS, ids=MXFP4_IDS)
def test_compiled_kernel_matches_reference(spec: tf.FormatSpec, monkeypatch) -> None:
    for per_thread in (cpu_kernel.MIN_BLOCKS_PER_THREAD, 3):
        monkeypatch.setattr(cpu_kernel, "MIN_BLOCKS_PER_THREAD", per_thread)
        for x in _fast_path_inputs():
            y = cpu_kernel.mxfp4_fake_quantize_compiled(x.contiguous(), spec)
            assert_bits_equal(y, fake_quantize_reference(x, spec))


@needs_kernel
def test_compiled_kernel_multithreaded_on_a_large_tensor() -> None:
    x = torch.randn(1024, 1024) * torch.exp2(torch.randint(-30, 30, (1024, 1)).float())
    spec = tf.get_format("mxfp4")
    y = cpu_kernel.mxfp4_fake_quantize_compiled(x, spec)
    assert_bits_equal(y, kernels.mxfp4_fake_quantize_chunked(x, spec))
    assert_bits_equal(y, tf.fake_quantize(x, spec))


@needs_kernel
def test_compiled_kernel_rejects_bad_input() -> None:
    spec = tf.get_format("mxfp4")
    x = torch.randn(4, 64)
    for bad_x in (x.double(), x.t(), x[:, :40]):
        with pytest.raises(ValueError):
            cpu_kernel.mxfp4_fake_quantize_compiled(bad_x, spec)
    for bad_out in (x, torch.empty(4, 32), torch.empty(4, 64).t(), torch.empty(4, 64).half()):
        with pytest.raises(ValueError):
            cpu_kernel.mxfp4_fake_quantize_compiled(x, spec, out=bad_out)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 64])
def test_compiled_kernel_other_block_sizes(block_size: int) -> None:
    for mode in tf.SCALE_MODES:
        spec = tf.FormatSpec("mxfp4", block_size, mode)
        x = mixed_input(rows=2)
        assert_bits_equal(
            cpu_kernel.mxfp4_fake_quantize_compiled(x, spec), fake_quantize_reference(x, spec)
        )


def test_compiled_kernel_can_be_disabled_or_fail_to_build(monkeypatch, tmp_path) -> None:
    x = mixed_input(rows=2)
    spec = tf.get_format("mxfp4")
    expected = fake_quantize_reference(x, spec)
    try:
        cpu_kernel.load_kernel.cache_clear()
        monkeypatch.setenv("TORQ_CPU_KERNEL", "0")
        assert cpu_kernel.load_kernel() is None
        assert_bits_equal(tf.fake_quantize(x, spec), expected)
        with pytest.raises(RuntimeError):
            cpu_kernel.mxfp4_fake_quantize_compiled(x, spec)

        cpu_kernel.load_kernel.cache_clear()
        monkeypatch.delenv("TORQ_CPU_KERNEL")
        monkeypatch.setenv("TORQ_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")
        with pytest.warns(RuntimeWarning, match="pure-torch"):
            assert cpu_kernel.load_kernel() is None
        assert_bits_equal(tf.fake_quantize(x, spec), expected)
    finally:
        cpu_kernel.load_kernel.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_cuda_matches_cpu(spec: tf.FormatSpec) -> None:
    for dtype in DTYPES:
        x = mixed_input(rows=4).to(dtype)
        y = tf.fake_quantize(x.cuda(), spec)
        assert y.device.type == "cuda"
        assert_bits_equal(y.cpu(), tf.fake_quantize(x, spec))
        p = tf.quantize(x.cuda(), spec)
        assert_bits_equal(tf.dequantize(p, dtype).cpu(), tf.fake_quantize(x, spec))
