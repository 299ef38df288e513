"""What torq's research scripts (``benchmarks/``) use beyond the public API (:mod:`torq`):
the building blocks of the methods, the formats, the evaluation and the runs, by the names
they have in their modules. Research code, not the product: names here may change between
releases; everything a user needs is in :mod:`torq`. A test holds the scripts to it.

The names are imported on first use, each from its own module, so that a script (or a
vLLM environment without lm-eval) pays only for what it reads."""

from __future__ import annotations

import importlib
from typing import Any

# each name: (its module, its name there)
_NAMES: dict[str, tuple[str, str]] = {
    "accuracy_perplexity_figure": ("torq.eval.figure", "accuracy_perplexity_figure"),
    "Answer": ("torq.eval.paired", "Answer"),
    "apply_method": ("torq.driver", "apply_method"),
    "balance_scales": ("torq.rotations.balance", "balance_scales"),
    "block_hadamard": ("torq.methods.hadamard", "block_hadamard"),
    "block_mass_permutation": ("torq.rotations.balance", "block_mass_permutation"),
    "BlockRotation": ("torq.rotations.transform", "BlockRotation"),
    "BlockStatistics": ("torq.calibration.capture", "BlockStatistics"),
    "build_questions": ("torq.eval.paired", "build_questions"),
    "calibrate_layerwise": ("torq.driver", "calibrate_layerwise"),
    "calibration_windows": ("torq.calibration.data", "calibration_windows"),
    "CalibrationConfig": ("torq.calibration.data", "CalibrationConfig"),
    "CaptureSettings": ("torq.calibration.data", "CaptureSettings"),
    "channel_energy": ("torq.rotations.balance", "channel_energy"),
    "check_destination": ("torq.paths", "check_destination"),
    "check_problem_count": ("torq.eval.generation", "check_problem_count"),
    "check_problem_indices": ("torq.eval.generation", "check_problem_indices"),
    "check_prompt": ("torq.eval.generation", "check_prompt"),
    "command_line": ("torq.results", "command_line"),
    "compare_rows": ("torq.eval.paired", "compare_rows"),
    "config": ("torq.kernels", "config"),
    "convert_gguf": ("torq.models.loading", "convert_gguf"),
    "convert_gguf_tensorwise": ("torq.models.gguf", "convert_gguf_tensorwise"),
    "cpu_kernel": ("torq.formats", "cpu_kernel"),
    "decoder_layers": ("torq.models.architecture", "decoder_layers"),
    "dequantize_weight_fp8": ("torq.kernels.launch", "dequantize_weight_fp8"),
    "embed_windows": ("torq.models.streaming", "embed_windows"),
    "evaluate_gsm8k": ("torq.eval.generation", "evaluate_gsm8k"),
    "evaluate_humaneval": ("torq.eval.generation", "evaluate_humaneval"),
    "evaluate_zeroshot": ("torq.eval.zeroshot", "evaluate_zeroshot"),
    "exact_pow2": ("torq.formats.packing", "exact_pow2"),
    "export_compressed_tensors": ("torq.export.compressed_tensors", "export_compressed_tensors"),
    "fake_quantize": ("torq.formats", "fake_quantize"),
    "fake_quantize_reference": ("torq.formats.reference", "fake_quantize_reference"),
    "fingerprint_ids": ("torq.models.fingerprint", "fingerprint_ids"),
    "fit_intra_block_rotation": ("torq.rotations.intra_block", "fit_intra_block_rotation"),
    "FolderStore": ("torq.runs.store", "FolderStore"),
    "formats": ("torq", "formats"),
    "FormatSpec": ("torq.formats", "FormatSpec"),
    "FP8_EXACT_SPAN": ("torq.kernels.config", "FP8_EXACT_SPAN"),
    "generate_humaneval": ("torq.eval.generation", "generate_humaneval"),
    "get_format": ("torq.formats", "get_format"),
    "get_method": ("torq.methods", "get_method"),
    "GGUF_DTYPES": ("torq.models.gguf", "GGUF_DTYPES"),
    "greedy_decode": ("torq.models.decoding", "greedy_decode"),
    "GROUPED_MAX_SLOTS": ("torq.kernels.experts", "GROUPED_MAX_SLOTS"),
    "GPTQConfig": ("torq.surgery.gptq", "GPTQConfig"),
    "gptq_quantize": ("torq.surgery.gptq", "gptq_quantize"),
    "GroupSolver": ("torq.methods.layers", "GroupSolver"),
    "GSM8K_FILES": ("torq.eval.generation", "GSM8K_FILES"),
    "GSM8K_TASK": ("torq.eval.generation", "GSM8K_TASK"),
    "gsm8k_task_yaml": ("torq.eval.generation", "gsm8k_task_yaml"),
    "gsm8k_test_size": ("torq.eval.generation", "gsm8k_test_size"),
    "hadamard_matrix": ("torq.rotations.hadamard", "hadamard_matrix"),
    "inter_block_rotations": ("torq.rotations.inter_block", "inter_block_rotations"),
    "InterBlockConfig": ("torq.rotations.inter_block", "InterBlockConfig"),
    "intra_block": ("torq.rotations", "intra_block"),
    "IntraBlockConfig": ("torq.rotations.intra_block", "IntraBlockConfig"),
    "keep_model": ("torq.runs.kept", "keep_model"),
    "KernelConfig": ("torq.kernels", "KernelConfig"),
    "kernels": ("torq.formats", "kernels"),
    "layer_plan": ("torq.methods.layers", "layer_plan"),
    "LayerStream": ("torq.models.streaming", "LayerStream"),
    "LinearGroup": ("torq.calibration.capture", "LinearGroup"),
    "lm_eval_tasks_dir": ("torq.eval.zeroshot", "_lm_eval_tasks_dir"),
    "load": ("torq.models", "load"),
    "load_compressed_tensors": ("torq.export.compressed_tensors", "load_compressed_tensors"),
    "load_humaneval": ("torq.eval.humaneval", "load_humaneval"),
    "load_kept_model": ("torq.runs.kept", "load_kept_model"),
    "load_model": ("torq.export.loading", "load_model"),
    "load_wikitext2_test": ("torq.data", "load_wikitext2_test"),
    "LoadedModel": ("torq.models", "LoadedModel"),
    "machine_info": ("torq.results", "machine_info"),
    "main": ("torq.cli", "main"),
    "markdown_table": ("torq.runs.report", "markdown_table"),
    "MAX_GEN_TOKS": ("torq.eval.generation", "MAX_GEN_TOKS"),
    "method_rng": ("torq.seeding", "method_rng"),
    "method_spec": ("torq.methods.registry", "method_spec"),
    "MethodContext": ("torq.methods", "MethodContext"),
    "mx_scale_exponent": ("torq.formats.reference", "mx_scale_exponent"),
    "mxfp4_linear": ("torq.kernels", "mxfp4_linear"),
    "MXFP4Weight": ("torq.kernels", "MXFP4Weight"),
    "now_iso": ("torq.results", "now_iso"),
    "output_error": ("torq.methods.torq_rotation", "output_error"),
    "PackedMXFP4Experts": ("torq.kernels.experts", "PackedMXFP4Experts"),
    "paired_difference": ("torq.eval.paired", "paired_difference"),
    "paired_log_ratio": ("torq.eval.perplexity", "paired_log_ratio"),
    "parse_tasks": ("torq.eval.zeroshot", "parse_tasks"),
    "perplexity": ("torq.eval", "perplexity"),
    "prepare_tasks": ("torq.eval.zeroshot", "prepare_tasks"),
    "PROMPTS": ("torq.eval.generation", "PROMPTS"),
    "qlinear": ("torq.surgery", "qlinear"),
    "QRONOS_SETTINGS": ("torq.methods.registry", "QRONOS_SETTINGS"),
    "QuantConfig": ("torq.surgery", "QuantConfig"),
    "quantize": ("torq.formats", "quantize"),
    "quantize_activation": ("torq.kernels.launch", "quantize_activation"),
    "quantize_activation_fp8": ("torq.kernels.launch", "quantize_activation_fp8"),
    "quantize_model": ("torq.surgery.apply", "quantize_model"),
    "QuantLinear": ("torq.surgery", "QuantLinear"),
    "question_scores": ("torq.eval.paired", "question_scores"),
    "quiet_libraries": ("torq.logs", "quiet_libraries"),
    "read_record": ("torq.results", "read_record"),
    "RECIPES": ("torq.methods.recipes", "RECIPES"),
    "record_setting": ("torq.runs.kept", "record_setting"),
    "reference_linear": ("torq.kernels", "reference_linear"),
    "register": ("torq.methods.registry", "register"),
    "ResidentPeak": ("torq.models.streaming", "ResidentPeak"),
    "resolve_data_dir": ("torq.data", "resolve_data_dir"),
    "resolve_device": ("torq.runs.config", "resolve_device"),
    "resolve_embedded_gguf": ("torq.models.loading", "resolve_embedded_gguf"),
    "round_to_e2m1": ("torq.formats.reference", "round_to_e2m1"),
    "run": ("torq.pipeline", "run"),
    "run_layerwise": ("torq.driver", "run_layerwise"),
    "RunConfig": ("torq.runs.config", "RunConfig"),
    "RunKey": ("torq.methods.registry", "RunKey"),
    "sample_windows": ("torq.eval.perplexity", "sample_windows"),
    "score": ("torq.eval.humaneval", "score"),
    "served_unrotated": ("torq.models.architecture", "served_unrotated"),
    "sessions_seconds": ("torq.eval.zeroshot", "sessions_seconds"),
    "setting_key": ("torq.runs.store", "setting_key"),
    "SharedContextHFLM": ("torq.eval.shared_context", "SharedContextHFLM"),
    "streaming": ("torq.models", "streaming"),
    "TASKS": ("torq.eval.zeroshot", "TASKS"),
    "TORQ_INTRA_DEFAULTS": ("torq.methods.settings", "TORQ_INTRA_DEFAULTS"),
    "TorqError": ("torq.errors", "TorqError"),
    "TorqSettings": ("torq.methods", "TorqSettings"),
    "TUNED_CONFIGS": ("torq.kernels.config", "TUNED_CONFIGS"),
    "versions": ("torq.results", "versions"),
    "windows_from_text": ("torq.eval", "windows_from_text"),
    "write_json_atomic": ("torq.paths", "write_json_atomic"),
    "write_record": ("torq.results", "write_record"),
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'torq.experimental' has no attribute {name!r}")
    module, attr = _NAMES[name]
    owner = importlib.import_module(module)
    value = (
        getattr(owner, attr)
        if hasattr(owner, attr)
        else importlib.import_module(f"{module}.{attr}")
    )
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return __all__
