"""The whole-model reference that the streamed pipeline must equal bit for bit: each method
quantizes the float model loaded whole, in memory (:func:`torq.driver.apply_method`: the
driver over the model's layers in memory), and the whole model is evaluated at once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from torq.data import load_eval_text
from torq.driver import apply_method
from torq.eval.perplexity import perplexity, windows_from_text
from torq.export import save_quantized
from torq.export.compressed_tensors import export_compressed_tensors
from torq.export.loading import load_model
from torq.runs.config import RunConfig
from torq.runs.source import saved_model_dir
from torq.runs.store import setting_key
from torq.seeding import method_rng


def whole_model_run(config: RunConfig) -> dict[str, Any]:
    """``{"rows": [{"method", "ppl", "details"}, ...]}`` of ``config``'s methods, each on
    its own float model read whole (saved with ``config.save_dir`` in its ``save_format``)."""
    config = replace(config, methods=tuple(config.specs()))
    qconfig = config.quant_config()
    torch.manual_seed(config.seed)
    source, evaluation, outputs = config.source, config.evaluation, config.outputs
    tokenizer = load_model(source.model, gguf_dtype=source.gguf_dtype).tokenizer
    text = load_eval_text(evaluation.eval_corpus, source.data_dir)
    windows = windows_from_text(text, tokenizer, evaluation.seqlen, evaluation.max_windows)
    rows = []
    for spec in config.specs():
        method = spec.method
        model = load_model(source.model, gguf_dtype=source.gguf_dtype).model
        ctx = spec.context(
            config.capture, tokenizer, model.config, data_dir=source.data_dir, seed=config.seed
        )
        with method_rng(config.seed, setting_key(config.record(), method.name)):
            details = apply_method(method, model, qconfig, ctx)
        if outputs.save_dir is not None and method.quantizes:
            out = saved_model_dir(outputs, source.model, method.name)
            if outputs.save_format == "compressed-tensors":
                export_compressed_tensors(model, out, tokenizer, overwrite=True)
            else:
                save_quantized(model, out, tokenizer, method=method.name, overwrite=True)
            details["saved"] = {"path": str(Path(out))}
        res = perplexity(model, windows, evaluation.batch_size, progress=False)
        rows.append({"method": method.name, "ppl": res.ppl, "details": details})
    return {"rows": rows}
