"""``had32`` W4A4 with channel balancing of strength α from RMS or max statistics.

``smooth.py ALPHA:STAT …`` (``0.5:rms 0.3:rms 0.5:max none:rms``); ``SM`` picks the MXFP4
scale rule, ``MSEMODE`` the best-of-two exponents (``msepatch``). The ``rms`` statistics
are torq's own balancing (:func:`torq.rotations.balance.balance_scales`), so ``0.5:rms``
is what ``torq-had32`` runs.
"""

import copy
import os
import sys

from benchmarks.diagnostics import msepatch
from benchmarks.diagnostics.diag_common import calib_windows, eval_windows, setup
from torq.experimental import (
    BlockRotation,
    GroupSolver,
    QuantConfig,
    balance_scales,
    calibrate_layerwise,
    channel_energy,
    hadamard_matrix,
    perplexity,
)

lm = setup(default_threads=2)
win = eval_windows(lm)
cal = calib_windows(lm, default=8)
H = hadamard_matrix(32)
SM = os.environ.get("SM", "ocp")


class BalancedHadamard(GroupSolver):
    """``H₃₂`` after a per-channel scale ``s = a^α / w^(1−α)`` (geometric mean 1)."""

    def __init__(self, alpha: float | None, stat: str, cfg: QuantConfig) -> None:
        super().__init__(cfg)
        self.alpha = alpha
        self.stat = stat

    def transform(self, group, stats, weight):
        if self.alpha is None:
            return BlockRotation(32, None, H), {}
        w = weight.double()
        if self.stat == "max":
            xr = stats.sample.double().abs().amax(0).clamp_min(1e-12)
            wr = w.abs().amax(0).clamp_min(1e-12)
            s = xr.pow(self.alpha) / wr.pow(1 - self.alpha)
            s = s / s.log().mean().exp()
        else:
            s = balance_scales(channel_energy(stats.covariance()), w, self.alpha)
        return BlockRotation(32, None, H, channel_scale=s.float()), {}


for spec in sys.argv[1:]:
    a, stat = spec.split(":")
    alpha = None if a == "none" else float(a)
    m = copy.deepcopy(lm.model)
    msepatch.PHASE[0] = "w"
    calibrate_layerwise(
        m,
        cal,
        BalancedHadamard(alpha, stat, QuantConfig.from_names("mxfp4", "mxfp4", SM)),
        progress=False,
    )
    msepatch.PHASE[0] = "a"
    print(spec, SM, os.environ.get("MSEMODE", ""), f"{perplexity(m, win, progress=False).ppl:.2f}")
