"""Evaluation: WikiText-2 perplexity (and, later, zero-shot tasks)."""

from torq.eval.data import load_wikitext2_test, resolve_data_dir
from torq.eval.perplexity import PerplexityResult, perplexity, windows_from_text

__all__ = [
    "PerplexityResult",
    "load_wikitext2_test",
    "perplexity",
    "resolve_data_dir",
    "windows_from_text",
]
