"""What torq's research scripts (``benchmarks/``) use beyond the public API (:mod:`torq`):
the building blocks of the methods, the formats, the evaluation and the runs, by the names
they have in their modules. Research code, not the product: names here may change between
releases; everything a user needs is in :mod:`torq`. A test holds the scripts to it."""

from __future__ import annotations

from torq import formats
from torq.calibration.capture import BlockStatistics, LinearGroup
from torq.calibration.data import CalibrationConfig, CaptureSettings, calibration_windows
from torq.cli import main
from torq.data import load_wikitext2_test, resolve_data_dir
from torq.driver import apply_method, calibrate_layerwise, run_layerwise
from torq.errors import TorqError
from torq.eval import perplexity, windows_from_text
from torq.eval.figure import accuracy_perplexity_figure
from torq.eval.generation import (
    GSM8K_FILES,
    GSM8K_TASK,
    MAX_GEN_TOKS,
    PROMPTS,
    check_problem_count,
    check_problem_indices,
    check_prompt,
    evaluate_gsm8k,
    evaluate_humaneval,
    generate_humaneval,
    gsm8k_task_yaml,
    gsm8k_test_size,
)
from torq.eval.humaneval import load_humaneval, score
from torq.eval.paired import (
    Answer,
    build_questions,
    compare_rows,
    paired_difference,
    question_scores,
)
from torq.eval.perplexity import paired_log_ratio, sample_windows
from torq.eval.shared_context import SharedContextHFLM
from torq.eval.zeroshot import (
    TASKS,
    evaluate_zeroshot,
    parse_tasks,
    prepare_tasks,
    sessions_seconds,
)
from torq.eval.zeroshot import _lm_eval_tasks_dir as lm_eval_tasks_dir
from torq.export.compressed_tensors import export_compressed_tensors, load_compressed_tensors
from torq.export.loading import load_model
from torq.formats import FormatSpec, cpu_kernel, fake_quantize, get_format, kernels, quantize
from torq.formats.packing import exact_pow2
from torq.formats.reference import fake_quantize_reference, mx_scale_exponent, round_to_e2m1
from torq.kernels import KernelConfig, MXFP4Weight, config, mxfp4_linear, reference_linear
from torq.kernels.config import FP8_EXACT_SPAN, TUNED_CONFIGS
from torq.kernels.experts import GROUPED_MAX_SLOTS, PackedMXFP4Experts
from torq.kernels.launch import dequantize_weight_fp8, quantize_activation, quantize_activation_fp8
from torq.logs import quiet_libraries
from torq.methods import MethodContext, TorqSettings, get_method
from torq.methods.hadamard import block_hadamard
from torq.methods.layers import GroupSolver, layer_plan
from torq.methods.recipes import RECIPES
from torq.methods.registry import QRONOS_SETTINGS, RunKey, method_spec, register
from torq.methods.settings import TORQ_INTRA_DEFAULTS
from torq.methods.torq_rotation import output_error
from torq.models import LoadedModel, load, streaming
from torq.models.architecture import decoder_layers
from torq.models.decoding import greedy_decode
from torq.models.fingerprint import fingerprint_ids
from torq.models.gguf import GGUF_DTYPES, convert_gguf_tensorwise
from torq.models.loading import convert_gguf, resolve_embedded_gguf
from torq.models.streaming import LayerStream, ResidentPeak, embed_windows
from torq.paths import check_destination, write_json_atomic
from torq.pipeline import run
from torq.results import (
    command_line,
    machine_info,
    now_iso,
    read_record,
    versions,
    write_record,
)
from torq.rotations import intra_block
from torq.rotations.balance import balance_scales, block_mass_permutation, channel_energy
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.inter_block import InterBlockConfig, inter_block_rotations
from torq.rotations.intra_block import IntraBlockConfig, fit_intra_block_rotation
from torq.rotations.transform import BlockRotation
from torq.runs.config import RunConfig, resolve_device
from torq.runs.kept import keep_model, load_kept_model, record_setting
from torq.runs.report import markdown_table
from torq.runs.store import FolderStore, setting_key
from torq.seeding import method_rng
from torq.surgery import QuantConfig, QuantLinear, qlinear
from torq.surgery.apply import quantize_model

__all__ = [
    "FP8_EXACT_SPAN",
    "GGUF_DTYPES",
    "GROUPED_MAX_SLOTS",
    "GSM8K_FILES",
    "GSM8K_TASK",
    "MAX_GEN_TOKS",
    "PROMPTS",
    "QRONOS_SETTINGS",
    "RECIPES",
    "TASKS",
    "TORQ_INTRA_DEFAULTS",
    "TUNED_CONFIGS",
    "Answer",
    "BlockRotation",
    "BlockStatistics",
    "CalibrationConfig",
    "CaptureSettings",
    "FolderStore",
    "FormatSpec",
    "GroupSolver",
    "InterBlockConfig",
    "IntraBlockConfig",
    "KernelConfig",
    "LayerStream",
    "LinearGroup",
    "LoadedModel",
    "MXFP4Weight",
    "MethodContext",
    "PackedMXFP4Experts",
    "QuantConfig",
    "QuantLinear",
    "ResidentPeak",
    "RunConfig",
    "RunKey",
    "SharedContextHFLM",
    "TorqError",
    "TorqSettings",
    "accuracy_perplexity_figure",
    "apply_method",
    "balance_scales",
    "block_hadamard",
    "block_mass_permutation",
    "build_questions",
    "calibrate_layerwise",
    "calibration_windows",
    "channel_energy",
    "check_destination",
    "check_problem_count",
    "check_problem_indices",
    "check_prompt",
    "command_line",
    "compare_rows",
    "config",
    "convert_gguf",
    "convert_gguf_tensorwise",
    "cpu_kernel",
    "decoder_layers",
    "dequantize_weight_fp8",
    "embed_windows",
    "evaluate_gsm8k",
    "evaluate_humaneval",
    "evaluate_zeroshot",
    "exact_pow2",
    "export_compressed_tensors",
    "fake_quantize",
    "fake_quantize_reference",
    "fingerprint_ids",
    "fit_intra_block_rotation",
    "formats",
    "generate_humaneval",
    "get_format",
    "get_method",
    "greedy_decode",
    "gsm8k_task_yaml",
    "gsm8k_test_size",
    "hadamard_matrix",
    "inter_block_rotations",
    "intra_block",
    "keep_model",
    "kernels",
    "layer_plan",
    "lm_eval_tasks_dir",
    "load",
    "load_compressed_tensors",
    "load_humaneval",
    "load_kept_model",
    "load_model",
    "load_wikitext2_test",
    "machine_info",
    "main",
    "markdown_table",
    "method_rng",
    "method_spec",
    "mx_scale_exponent",
    "mxfp4_linear",
    "now_iso",
    "output_error",
    "paired_difference",
    "paired_log_ratio",
    "parse_tasks",
    "perplexity",
    "prepare_tasks",
    "qlinear",
    "quantize",
    "quantize_activation",
    "quantize_activation_fp8",
    "quantize_model",
    "question_scores",
    "quiet_libraries",
    "read_record",
    "record_setting",
    "reference_linear",
    "register",
    "resolve_data_dir",
    "resolve_device",
    "resolve_embedded_gguf",
    "round_to_e2m1",
    "run",
    "run_layerwise",
    "sample_windows",
    "score",
    "sessions_seconds",
    "setting_key",
    "streaming",
    "versions",
    "windows_from_text",
    "write_json_atomic",
    "write_record",
]
