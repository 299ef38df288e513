"""Evaluation metrics: perplexity, zero-shot tasks through lm-eval, generation tasks, paired
comparisons."""

from torq.data import load_wikitext2_test, resolve_data_dir
from torq.eval.perplexity import PerplexityResult, perplexity, windows_from_text

__all__ = [
    "PerplexityResult",
    "load_wikitext2_test",
    "perplexity",
    "resolve_data_dir",
    "windows_from_text",
]
