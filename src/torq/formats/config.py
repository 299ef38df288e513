"""Which block-scaled format, as a small serialisable value (method notes, section 1): the
4-bit formats, and MXFP8, which a precision budget keeps the most sensitive linears in."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torq.formats.constants import MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE

FORMAT_NAMES: tuple[str, ...] = ("mxfp4", "nvfp4", "mxint4")
# the 8-bit format of the linears a precision budget keeps (``--avg-bits``): MXFP8 W8A8, which
# compressed-tensors holds as its MXFP8 scheme; not one of the 4-bit formats a run names
HIGH_PRECISION_FORMAT = "mxfp8"
ALL_FORMATS: tuple[str, ...] = (*FORMAT_NAMES, HIGH_PRECISION_FORMAT)
# average stored bits per weight element: the element's bits and the scale's spread over a
# block (MXFP4 4 + 8/32; NVFP4 4 + 8/16, its tensor scale not counted)
FORMAT_BITS: dict[str, float] = {"mxfp4": 4.25, "nvfp4": 4.5, "mxint4": 4.25, "mxfp8": 8.25}
SCALE_MODES: tuple[str, ...] = ("ocp", "paper", "rceil", "nearest")  # MXFP4's block-scale rules
# NVFP4's: its standard scale-to-6, or "Four Over Six" (each block scaled to 4 or to 6,
# whichever rounds it with the less squared error; mit-han-lab/fouroversix)
NVFP4_SCALE_MODES: tuple[str, ...] = ("ocp", "4over6")
# the rules each format takes; every other format has "ocp" only
FORMAT_SCALE_MODES: dict[str, tuple[str, ...]] = {"mxfp4": SCALE_MODES, "nvfp4": NVFP4_SCALE_MODES}
# a run's rule that differs between its weights and activations: (weights', activations').
# Four Over Six on NVFP4 weights only: an engine serves those weights as they are, but
# quantizes activations with NVFP4's standard scale
SIDE_SCALE_MODES: dict[str, tuple[str, str]] = {"4over6-weights": ("4over6", "ocp")}
ALL_SCALE_MODES: tuple[str, ...] = (*SCALE_MODES, "4over6", *SIDE_SCALE_MODES)

DEFAULT_BLOCK_SIZES: dict[str, int] = {
    "mxfp4": MX_BLOCK_SIZE,
    "nvfp4": NVFP4_BLOCK_SIZE,
    "mxint4": MX_BLOCK_SIZE,
    "mxfp8": MX_BLOCK_SIZE,
}


@dataclass(frozen=True)
class FormatSpec:
    """A block-scaled format: element type, block size and scale rule (the 4-bit ones, and
    MXFP8: E4M3 elements, an E8M0 scale per 32, ``X = 2^(floor(log2 amax) - 8)``).

    ``scale_mode`` picks the MXFP4 shared-scale rule (method notes, section 1):
    ``"ocp"`` is the OCP MX v1.0 rule ``X = 2^(floor(log2 amax) - 2)``; ``"paper"`` is
    the TORQ paper's Section 4 eq. 1 reading ``s_b = 2^floor(log2 amax)``; ``"rceil"``
    is the cuBLAS rule ``X = 2^ceil(log2(amax / 6))``; ``"nearest"`` is the OCP rule plus one
    binade when amax's significand is at least 1.75, i.e. when ``amax / X`` would be nearer
    8 than 6 (the rule llm-compressor and AMD Quark use; our variant, not the paper's).
    NVFP4, MXINT4 and MXFP8 have one rule each and accept only ``"ocp"``. The block size must be
    positive and even, so that a block packs into whole bytes.
    """

    name: str
    block_size: int
    scale_mode: str = "ocp"

    def __post_init__(self) -> None:
        if self.name not in ALL_FORMATS:
            raise ValueError(f"unknown format {self.name!r}; known formats: {ALL_FORMATS}")
        if self.scale_mode not in ALL_SCALE_MODES:
            raise ValueError(
                f"unknown scale mode {self.scale_mode!r}; known scale modes: {ALL_SCALE_MODES}"
            )
        if self.name == "mxfp8" and self.scale_mode in ("ocp", "nearest"):
            pass  # MXFP8 takes OCP's rule and compressed-tensors' (the 4-bit format's own)
        elif self.scale_mode not in FORMAT_SCALE_MODES.get(self.name, ("ocp",)):
            raise ValueError(
                f"format {self.name!r} takes scale_mode "
                f"{' or '.join(repr(m) for m in FORMAT_SCALE_MODES.get(self.name, ('ocp',)))}, "
                f"not {self.scale_mode!r}"
            )
        if (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or self.block_size <= 0
            or self.block_size % 2
        ):
            raise ValueError(f"block_size must be a positive even int, got {self.block_size!r}")

    def to_dict(self) -> dict[str, Any]:
        """The spec as a JSON-serialisable dict, recorded with every result."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FormatSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


def scale_mode_for(name: str, scale_mode: str, side: str = "weight") -> str:
    """The scale rule format ``name`` takes on the ``side`` ("weight" or "activation") of a
    run with ``scale_mode``: the mode itself where the format has it (MXFP4's rules, NVFP4's
    "4over6"; "4over6-weights" is "4over6" on the weight side only), else ``"ocp"`` (a run's
    MXFP4 rule leaves its NVFP4 linears on NVFP4's standard scale, and the reverse)."""
    weight_mode, act_mode = SIDE_SCALE_MODES.get(scale_mode, (scale_mode, scale_mode))
    mode = weight_mode if side == "weight" else act_mode
    return mode if mode in FORMAT_SCALE_MODES.get(name, ()) else "ocp"


def side_scale_modes(
    weight: str | None, activation: str | None, scale_mode: str
) -> tuple[str | None, str | None]:
    """The rules a run's weights and activations (format names, ``None`` for float) take."""
    return (
        None if weight is None else scale_mode_for(weight, scale_mode, "weight"),
        None if activation is None else scale_mode_for(activation, scale_mode, "activation"),
    )


def run_scale_mode(weight_mode: str | None, activation_mode: str | None) -> str:
    """The run's ``scale_mode`` that gives these rules to its weights and activations (the
    inverse of :func:`side_scale_modes`)."""
    modes = {m for m in (weight_mode, activation_mode) if m not in (None, "ocp")}
    for run_mode, (w, a) in SIDE_SCALE_MODES.items():
        if (weight_mode, activation_mode) == (w, a):
            return run_mode
    return modes.pop() if modes else "ocp"


def get_format(name: str, scale_mode: str = "ocp") -> FormatSpec:
    """The standard spec of a format by name (method notes, section 1).

    MXFP4, MXINT4 and MXFP8 use blocks of 32 and NVFP4 blocks of 16. Raises ``ValueError``
    naming the known formats and scale modes for an unknown name, an unknown mode, or
    a mode the format does not take.
    """
    if name not in DEFAULT_BLOCK_SIZES:
        raise ValueError(f"unknown format {name!r}; known formats: {ALL_FORMATS}")
    return FormatSpec(name=name, block_size=DEFAULT_BLOCK_SIZES[name], scale_mode=scale_mode)


def as_format(fmt: FormatSpec | str) -> FormatSpec:
    """Accept a spec or a format name (which gets its standard spec)."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, str):
        return get_format(fmt)
    raise TypeError(f"expected a FormatSpec or a format name, got {type(fmt).__name__}")
