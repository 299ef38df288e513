"""A GGUF checkpoint converted tensor by tensor into sharded safetensors.

transformers reads a GGUF file by de-quantizing every tensor into one state dict and
building the whole model (``from_pretrained(..., gguf_file=...)``): a model's full float32
size in memory, twice. Here each tensor is read from the memory-mapped file, de-quantized
(``gguf.dequantize``), renamed and reshaped exactly as transformers does it (its tensor
processors: the q/k head permutation of llama.cpp undone, MoE experts merged) and written to
a shard of at most ``shard_bytes`` (512 MiB); what is held is that shard and one block's
tensors (a block's experts are merged before they are written), never the model. The
folder is an ordinary Hugging Face checkpoint (``model.safetensors.index.json``, config,
tokenizer) that :class:`~torq.models.streaming.LayerStream` streams and ``from_pretrained``
loads.

Stored in float32 (the values transformers' own conversion gives, bit for bit, and what
every number in docs/research/ was measured on) or, on request, bfloat16 (half the disk;
GGUF's block-quantized values are not all bf16 numbers, so this rounds them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from torq.errors import TorqError
from torq.models.streaming import give_back_memory

GGUF_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _ShardWriter:
    """Tensors written to ``model-<i>.safetensors`` shards of at most ``shard_bytes``."""

    def __init__(self, folder: Path, shard_bytes: int) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.shards = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self.weight_map or name in self.pending:
                raise TorqError(f"the GGUF file maps two tensors to {name}")
            size = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + size > self.shard_bytes:
                self.flush()
            self.pending[name] = t.contiguous()
            self.pending_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f"model-{self.shards:05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        for name in self.pending:
            self.weight_map[name] = file
        self.total += self.pending_bytes
        self.shards += 1
        self.pending, self.pending_bytes = {}, 0
        # freed tensors otherwise stay in the heap (docs/research/streaming-and-engineering.md §9)
        give_back_memory()

    def close(self) -> None:
        self.flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _dequantize(tensor: Any, dequantize: Any, chunk_bytes: int = 64 << 20) -> Any:
    """``gguf.dequantize`` of one tensor, a slab of rows at a time into one float array:
    the same values (each GGUF block is de-quantized on its own), without the whole-tensor
    temporaries of the de-quantizer (several times an 8B embedding's 2 GB)."""
    import numpy as np

    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= 1:
        return dequantize(data, tensor.tensor_type)
    first = dequantize(data[:1], tensor.tensor_type)
    rows = max(1, chunk_bytes // max(1, first.nbytes))
    if rows >= data.shape[0]:
        return dequantize(data, tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    for i in range(0, data.shape[0], rows):
        out[i : i + rows] = dequantize(data[i : i + rows], tensor.tensor_type)
    return out


def _block_of(name: str) -> str | None:
    """``blk.<N>.…`` → ``N``: tensors of one block are merged (MoE experts) before writing."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "blk" else None


@torch.no_grad()
def convert_gguf_tensorwise(
    gguf_path: Path,
    out: Path,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 512 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``gguf_path`` as a sharded safetensors folder ``out`` (module doc), one tensor
    at a time, in ``dtype``; returns what was written. ``out`` must exist and be empty."""
    import numpy as np
    from accelerate import init_empty_weights
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    folder, name = str(gguf_path.parent), gguf_path.name
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)  # metadata only
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds plain float weights
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    reader = GGUFReader(str(gguf_path))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    key_map = get_gguf_hf_weights_map(skeleton, processor)
    parsed["tensors"] = {}  # where a processor merges tensors (MoE experts) across calls

    def drain() -> dict[str, torch.Tensor]:
        merged = {k: v.to(dtype) for k, v in parsed["tensors"].items()}
        parsed["tensors"] = {}
        return merged

    writer = _ShardWriter(out, shard_bytes)
    block: str | None = None
    skipped: list[str] = []
    for tensor in tqdm(reader.tensors, desc="GGUF → safetensors", disable=not progress):
        this_block = _block_of(tensor.name)
        if this_block != block:
            writer.add(drain())
            block = this_block
        weights = _dequantize(tensor, dequantize)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=key_map, parsed_parameters=parsed
        )
        if result.name is None:
            continue  # merged into parsed["tensors"], written with its block
        if result.name not in key_map:
            skipped.append(result.name)
            continue
        # the float32 values transformers' conversion gives, then the requested dtype (a
        # read-only view of the memory-mapped file is copied, a fresh array is not)
        w = result.weights if result.weights.flags.writeable else np.copy(result.weights)
        t = torch.from_numpy(w).to(torch.float32).to(dtype)
        writer.add({key_map[result.name]: t})
    writer.add(drain())
    writer.close()
    config.dtype = dtype
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
    missing = sorted(set(skeleton.state_dict()) - set(writer.weight_map))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing:
        raise TorqError(f"{gguf_path}: the GGUF file has no tensor for {missing[:3]}")
    return {
        "tensors": len(writer.weight_map),
        "shards": writer.shards,
        "bytes": writer.total,
        "skipped": skipped,
    }
