"""Block-scaled 4-bit formats: MXFP4, NVFP4, MXINT4 (method notes, section 1).

``fake_quantize`` is the quantize-dequantize of the paper's MXFP4 model (Section 4,
eq. 1); ``quantize`` / ``dequantize`` are its packed form.
"""

from torq.formats.config import FORMAT_NAMES, SCALE_MODES, FormatSpec, get_format
from torq.formats.fake_quant import fake_quantize
from torq.formats.packed import PackedTensor, dequantize, pack_exact, quantize

__all__ = [
    "FORMAT_NAMES",
    "SCALE_MODES",
    "FormatSpec",
    "PackedTensor",
    "dequantize",
    "fake_quantize",
    "get_format",
    "pack_exact",
    "quantize",
]
