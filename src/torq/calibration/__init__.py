"""Calibration: seeded token windows and layer-wise capture of block statistics."""

from torq.calibration.capture import BlockStatistics, LinearGroup, calibrate_layerwise
from torq.calibration.data import CORPORA, CalibrationConfig, calibration_windows

__all__ = [
    "CORPORA",
    "BlockStatistics",
    "CalibrationConfig",
    "LinearGroup",
    "calibrate_layerwise",
    "calibration_windows",
]
