"""The settings of a comparison run (:class:`RunConfig`, recorded verbatim with its
results); the checks that refuse a run which cannot work are :mod:`torq.runs.checks`."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import torch

from torq.calibration.data import CaptureSettings
from torq.calibration.hidden import HIDDEN_MODES
from torq.data import DEFAULT_EVAL_CORPUS
from torq.driver.budget import BUDGET_BY, PrecisionBudget
from torq.errors import TorqError
from torq.formats import FORMAT_NAMES
from torq.formats.config import ALL_SCALE_MODES, side_scale_modes
from torq.knobs import knob, nonnegative_int, positive_int
from torq.methods.registry import MethodSpec, RunKey, method_specs
from torq.surgery.qlinear import QuantConfig


def ignore_patterns(value: str) -> tuple[str, ...]:
    """An argparse type: comma-separated name patterns (``--ignore``), each a shell-style
    pattern or ``re:`` and a regular expression that compiles."""
    patterns = tuple(p.strip() for p in value.split(",") if p.strip())
    if not patterns:
        raise argparse.ArgumentTypeError("--ignore takes at least one name pattern")
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise argparse.ArgumentTypeError(f"'{pattern}': {exc}") from None
    return patterns


def avg_bits(value: str) -> float:
    """An argparse type: an average number of bits per weight, a number above 4."""
    try:
        bits = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--avg-bits takes a number of bits, not '{value}'"
        ) from None
    if not 4.0 < bits <= 8.25:
        raise argparse.ArgumentTypeError(
            f"--avg-bits takes an average above 4 and at most 8.25 (all MXFP8), not {value}"
        )
    return bits


def format_name(value: str) -> str | None:
    """An argparse type: a 4-bit format's name, or ``none`` (kept in float)."""
    v = value.strip().lower()
    if v in ("none", "fp", "float"):
        return None
    if v not in FORMAT_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown format '{value}'; choose from {', '.join(FORMAT_NAMES)} or none"
        )
    return v


@dataclass(frozen=True)
class ModelSource:
    """Which model a run reads, where it runs and where its data is."""

    model: str = knob(
        "smollm2-135m",
        flag="--model",
        group="model",
        help="embedded default, HF folder, .gguf or hub id",
    )
    # what a GGUF model is de-quantized to, once, in the cache: "float32" (transformers'
    # values; every number in docs/research/) or "bfloat16" (half the disk, rounded)
    gguf_dtype: str = knob(
        "float32",
        flag="--gguf-dtype",
        choices=("float32", "bfloat16"),
        help="what a GGUF model is de-quantized to, once, tensor by tensor, in the cache "
        "(default float32: transformers' values; bfloat16 halves the disk and rounds them)",
    )
    # where the model runs: "cpu", "cuda", "cuda:1", or "auto" (cuda when available); the
    # calibration statistics are summed there and GPTQ runs there
    device: str = knob(
        "cpu",
        flag="--device",
        group="model",
        help="where the model runs: cpu, cuda, cuda:N or auto",
    )
    # keep a saved quantized checkpoint's decoder layers on disk under this folder while it
    # is evaluated (accelerate's device_map offload, :func:`torq.export.load_quantized`):
    # for a model larger than memory; a scratch folder inside it is removed after the run
    offload_dir: str | None = knob(
        None,
        flag="--offload-dir",
        metavar="DIR",
        help="keep a saved quantized checkpoint's decoder layers on disk in a scratch folder "
        "under DIR while it is evaluated, read back one layer at a time (accelerate's "
        "device_map offload): for a model larger than memory, slowly; also for the --tasks "
        "on each method's quantized checkpoint",
    )
    data_dir: str | None = knob(
        None,
        flag="--data-dir",
        metavar="DIR",
        group="data",
        commands=("run", "eval", "quantize"),
        help="data directory (default: $TORQ_DATA_DIR, else the HF hub)",
    )


