"""How many operators one decode step of transformers' Llama runs per decoder layer, and how
many of them are the linear layers' products: on a GPU each non-view operator is a kernel,
so what is not a product is the launch-bound rest of a graphed decode step.

    python -m benchmarks.diagnostics.decode_ops

Counts the ATen operators of one decode step (static cache, one token) of two tiny random
Llama models that differ only in their number of layers, so that the difference is one
decoder layer's; views (which launch nothing) are counted apart. No model or data needed.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators that only re-describe a tensor: no kernel on a GPU
VIEWS = {
    "aten.view",
    "aten._unsafe_view",
    "aten.transpose",
    "aten.t",
    "aten.expand",
    "aten.slice",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.reshape",
    "aten.permute",
    "aten.select",
    "aten.alias",
    "aten.detach",
    "aten.split",
    "aten.split_with_sizes",
    "aten.unbind",
    "aten.as_strided",
    "aten._reshape_alias",
    "aten.lift_fresh",
}
PRODUCTS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.linear", "aten.matmul"}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_operators(layers: int) -> collections.Counter[str]:
    """The non-view operators of one decode step of a ``layers``-layer tiny Llama."""
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    dims: dict[str, Any] = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **dims)).eval()
    prompt = torch.randint(0, dims["vocab_size"], (1, 8))
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(8))
        with _Count() as count:
            model(input_ids=prompt[:, :1], past_key_values=cache, cache_position=torch.tensor([8]))
    return collections.Counter({k: v for k, v in count.counts.items() if k not in VIEWS})


def main() -> None:
    two, four = step_operators(2), step_operators(4)
    layer = four - two
    products = sum(v for k, v in layer.items() if k in PRODUCTS)
    total = sum(layer.values())
    print(
        f"one decoder layer's decode step: {total // 2} operators, {products // 2} of them products"
    )
    print("per layer: " + ", ".join(f"{k} {v // 2}" for k, v in layer.most_common()))


if __name__ == "__main__":
    main()
