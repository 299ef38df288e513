"""Which 4-bit format, as a small serialisable value (method notes, section 1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torq.formats.constants import MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE

FORMAT_NAMES: tuple[str, ...] = ("mxfp4", "nvfp4", "mxint4")
SCALE_MODES: tuple[str, ...] = ("ocp", "paper", "rceil", "nearest")

DEFAULT_BLOCK_SIZES: dict[str, int] = {
    "mxfp4": MX_BLOCK_SIZE,
    "nvfp4": NVFP4_BLOCK_SIZE,
    "mxint4": MX_BLOCK_SIZE,
}


@dataclass(frozen=True)
class FormatSpec:
    """A block-scaled 4-bit format: element type, block size and scale rule.

    ``scale_mode`` picks the MXFP4 shared-scale rule (method notes, section 1):
    ``"ocp"`` is the OCP MX v1.0 rule ``X = 2^(floor(log2 amax) - 2)``; ``"paper"`` is
    the TORQ paper's Section 4 eq. 1 reading ``s_b = 2^floor(log2 amax)``; ``"rceil"``
    is the cuBLAS rule ``X = 2^ceil(log2(amax / 6))``; ``"nearest"`` is the OCP rule plus one
    binade when amax's significand is at least 1.75, i.e. when ``amax / X`` would be nearer
    8 than 6 (the rule llm-compressor and AMD Quark use; our variant, not the paper's).
    NVFP4 and MXINT4 have one rule each and accept only ``"ocp"``. The block size must be
    positive and even, so that a block packs into whole bytes.
    """

    name: str
    block_size: int
    scale_mode: str = "ocp"

    def __post_init__(self) -> None:
        if self.name not in FORMAT_NAMES:
            raise ValueError(f"unknown format {self.name!r}; known formats: {FORMAT_NAMES}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(
                f"unknown scale mode {self.scale_mode!r}; known scale modes: {SCALE_MODES}"
            )
        if self.name != "mxfp4" and self.scale_mode != "ocp":
            raise ValueError(
                f"format {self.name!r} has a single scale rule and takes scale_mode 'ocp', "
                f"not {self.scale_mode!r}; the modes {SCALE_MODES} apply to 'mxfp4' only"
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


def get_format(name: str, scale_mode: str = "ocp") -> FormatSpec:
    """The standard spec of a format by name (method notes, section 1).

    MXFP4 and MXINT4 use blocks of 32 and NVFP4 blocks of 16. Raises ``ValueError``
    naming the known formats and scale modes for an unknown name, an unknown mode, or
    a mode other than ``"ocp"`` for NVFP4 / MXINT4.
    """
    if name not in DEFAULT_BLOCK_SIZES:
        raise ValueError(f"unknown format {name!r}; known formats: {FORMAT_NAMES}")
    return FormatSpec(name=name, block_size=DEFAULT_BLOCK_SIZES[name], scale_mode=scale_mode)


def as_format(fmt: FormatSpec | str) -> FormatSpec:
    """Accept a spec or a format name (which gets its standard spec)."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, str):
        return get_format(fmt)
    raise TypeError(f"expected a FormatSpec or a format name, got {type(fmt).__name__}")
