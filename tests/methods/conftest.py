"""The methods' tests share one tiny calibration corpus (the tiny tokenizer's text)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_TEXT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "corpus.txt"
    path.write_text(TINY_TEXT * 30, encoding="utf-8")
    return str(path)
