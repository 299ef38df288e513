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
from torq.rotations.hadamard import hadamard_matrix

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")
READERS_ATTN = ("q_proj", "k_proj", "v_proj")
READERS_MLP = ("gate_proj", "up_proj")
# every linear reading a norm's output: its input is the residual stream's, normalized
RESIDUAL_READERS = (*READERS_ATTN, *READERS_MLP)


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


def _final_norm(model: nn.Module) -> nn.Module:
    final = getattr(getattr(model, "model", model), "norm", None)
    if final is None:
        raise TorqError("no final norm found (model.model.norm)")
    return final


def fold_layer_norms(layer: nn.Module) -> None:
    """``W ← W diag(γ)`` for the linears reading one decoder layer's two RMSNorms."""
    attn, mlp = layer.self_attn, layer.mlp
    _fold_norm(layer.input_layernorm, [getattr(attn, n) for n in READERS_ATTN])
    _fold_norm(layer.post_attention_layernorm, [getattr(mlp, n) for n in READERS_MLP])


@torch.no_grad()
def fold_rmsnorms(model: nn.Module) -> None:
    """``W ← W diag(γ)`` for every layer reading an RMSNorm's output, then ``γ ← 1``
    (lm_head reads the final norm; call :func:`untie_embeddings` first)."""
    check_supported(model)
    for layer in decoder_layers(model):
        fold_layer_norms(layer)
    _fold_norm(_final_norm(model), [model.get_output_embeddings()])