@dataclass(frozen=True)
class Formats:
    """The 4-bit formats of weights and activations (:class:`QuantConfig` by name)."""

    weight_format: str | None = knob(
        "mxfp4",
        flag="--w-format",
        type=format_name,
        help="weight format, overrides --format ('none' keeps weights in float)",
    )
    act_format: str | None = knob(
        "mxfp4",
        flag="--a-format",
        type=format_name,
        help="activation format, overrides --format ('none' keeps activations in float)",
    )
    scale_mode: str = knob(
        "ocp",
        flag="--scale-mode",
        choices=ALL_SCALE_MODES,
        help="block scale rule: MXFP4's ocp (default), paper, rceil or nearest; NVFP4's ocp, "
        "4over6 (each block scaled to 4 or 6, the less error) or 4over6-weights (on the "
        "weights only, what an engine serves) (a saved quantized model keeps its own)",
    )
    # NVFP4 activations' tensor scale: each tensor's own ("dynamic") or calibrated once per
    # activation quantizer on the calibration windows ("static": what compressed-tensors
    # and vLLM serve, :class:`torq.surgery.qlinear.QuantConfig`)
    act_scale: str = knob(
        "dynamic",
        flag="--act-scale",
        choices=("dynamic", "static"),
        help="NVFP4 activations' tensor scale: each tensor's own (dynamic, default) or one per "
        "activation quantizer calibrated on the calibration windows (static: what "
        "compressed-tensors and vLLM serve; needed to export NVFP4 W4A4)",
    )

    # linears kept in float, by name pattern (:func:`torq.surgery.qlinear.ignored`); lm_head
    # is never quantized
    ignore: tuple[str, ...] = knob(
        (),
        flag="--ignore",
        type=ignore_patterns,
        metavar="PATTERNS",
        group="recipe",
        commands=("run", "quantize"),
        help="keep these linears in float: comma-separated patterns of their names in the "
        "decoder layers (down_proj, layers.0.*, layers.[0-3].mlp.*, re:REGEX); lm_head always",
    )

    # a precision budget (:mod:`torq.driver.budget`): the average stored bits per weight of
    # the quantized linears, the most sensitive input groups kept in MXFP8
    avg_bits: float | None = knob(
        None,
        flag="--avg-bits",
        type=avg_bits,
        metavar="B",
        group="recipe",
        commands=("run", "quantize"),
        everyday_in=("quantize",),
        help="average stored bits per weight of the quantized linears (4.25 is all MXFP4; "
        "e.g. 5): the input groups that hurt most are kept in MXFP8 (8.25 bits) until B",
    )
    budget_by: str = knob(
        "block",
        flag="--budget-by",
        choices=BUDGET_BY,
        commands=("run", "quantize"),
        help="how --avg-bits picks its MXFP8 groups: block (the rise in the layer's output "
        "error, default), linear (the group's own output error), random, ends (first and "
        "last layers)",
    )
    budget_windows: int = knob(
        16,
        flag="--budget-windows",
        type=positive_int,
        metavar="N",
        commands=("run", "quantize"),
        help="how many calibration windows --avg-bits measures the groups' errors on (default "
        "16; the pass costs a forward of each layer per input group on them)",
    )

    def budget(self, seed: int = 0) -> PrecisionBudget | None:
        """The precision budget asked for, if any."""
        if self.avg_bits is None:
            return None
        return PrecisionBudget(self.avg_bits, self.budget_by, self.budget_windows, seed)

    def quant_config(self) -> QuantConfig:
        # an MXFP4 rule leaves other formats on their own (the recipes pass theirs to every
        # format); NVFP4's Four Over Six asked of a run with no NVFP4 side is a mistake
        formats = sorted({f for f in (self.weight_format, self.act_format) if f})
        modes = side_scale_modes(self.weight_format, self.act_format, self.scale_mode)
        if self.scale_mode.startswith("4over6") and set(modes) <= {None, "ocp"}:
            raise TorqError(
                f"--scale-mode {self.scale_mode} is a rule of NVFP4, not of the formats asked "
                f"({', '.join(formats) or 'none'}): add --format nvfp4"
            )
        return QuantConfig.from_names(
            self.weight_format, self.act_format, self.scale_mode, self.act_scale, self.ignore
        )


