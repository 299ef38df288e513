"""The root ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without a GPU,
before Triton is first imported, so these tests run the kernels in Triton's CPU
interpreter there; this check makes a missed setting fail loudly instead of compiling."""

from __future__ import annotations

import os

import torch


def pytest_configure() -> None:
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET must be set"
