"""The reference rows of every table: full precision, round-to-nearest (RTN), and GPTQ
weights without a transform."""

from __future__ import annotations

from torq.methods.registry import GPTAQ_ASYMMETRY, QRONOS_SETTINGS, Method, register

# The float model itself (the GGUF de-quantized to float32): the baseline row.
FP = register(Method("fp", "full precision, no quantization", quantizes=False))

# RTN: Eq. (1) of the paper applied directly, no transform, to weights and activations.
RTN = register(Method("rtn", "round to nearest in the target format, no transform"))

# GPTQ weights on the format's grid, RTN activations, no transform (``rtn+gptq``).
GPTQ = register(
    Method(
        "gptq",
        "GPTQ weights (format grid, damp 0.01), RTN activations, no transform",
        weights="gptq",
    )
)

# GPTAQ weights (GPTQ on the asymmetric loss ‖Ŵ X̃ − W X‖², ``rtn+gptaq``): the quantized
# model's inputs against the float model's output, no transform.
GPTAQ = register(
    Method(
        "gptaq",
        "GPTAQ weights (GPTQ against the float model's output, asymmetry 0.25), RTN "
        "activations, no transform",
        weights="gptq",
        gptq_settings=(("asymmetry", GPTAQ_ASYMMETRY),),
    )
)

# Qronos weights (the same loss in full, ``rtn+qronos``), no transform.
QRONOS = register(
    Method(
        "qronos",
        "Qronos weights (GPTQ against the float model's output, asymmetry 1, damping "
        "10⁻³ λmax(H)), RTN activations, no transform",
        weights="gptq",
        gptq_settings=QRONOS_SETTINGS,
    )
)
