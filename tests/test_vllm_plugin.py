"""torq's vLLM plugin (integrations/vllm): a linear with a bias runs its input transform, the
bias added after the product; an output transform still goes to vLLM's own refusal."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

# loaded from its file: the plugin is a distribution of its own, installed into vLLM's
# environment, not torq's
_PLUGIN = (
    Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "torq_vllm" / "__init__.py"
)
_spec = importlib.util.spec_from_file_location("torq_vllm", _PLUGIN)
assert _spec is not None and _spec.loader is not None
torq_vllm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torq_vllm)


def _method_class() -> type:
    """vLLM 0.32's ``CompressedTensorsLinearTransformMethod.apply`` in miniature: the input
    transform, an assertion that there is no bias, the product, the output transform."""

    class TransformMethod:
        def __init__(self, t_in: torch.Tensor | None, t_out: torch.Tensor | None) -> None:
            self.input_transform, self.output_transform = t_in, t_out

        def apply(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            if self.input_transform is not None:
                x = x @ self.input_transform
            assert bias is None
            x = torch.nn.functional.linear(x, layer.weight, bias)
            if self.output_transform is not None:
                x = x @ self.output_transform
            return x

    return TransformMethod


def test_bias_added_after_the_input_transform() -> None:
    torch.manual_seed(0)
    cls = _method_class()
    layer = torch.nn.Linear(8, 6)
    t = torch.linalg.qr(torch.randn(8, 8))[0]
    x = torch.randn(5, 8)
    with pytest.raises(AssertionError):
        cls(t, None).apply(layer, x, layer.bias)
    torq_vllm.allow_bias(cls)
    got = cls(t, None).apply(layer, x, layer.bias)
    torch.testing.assert_close(got, (x @ t) @ layer.weight.T + layer.bias)
    # no bias: vLLM's own path, unchanged
    torch.testing.assert_close(cls(t, None).apply(layer, x), (x @ t) @ layer.weight.T)
    # an output transform would rotate the bias: vLLM's refusal stands
    with pytest.raises(AssertionError):
        cls(t, torch.eye(6)).apply(layer, x, layer.bias)
    # wrapped once however often vLLM calls the hook
    wrapped = cls.apply
    torq_vllm.allow_bias(cls)
    assert cls.apply is wrapped


def test_register_finds_vllms_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _method_class()
    module_name, class_name = torq_vllm.TRANSFORM_METHODS[0]
    stub = types.ModuleType(module_name)
    setattr(stub, class_name, cls)
    monkeypatch.setitem(sys.modules, module_name, stub)
    entry = types.ModuleType(torq_vllm.ENTRY_MODULE)
    monkeypatch.setitem(sys.modules, torq_vllm.ENTRY_MODULE, entry)
    original = cls.apply
    torq_vllm.register()  # the second class is missing here: skipped without an error
    assert cls.apply is not original
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    torch.testing.assert_close(
        cls(None, None).apply(layer, x, layer.bias), x @ layer.weight.T + layer.bias
    )


def test_register_without_vllm_leaves_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, torq_vllm.ENTRY_MODULE, None)  # import fails
    torq_vllm.register()  # no error, nothing to wrap
