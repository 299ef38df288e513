"""Offline rotations fused into the weights: RMSNorm folding, untied embeddings, a rotation
of the residual stream, and a rotation of the attention head dimension (QuaRot, Ashkboos et
al. 2024, §4; SpinQuant's R1/R2).

The residual stream is a row vector ``h``; a linear layer computes ``h Wᵀ``. With an
orthogonal ``Q`` and the stream rotated to ``h Q``:

* a layer that reads the stream (q/k/v, gate/up, lm_head) becomes ``W Q``;
* a layer that writes it (o_proj, down_proj, and the embedding) becomes ``Qᵀ W`` (bias
  ``Qᵀ b``), the embedding table ``E Q``;
* RMSNorm commutes with ``Q`` once its weight ``γ`` is folded into the layers that read
  its output (``W diag(γ)``, ``γ ← 1``), since ``‖h Q‖ = ‖h‖``.

So the rotated model computes the same function, with no online cost. The head-dimension
rotation ``H`` (per head, ``hd × hd``) rotates v_proj's output rows (``H W_v,h``) and
o_proj's matching input columns (``W_o,h Hᵀ``): attention mixes tokens, not channels, so
the two cancel. Supported: decoder layers with ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm`` and plain
(``γ ⊙ x̂``) RMSNorms, i.e. Llama, Mistral, Qwen2, Qwen3. Gemma (``(1 + γ)`` norms,
post-norms) and fused MoE experts are refused with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

from torq.errors import TorqError
from torq.models.architecture import decoder_layers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
READERS_ATTN = ("q_proj", "k_proj", "v_proj")
READERS_MLP = ("gate_proj", "up_proj")


def check_supported(model: nn.Module) -> None:
    """Raise :class:`TorqError` unless the residual-stream fusion is exact for ``model``."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TorqError(
            f"residual-stream rotation supports {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"'{model_type}' has norms or blocks it cannot fuse exactly"
        )
    for layer in decoder_layers(model):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        ok = (
            attn is not None
            and mlp is not None
            and all(
                isinstance(getattr(attn, n, None), nn.Linear) for n in (*READERS_ATTN, "o_proj")
            )
            and all(
                isinstance(getattr(mlp, n, None), nn.Linear) for n in (*READERS_MLP, "down_proj")
            )
        )
        if not ok:
            raise TorqError(
                "residual-stream rotation needs dense attention and MLP linears in every layer "
                "(fused MoE experts are not supported)"
            )


def _embedding(model: nn.Module) -> nn.Embedding:
    emb = model.get_input_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise TorqError("the input embedding is not an nn.Embedding")
    return emb


@torch.no_grad()
def untie_embeddings(model: nn.Module) -> bool:
    """Give lm_head its own copy of a tied embedding matrix; returns whether it was tied."""
    head = model.get_output_embeddings()
    emb = _embedding(model)
    if head is None:
        raise TorqError("the model has no output embedding (lm_head)")
    tied = head.weight.data_ptr() == emb.weight.data_ptr()
    if tied:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return tied


def _fold_norm(norm: nn.Module, readers: list[nn.Linear]) -> None:
    gamma = norm.weight.detach().to(torch.float64)
    for lin in readers:
        lin.weight.data = (lin.weight.detach().to(torch.float64) * gamma[None, :]).to(
            lin.weight.dtype
        )
    norm.weight.data = torch.ones_like(norm.weight)


@torch.no_grad()
def fold_rmsnorms(model: nn.Module) -> None:
    """``W ← W diag(γ)`` for every layer reading an RMSNorm's output, then ``γ ← 1``
    (lm_head reads the final norm; call :func:`untie_embeddings` first)."""
    check_supported(model)
    for layer in decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        _fold_norm(layer.input_layernorm, [getattr(attn, n) for n in READERS_ATTN])
        _fold_norm(layer.post_attention_layernorm, [getattr(mlp, n) for n in READERS_MLP])
    final = getattr(getattr(model, "model", model), "norm", None)
    if final is None:
        raise TorqError("no final norm found (model.model.norm)")
    _fold_norm(final, [model.get_output_embeddings()])


def _mul(w: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return (w.to(torch.float64) @ right).to(w.dtype)


@torch.no_grad()
def rotate_residual(model: nn.Module, q: torch.Tensor) -> None:
    """Rotate the residual stream by the orthogonal ``q`` (``d × d``), fused into every
    weight that reads or writes it. Norms must be folded and embeddings untied first."""
    check_supported(model)
    q = q.to(device="cpu", dtype=torch.float64)
    d = q.shape[0]
    if q.shape != (d, d) or not torch.allclose(q @ q.T, torch.eye(d, dtype=q.dtype), atol=1e-8):
        raise ValueError("the residual rotation must be a square orthogonal matrix")
    emb = _embedding(model)
    head = model.get_output_embeddings()
    if head.weight.data_ptr() == emb.weight.data_ptr():
        raise TorqError("untie the embeddings before rotating the residual stream")
    q = q.to(emb.weight.device)  # once: every weight below lives where the model does
    qt = q.T
    emb.weight.data = _mul(emb.weight, q)
    head.weight.data = _mul(head.weight, q)
    for layer in decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for lin in [getattr(attn, n) for n in READERS_ATTN] + [
            getattr(mlp, n) for n in READERS_MLP
        ]:
            lin.weight.data = _mul(lin.weight, q)
        for lin in (attn.o_proj, mlp.down_proj):
            lin.weight.data = (qt @ lin.weight.to(torch.float64)).to(lin.weight.dtype)
            if lin.bias is not None:
                lin.bias.data = (qt @ lin.bias.to(torch.float64)).to(lin.bias.dtype)


@torch.no_grad()
def rotate_heads(model: nn.Module, h: torch.Tensor) -> None:
    """Rotate each attention head's value/output space by the orthogonal ``h`` (head dim):
    ``W_v,h ← h W_v,h`` (and its bias), ``W_o,h ← W_o,h hᵀ``."""
    check_supported(model)
    h = h.to(torch.float64)
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if h.shape != (hd, hd):
        raise ValueError(f"the head rotation must be {hd}×{hd}, got {tuple(h.shape)}")
    h = h.to(_embedding(model).weight.device)  # once, where the model lives
    for layer in decoder_layers(model):
        v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
        wv = v.weight.to(torch.float64).reshape(-1, hd, v.in_features)
        v.weight.data = (
            torch.einsum("ij,njk->nik", h, wv).reshape(v.weight.shape).to(v.weight.dtype)
        )
        if v.bias is not None:
            bv = v.bias.to(torch.float64).reshape(-1, hd)
            v.bias.data = (bv @ h.T).reshape(-1).to(v.bias.dtype)
        wo = o.weight.to(torch.float64).reshape(o.out_features, -1, hd)
        o.weight.data = (wo @ h.T).reshape(o.weight.shape).to(o.weight.dtype)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """QuaRot's randomized Hadamard ``Q = diag(s) H / √n`` (``s`` random signs), float64.

    A row vector is rotated as ``x Q = (x ⊙ s) H / √n``: the signs flip channels *before*
    the Hadamard mixes them, as QuaRot's ``random_hadamard_matrix`` does. (With the signs
    after the Hadamard, ``H diag(s)``, they would only flip the signs of the rotated
    channels, which no sign-symmetric quantizer sees: the plain Hadamard.)
    """
    from torq.rotations.hadamard import hadamard_matrix

    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    return signs[:, None] * hadamard_matrix(n)
