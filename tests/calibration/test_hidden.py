"""Where the streamed driver keeps hidden states: memory, bf16, disk."""

from __future__ import annotations

import pytest
import torch

from torq.calibration.hidden import HiddenStates


@pytest.mark.parametrize("mode", ["memory", "bfloat16", "disk"])
def test_a_store_gives_back_float32_batches(mode, tmp_path) -> None:
    store = HiddenStates(mode, tmp_path if mode == "disk" else None)
    batches = [torch.randn(2, 5, 8) for _ in range(3)]
    for b in batches:
        store.append(b)
    assert len(store) == 3
    for got, want in zip(store, batches, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        if mode == "bfloat16":
            assert torch.equal(got, want.to(torch.bfloat16).float())
        else:
            assert torch.equal(got, want)
    assert store.nbytes == {"memory": 960, "bfloat16": 480, "disk": 0}[mode]
    nxt = store.empty_like()
    assert nxt.mode == mode and len(nxt) == 0
    if mode == "disk":
        assert store.disk_bytes > 0 and len(list(tmp_path.iterdir())) == 3
    store.release()
    assert len(store) == 0 and list(tmp_path.iterdir()) == []


def test_disk_store_removes_its_own_folder() -> None:
    store = HiddenStates("disk")
    store.append(torch.ones(1, 2))
    folder = store.folder
    assert folder is not None and folder.is_dir()
    store.close()
    assert not folder.exists()
    with pytest.raises(ValueError, match="hidden states are kept in"):
        HiddenStates("fp8")