@dataclass(frozen=True)
class EvalPlan:
    """The perplexity a run measures: on which windows of which text, how."""

    seqlen: int = knob(2048, flag="--seqlen", type=positive_int, help="perplexity window length")
    max_windows: int | None = knob(
        None,
        flag="--max-windows",
        type=positive_int,
        metavar="N",
        group="data",
        help="evaluate only the first N windows",
    )
    # a seeded random sample of this many of the test's windows instead of the first ones
    # (:func:`torq.eval.perplexity.sample_windows`): every row scores the same windows and
    # keeps each one's NLL, so two rows compare window by window
    window_sample: int | None = knob(
        None,
        flag="--window-sample",
        type=positive_int,
        metavar="N",
        help="evaluate N windows drawn at random with --window-sample-seed (the same for every "
        "row) instead of the first ones; ×FP is then the whole test's ratio estimated window "
        "by window, with its 95%% interval",
    )
    window_sample_seed: int = knob(
        0,
        flag="--window-sample-seed",
        type=int,
        metavar="S",
        help="which windows --window-sample draws (default 0)",
    )
    batch_size: int = knob(1, flag="--batch-size", type=positive_int, help="windows a forward")
    # the text perplexity is measured on: "wikitext2-test" (the paper's), "wikipedia-en"
    # (held-out text of ../shared/data) or a text file; its first max_windows windows
    eval_corpus: str = knob(
        DEFAULT_EVAL_CORPUS,
        flag="--eval-corpus",
        metavar="TEXT",
        help="the text perplexity is measured on: wikitext2-test (default, the paper's), "
        "wikipedia-en (held-out Wikipedia articles of the data directory) or a text file",
    )
    skip_ppl: bool = knob(
        False,
        flag="--skip-ppl",
        action="store_true",
        commands=("eval",),
        help="zero-shot tasks only",
    )
    # how the windows' hidden states are kept between layers: "memory" (float32, exact),
    # "bfloat16" (half, rounded), "disk" (float32 files, exact) or "auto" (memory when they
    # fit :data:`torq.pipeline.AUTO_HIDDEN_MEMORY_BYTES`, else disk)
    hidden_states: str = knob(
        "auto",
        flag="--hidden-states",
        choices=("auto", *HIDDEN_MODES),
        help="keep the windows' hidden states between layers in memory in float32 (exact), "
        "in bfloat16 (half the memory; rounds them) or on disk (float32 files read one batch "
        "at a time: exact); auto (default): memory up to 512 MiB of states, else disk",
    )
    # windows longer than the model's context (max_position_embeddings) are refused unless
    allow_long_windows: bool = knob(
        False,
        flag="--allow-long-windows",
        action="store_true",
        help="allow windows (--seqlen, --calib-seqlen) longer than the model's context",
    )
    # evaluate a saved quantized checkpoint with its MXFP4 W4A4 weights kept packed
    # (:class:`torq.kernels.linear.PackedMXFP4Linear`: 4.25 bits a weight in memory, not 32);
    # with --tasks, how each method's quantized checkpoint is loaded for the tasks
    packed: bool = knob(
        False,
        flag="--packed",
        action="store_true",
        help="load a saved quantized checkpoint (torq's or compressed-tensors) with its MXFP4 "
        "W4A4 layers on torq's packed kernels (4.25 bits a weight in memory; the Triton "
        "kernels on a GPU, the same arithmetic on a CPU within 1e-5)",
    )


