"""Calibration: seeded token windows and layer-wise capture of block statistics."""

from torq.calibration.capture import BlockStatistics, LinearGroup, capture_layer
from torq.calibration.data import CORPORA, CalibrationConfig, calibration_windows

__all__ = [
    "CORPORA",
    "BlockStatistics",
    "CalibrationConfig",
    "LinearGroup",
    "calibration_windows",
    "capture_layer",
]
