"""Shared fixtures: tiny randomly initialised models of every supported architecture,
a tiny offline tokenizer, and a tiny data directory laid out like ``../shared/data``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, torq's Triton kernels run in Triton's CPU interpreter. Triton reads this
# when it is first imported (torchao imports it too), so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite on pytest-xdist workers, one per core: each worker takes its
# share of the cores, since torch's default (every core in every process) would have the
# workers' threads fight over them. A test that needs more threads sets them itself.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3_text")
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Vocabulary size of the tiny BPE tokenizer below (small models keep tests fast).
TINY_VOCAB = 384


def tiny_config(model_type: str, vocab_size: int = TINY_VOCAB, **widths: int):
    """A tiny config of ``model_type``: 2 layers, hidden size 64, 4 heads of 16 (2 of keys
    and values); ``widths`` replace those (``benchmarks/tiny_folder.py``'s heads of 64)."""
    from transformers import AutoConfig

    extra: dict = {}
    if model_type == "qwen3_moe":
        extra = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if model_type == "qwen2_moe":  # with its shared expert, as small as the experts
        extra = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if model_type == "mixtral":
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2}
    if model_type == "qwen2":
        extra = {"use_sliding_window": False}
    if model_type == "phi3":
        extra = {"pad_token_id": 0}  # (its default, 32000, is past the tiny vocabulary)
    return AutoConfig.for_model(model_type, **_tiny_text(vocab_size, **widths), **extra)


def _tiny_text(vocab_size: int = TINY_VOCAB, **widths: int) -> dict:
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
    } | widths


def calibrated_context(
    tokenizer, corpus: str, n_samples: int = 4, seqlen: int = 48, max_iter: int = 2,
    reservoir: int = 64,
):  # fmt: skip
    """A method's context for a short calibration on ``corpus`` (TORQ's settings with
    ``max_iter`` solver steps)."""
    from torq.calibration.data import CalibrationConfig, CaptureSettings
    from torq.methods import MethodContext, TorqSettings
    from torq.rotations.intra_block import IntraBlockConfig

    calibration = CalibrationConfig(corpus=corpus, n_samples=n_samples, seqlen=seqlen)
    return MethodContext(
        tokenizer=tokenizer,
        options={"progress": False},
        settings=TorqSettings(intra=IntraBlockConfig(max_iter=max_iter)),
        capture=CaptureSettings(calibration, reservoir_tokens=reservoir),
    )


def tiny_model(model_type: str, seed: int = 0, vocab_size: int = TINY_VOCAB, **widths: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(model_type, vocab_size, **widths), dtype=torch.float32
    )
    # from_config uses small init; widen it so activations have realistic spread.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


def tiny_gemma3_of_text_and_images(seed: int = 0, **widths: int):
    """A tiny Gemma 3 of text and images (``Gemma3ForConditionalGeneration``: its decoder's
    settings in ``text_config``, a one-layer vision tower beside it), its norms' weights
    moved off their start too."""
    from transformers import AutoModelForImageTextToText, Gemma3Config

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = Gemma3Config(
        text_config=_tiny_text(**widths), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=TINY_VOCAB - 1, boi_token_index=TINY_VOCAB - 3,
        eoi_token_index=TINY_VOCAB - 2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


# How far a TF32 calibration may move a tiny random model's perplexity from the CPU's exact
# one: as far as a new calibration seed moves it. On the two-window test models (perplexity
# ~470, 64 calibration tokens) TF32's rounding flips GPTQ's choices like any perturbation:
# measured on an H200 +6.3 % (`torq-had32+gptaq`), in a CPU emulation of TF32's rounding
# +4.9 %, and a new calibration seed moves the same rows by up to 5.4 %. What TF32 computes
# is held to its rounding by `test_gpu_tf32_statistics_are_exact_to_tf32s_rounding`; what it
# costs a real model is measured by `benchmarks/gpu.py --parts arithmetic`.
TF32_TINY_REL = 0.10

TINY_TEXT = (
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical "
    "role @-@ playing video game developed by Sega and Media.Vision for the PlayStation Portable . "
    "Released in January 2011 in Japan , it is the third game in the Valkyria series . \n"
)


def build_tiny_tokenizer():
    """A byte-level BPE trained on a few sentences: offline and instant."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<eos>"], show_progress=False
    )
    tok.train_from_iterator([TINY_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    assert len(fast) <= TINY_VOCAB
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """:func:`build_tiny_tokenizer`'s, once for the session."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "wikitext-2-raw").mkdir()
    (root / "wikitext-2-raw" / "wiki.test.raw").write_text(TINY_TEXT * 40, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_calibration_data_dir(tmp_path_factory) -> Path:
    """A data directory with the WikiText-2 test file and a calibration corpus
    (``wikitext-2/wiki.valid.tokens``), for runs whose methods calibrate."""
    root = tmp_path_factory.mktemp("calib-data")
    (root / "wikitext-2-raw").mkdir()
    (root / "wikitext-2-raw" / "wiki.test.raw").write_text(TINY_TEXT * 40, encoding="utf-8")
    (root / "wikitext-2").mkdir()
    (root / "wikitext-2" / "wiki.valid.tokens").write_text(TINY_TEXT * 80, encoding="utf-8")
    return root


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_tokenizer) -> Path:
    """A tiny llama saved as an ordinary Hugging Face folder."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "tiny-llama")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    env = os.environ.get("TORQ_DATA_DIR")
    path = Path(env) if env else SHARED_DATA
    if not (path / "wikitext-2-raw" / "wiki.test.raw").is_file():
        pytest.fail(f"real-model tests need the shared data; not found under {path}")
    return path