def _mul(w: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return (w.to(torch.float64) @ right).to(w.dtype)


def _check_orthogonal(q: torch.Tensor) -> torch.Tensor:
    q = q.to(device="cpu", dtype=torch.float64)
    d = q.shape[0]
    if q.shape != (d, d) or not torch.allclose(q @ q.T, torch.eye(d, dtype=q.dtype), atol=1e-8):
        raise ValueError("the residual rotation must be a square orthogonal matrix")
    return q


def rotate_layer_residual(layer: nn.Module, q: torch.Tensor) -> None:
    """One decoder layer's part of :func:`rotate_residual`: readers ``W Q``, writers
    ``Qᵀ W`` (``q`` float64 on the layer's device)."""
    attn, mlp = layer.self_attn, layer.mlp
    for lin in [getattr(attn, n) for n in READERS_ATTN] + [getattr(mlp, n) for n in READERS_MLP]:
        lin.weight.data = _mul(lin.weight, q)
    qt = q.T
    for lin in (attn.o_proj, mlp.down_proj):
        lin.weight.data = (qt @ lin.weight.to(torch.float64)).to(lin.weight.dtype)
        if lin.bias is not None:
            lin.bias.data = (qt @ lin.bias.to(torch.float64)).to(lin.bias.dtype)


@torch.no_grad()
def rotate_residual(model: nn.Module, q: torch.Tensor) -> None:
    """Rotate the residual stream by the orthogonal ``q`` (``d × d``), fused into every
    weight that reads or writes it. Norms must be folded and embeddings untied first."""
    check_supported(model)
    q = _check_orthogonal(q)
    emb = _embedding(model)
    head = model.get_output_embeddings()
    if head.weight.data_ptr() == emb.weight.data_ptr():
        raise TorqError("untie the embeddings before rotating the residual stream")
    q = q.to(emb.weight.device)  # once: every weight below lives where the model does
    emb.weight.data = _mul(emb.weight, q)
    head.weight.data = _mul(head.weight, q)
    for layer in decoder_layers(model):
        rotate_layer_residual(layer, q)


def _head_dim(config: object) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd or config.hidden_size // config.num_attention_heads)  # type: ignore[attr-defined]


def rotate_layer_heads(layer: nn.Module, h: torch.Tensor) -> None:
    """One decoder layer's part of :func:`rotate_heads` (``h`` float64, head dim)."""
    hd = h.shape[0]
    v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
    wv = v.weight.to(torch.float64).reshape(-1, hd, v.in_features)
    v.weight.data = torch.einsum("ij,njk->nik", h, wv).reshape(v.weight.shape).to(v.weight.dtype)
    if v.bias is not None:
        bv = v.bias.to(torch.float64).reshape(-1, hd)
        v.bias.data = (bv @ h.T).reshape(-1).to(v.bias.dtype)
    wo = o.weight.to(torch.float64).reshape(o.out_features, -1, hd)
    o.weight.data = (wo @ h.T).reshape(o.weight.shape).to(o.weight.dtype)


@torch.no_grad()
def rotate_heads(model: nn.Module, h: torch.Tensor) -> None:
    """Rotate each attention head's value/output space by the orthogonal ``h`` (head dim):
    ``W_v,h ← h W_v,h`` (and its bias), ``W_o,h ← W_o,h hᵀ``."""
    check_supported(model)
    h = h.to(torch.float64)
    hd = _head_dim(model.config)
    if h.shape != (hd, hd):
        raise ValueError(f"the head rotation must be {hd}×{hd}, got {tuple(h.shape)}")
    h = h.to(_embedding(model).weight.device)  # once, where the model lives
    for layer in decoder_layers(model):
        rotate_layer_heads(layer, h)


class ResidualRotation:
    """QuaRot's offline rotations (module doc), part by part: the embedding, each decoder
    layer and the head are rotated as each is loaded, so that a model streamed one layer at
    a time (:class:`torq.models.streaming.LayerStream`) gets the weights of the whole model
    rotated at once, bit for bit: every tensor goes through the same operations in the same
    order (norm folded, then ``Q``, then the head rotation), and no tensor reads another
    layer's. :meth:`whole` rotates a model in memory."""

    def __init__(self, q: torch.Tensor, h: torch.Tensor | None = None) -> None:
        self.q = _check_orthogonal(q)
        self.h = None if h is None else h.to(device="cpu", dtype=torch.float64)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _at(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if device not in self._on:  # moved once per device
            self._on[device] = (
                self.q.to(device),
                None if self.h is None else self.h.to(device),
            )
        return self._on[device]

    def check(self, model: nn.Module) -> None:
        """Refuse before any work a model whose fusion would not be exact (its parameters
        may still be on ``meta``)."""
        check_supported(model)
        d = model.config.hidden_size
        if self.q.shape != (d, d):
            raise ValueError(f"the residual rotation is {tuple(self.q.shape)}, the model's {d}")
        if self.h is not None and self.h.shape[0] != _head_dim(model.config):
            raise ValueError("the head rotation does not match the model's head dimension")

    @torch.no_grad()
    def embedding(self, model: nn.Module) -> None:
        """``E ← E Q``."""
        emb = _embedding(model)
        emb.weight.data = _mul(emb.weight, self._at(emb.weight.device)[0])

    @torch.no_grad()
    def layer(self, index: int, layer: nn.Module) -> None:
        """Fold the layer's norms, rotate its readers and writers, then its heads."""
        fold_layer_norms(layer)
        q, h = self._at(layer.self_attn.q_proj.weight.device)
        rotate_layer_residual(layer, q)
        if h is not None:
            rotate_layer_heads(layer, h)

    @torch.no_grad()
    def head(self, model: nn.Module) -> None:
        """Untie lm_head from the embedding (when one tensor), fold the final norm into it,
        then ``W ← W Q``."""
        head = model.get_output_embeddings()
        emb = _embedding(model)
        if head.weight is emb.weight or (
            emb.weight.device.type != "meta" and head.weight.data_ptr() == emb.weight.data_ptr()
        ):
            untie_embeddings(model)
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
        _fold_norm(_final_norm(model), [head])
        head.weight.data = _mul(head.weight, self._at(head.weight.device)[0])

    def whole(self, model: nn.Module) -> None:
        """Every part of a model in memory (embeddings untied first)."""
        self.check(model)
        untie_embeddings(model)
        self.embedding(model)
        for i, layer in enumerate(decoder_layers(model)):
            self.layer(i, layer)
        self.head(model)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """QuaRot's randomized Hadamard ``Q = diag(s) H / √n`` (``s`` random signs), float64.

    A row vector is rotated as ``x Q = (x ⊙ s) H / √n``: the signs flip channels *before*
    the Hadamard mixes them, as QuaRot's ``random_hadamard_matrix`` does. (With the signs
    after the Hadamard, ``H diag(s)``, they would only flip the signs of the rotated
    channels, which no sign-symmetric quantizer sees: the plain Hadamard.)
    """

    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    return signs[:, None] * hadamard_matrix(n)


def block_hadamard_residual(width: int, group: int) -> ResidualRotation:
    """The residual stream rotated by the normalized Hadamard on each block of ``group``
    channels, ``Q = diag(H_g, …, H_g)ᵀ``: a row vector ``x Q`` is ``x ↦ H_g x`` on each
    block, the online block Hadamard's rotation, done offline. With the norms' weights
    folded into their readers (:class:`ResidualRotation`), each reader's input is the
    normalized stream rotated so, and runs no transform."""
    if width % group:
        raise TorqError(f"the residual width {width} is not a multiple of {group}")
    h = hadamard_matrix(group).to(torch.float64)
    return ResidualRotation(torch.block_diag(*[h.T] * (width // group)))