@dataclass(frozen=True)
class TaskPlan:
    """The zero-shot tasks a run scores through lm-eval (``torq eval``); none: perplexity
    only."""

    tasks: tuple[str, ...] = knob(
        (),
        flag="--tasks",
        group="data",
        commands=("eval",),
        help="zero-shot tasks, comma-separated: arc_challenge, arc_easy, hellaswag, "
        "lambada_openai, piqa, winogrande, or 'all' (read from <data-dir>/zeroshot/, hub "
        "fallback); default none: perplexity only",
    )
    task_limit: int | None = knob(
        None,
        flag="--limit",
        type=positive_int,
        commands=("eval",),
        help="first N examples of each task",
    )
    # a seeded subset of each task's questions instead (:func:`torq.eval.zeroshot.seeded_subset`)
    task_subset: int | None = knob(
        None,
        flag="--subset",
        type=positive_int,
        commands=("eval",),
        help="N questions of each task drawn at random with --subset-seed (the same ones for "
        "every method: rows compare question by question); needs the local task files",
    )
    task_subset_seed: int = knob(
        0,
        flag="--subset-seed",
        type=int,
        commands=("eval",),
        help="which questions --subset draws (default 0)",
    )
    task_batch_size: int = knob(
        8,
        flag="--task-batch-size",
        type=positive_int,
        commands=("eval",),
        help="lm-eval batch size",
    )
    # choices of a question share one forward pass of their context (same scores, faster)
    shared_context: bool = knob(
        True,
        flag="--no-shared-context",
        action="store_true",
        value=lambda off: not off,
        commands=("eval",),
        help="score each choice with its own forward pass (lm-eval's HFLM as it is)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.task_limit is not None and self.task_subset is not None:
            raise ValueError("--limit and --subset: the first N questions or N drawn, not both")


@dataclass(frozen=True)
class Outputs:
    """What a run writes besides its record: quantized models, kept progress."""

    # write each quantized model as a checkpoint folder <save_dir>/<model>-<method>
    # (packed 4-bit weights and the online transforms, :mod:`torq.export`)
    save_dir: str | None = knob(
        None,
        flag="--save-dir",
        metavar="DIR",
        group="output",
        help="write each quantized model to DIR/<model>-<method>/ (config, tokenizer, packed "
        "4-bit weights and the online transforms, a shard per layer written as it is done); "
        "evaluate it later with --model DIR/<model>-<method>, or load it with torq.load",
    )
    # what --save-dir writes: torq's own checkpoint ("torq"), or "compressed-tensors"
    # (transformers, vLLM; rtn, gptq, had32, had32+gptq)
    save_format: str = knob(
        "torq",
        flag="--save-format",
        choices=("torq", "compressed-tensors"),
        group="output",
        help="what --save-dir writes: torq's checkpoint, or compressed-tensors for transformers "
        "and vLLM (rtn, gptq, had32, had32+gptq, torq-had32 with --fold-balance; MXFP4, or "
        "NVFP4 weights with --a-format none; see torq export)",
    )
    # where each method's progress is kept as it goes (its layers, zero-shot answers, its
    # finished row), a sub-directory per method and setting (:func:`method_resume_dir`): the
    # same run again after a stop does only what is missing
    resume_dir: str | None = knob(
        None,
        flag="--resume-dir",
        metavar="DIR",
        group="output",
        help="keep each method's progress in DIR as it goes (its quantized layers, zero-shot "
        "answers, its finished row): the same command again after a stop continues after the "
        "last layer kept and measures only what is missing",
    )


# the run's typed parts, each recorded with its fields at the top of the record
PARTS: dict[str, type] = {
    "source": ModelSource,
    "formats": Formats,
    "evaluation": EvalPlan,
    "zeroshot": TaskPlan,
    "outputs": Outputs,
}


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a comparison run, in typed parts (:data:`PARTS`) that
    each consumer takes on its own; recorded verbatim with its results (:meth:`record`)."""

    # each method with its own settings (:class:`MethodSpec`, :func:`method_spec`); a bare
    # name is that method with its settings' defaults (:meth:`specs`)
    methods: tuple[MethodSpec | str, ...] = ("fp", "rtn")
    source: ModelSource = field(default_factory=ModelSource)
    formats: Formats = field(default_factory=Formats)
    # the calibration every calibrating method reads alike (windows, reservoir, sequential)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    seed: int = knob(
        0,
        flag="--seed",
        type=nonnegative_int,
        help="seed of QuaRot's random Hadamard signs (calibration draws: --calib-seed)",
    )
    evaluation: EvalPlan = field(default_factory=EvalPlan)
    zeroshot: TaskPlan = field(default_factory=TaskPlan)
    outputs: Outputs = field(default_factory=Outputs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", tuple(self.methods))

    @classmethod
    def of(cls, **settings: Any) -> RunConfig:
        """A run from its settings by name (``model=``, ``seqlen=``…, each in its part)."""
        owner = {f.name: part for part, kind in PARTS.items() for f in fields(kind)}
        parts: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
        top: dict[str, Any] = {}
        for name, value in settings.items():
            if name in owner:
                parts[owner[name]][name] = value
            elif name in ("methods", "capture", "seed"):
                top[name] = value
            else:
                raise TypeError(f"unknown run setting '{name}'")
        return cls(**top, **{part: PARTS[part](**given) for part, given in parts.items()})

    def replace(self, **settings: Any) -> RunConfig:
        """This run with some settings changed by name, as :meth:`of` takes them."""
        return RunConfig.of(**{**self.settings(), **settings})

    def settings(self) -> dict[str, Any]:
        """Every setting by name (values, not dicts): what :meth:`of` takes back."""
        named: dict[str, Any] = {
            "methods": self.methods,
            "capture": self.capture,
            "seed": self.seed,
        }
        for part in PARTS:
            value = getattr(self, part)
            named.update({f.name: getattr(value, f.name) for f in fields(value)})
        return named

    def record(self) -> dict[str, Any]:
        """The run as its record keeps it: every setting at the top, as JSON values."""
        return {
            k: [m if isinstance(m, str) else asdict(m) for m in v]
            if k == "methods"
            else (asdict(v) if is_dataclass(v) else list(v) if isinstance(v, tuple) else v)
            for k, v in self.settings().items()
        }

    def key(self) -> RunKey:
        """What of the run makes each method's quantized model, besides its own settings."""
        return RunKey(
            model=self.source.model,
            weight_format=self.formats.weight_format,
            act_format=self.formats.act_format,
            scale_mode=self.formats.scale_mode,
            act_scale=self.formats.act_scale,
            ignore=self.formats.ignore,
            avg_bits=self.formats.avg_bits,
            budget_by=self.formats.budget_by,
            budget_windows=self.formats.budget_windows,
            seqlen=self.evaluation.seqlen,
            gguf_dtype=self.source.gguf_dtype,
            seed=self.seed,
        )

    def quant_config(self) -> QuantConfig:
        return self.formats.quant_config()

    def specs(self) -> list[MethodSpec]:
        """The run's methods as specs, each once (a bare name: its settings' defaults)."""
        return method_specs(list(self.methods))

    def method_names(self) -> list[str]:
        """The methods' names as given (a saved model's method need not be registered)."""
        return [m.name if isinstance(m, MethodSpec) else m for m in self.methods]


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
