"""The settings of a comparison run (:class:`RunConfig`, recorded verbatim with its
results); the checks that refuse a run which cannot work are :mod:`torq.runs.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torq.calibration.data import CaptureSettings
from torq.data import DEFAULT_EVAL_CORPUS
from torq.errors import TorqError
from torq.methods.registry import MethodContext, MethodSpec, method_specs
from torq.surgery.qlinear import QuantConfig


@dataclass
class RunConfig:
    """Everything that determines a comparison run; recorded verbatim with its results."""

    model: str = "smollm2-135m"
    # each method with its own settings (:class:`MethodSpec`, :func:`method_spec`); a bare
    # name is that method with its settings' defaults (:meth:`specs`)
    methods: list[MethodSpec | str] = field(default_factory=lambda: ["fp", "rtn"])
    weight_format: str | None = "mxfp4"
    act_format: str | None = "mxfp4"
    scale_mode: str = "ocp"
    # NVFP4 activations' tensor scale: each tensor's own ("dynamic") or calibrated once per
    # activation quantizer on the calibration windows ("static": what compressed-tensors
    # and vLLM serve, :class:`torq.surgery.qlinear.QuantConfig`)
    act_scale: str = "dynamic"
    seqlen: int = 2048
    max_windows: int | None = None
    # a seeded random sample of this many of the test's windows instead of the first ones
    # (:func:`torq.eval.perplexity.sample_windows`): every row scores the same windows and
    # keeps each one's NLL, so two rows compare window by window
    window_sample: int | None = None
    window_sample_seed: int = 0
    batch_size: int = 1
    data_dir: str | None = None
    seed: int = 0
    # the calibration every calibrating method reads alike (windows, reservoir, sequential)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    # zero-shot tasks through lm-eval (``torq eval``); empty: perplexity only
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None
    # a seeded subset of each task's questions instead (:func:`torq.eval.zeroshot.seeded_subset`)
    task_subset: int | None = None
    task_subset_seed: int = 0
    task_batch_size: int = 8
    # choices of a question share one forward pass of their context (same scores, faster)
    shared_context: bool = True
    skip_ppl: bool = False
    # where each method's progress is kept as it goes (its layers, zero-shot answers, its
    # finished row), a sub-directory per method and setting (:func:`method_resume_dir`): the
    # same run again after a stop does only what is missing
    resume_dir: str | None = None
    # where the model runs: "cpu", "cuda", "cuda:1", or "auto" (cuda when available); the
    # calibration statistics are summed there and GPTQ runs there; TORQ's rotation solvers
    # run on the CPU
    device: str = "cpu"
    # write each quantized model as a checkpoint folder <save_dir>/<model>-<method>
    # (packed 4-bit weights and the online transforms, :mod:`torq.export`)
    save_dir: str | None = None
    # windows longer than the model's context (max_position_embeddings) are refused unless
    allow_long_windows: bool = False
    # what --save-dir writes: torq's own checkpoint ("torq"), or "compressed-tensors"
    # (transformers, vLLM; rtn, gptq, had32, had32+gptq)
    save_format: str = "torq"
    # evaluate a saved quantized checkpoint with its MXFP4 W4A4 weights kept packed
    # (:class:`torq.kernels.linear.PackedMXFP4Linear`: 4.25 bits a weight in memory, not 32);
    # with --tasks, how each method's quantized checkpoint is loaded for the tasks
    packed: bool = False
    # what a GGUF model is de-quantized to, once, in the cache: "float32" (transformers'
    # values; every number in docs/research-log.md) or "bfloat16" (half the disk, rounded)
    gguf_dtype: str = "float32"
    # keep a saved quantized checkpoint's decoder layers on disk under this folder while it
    # is evaluated (accelerate's device_map offload, :func:`torq.export.load_quantized`):
    # for a model larger than memory; a scratch folder inside it is removed after the run
    offload_dir: str | None = None
    # how the windows' hidden states are kept between layers: "memory" (float32, exact),
    # "bfloat16" (half, rounded), "disk" (float32 files, exact) or "auto" (memory when they
    # fit :data:`torq.pipeline.AUTO_HIDDEN_MEMORY_BYTES`, else disk)
    hidden_states: str = "auto"
    # the text perplexity is measured on: "wikitext2-test" (the paper's), "wikipedia-en"
    # (held-out text of ../shared/data) or a text file; its first max_windows windows
    eval_corpus: str = DEFAULT_EVAL_CORPUS

    def quant_config(self) -> QuantConfig:
        return QuantConfig.from_names(
            self.weight_format, self.act_format, self.scale_mode, self.act_scale
        )

    def specs(self) -> list[MethodSpec]:
        """The run's methods as specs, each once (a bare name: its settings' defaults)."""
        return method_specs(self.methods)

    def method_names(self) -> list[str]:
        """The methods' names as given (a saved model's method need not be registered)."""
        return [m.name if isinstance(m, MethodSpec) else m for m in self.methods]


def method_context(
    config: RunConfig, spec: MethodSpec, tokenizer: Any, progress: bool, model_config: Any = None
) -> MethodContext:
    """What the method ``spec`` of the run reads beyond the model."""
    return spec.context(
        config.capture,
        tokenizer,
        model_config,
        data_dir=config.data_dir,
        progress=progress,
        seed=config.seed,
    )


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → the first CUDA device when one is visible, else the CPU; any other name
    is checked: asking for CUDA on a machine without it is an error, not a silent CPU run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TorqError(f"unknown device '{name}' (use cpu, cuda, cuda:N or auto)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TorqError(f"device '{name}' asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise TorqError(f"device '{name}' is not supported (use cpu, cuda, cuda:N or auto)")
    return device
