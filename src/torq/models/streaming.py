"""A float checkpoint read one decoder layer at a time, in bounded memory.

:class:`LayerStream` builds the model's skeleton with every parameter on the ``meta``
device (no memory; buffers such as rotary tables are real), then reads from the
checkpoint's safetensors files only what the current step needs, converted to float32:
the input embedding to embed the windows, one decoder layer at a time, and the final norm
and lm_head (with Gemma's logit soft-capping, whatever the architecture's head does) to
score them. Each part goes back to ``meta`` when its step is done, so the peak is one
layer (or the larger of embedding and lm_head), never the model. The files are read
lazily (``safetensors.safe_open``: one tensor at a time, memory-mapped), in the dtype they
are stored in (bf16, fp16, fp32). On a GPU the next decoder layer is read while the current
one is calibrated (``prefetch``: a background thread reads it into pinned host memory), so
loading a layer there is one copy to the device rather than the file's read and the copy.

A checkpoint of text and images (Gemma 3 from 4B up: its decoder's settings in a
``text_config``) is read as its language model alone: the skeleton is the text model's
causal LM, its tensors are found under the language model's prefix (``language_model.``, or
``model.language_model.`` as newer transformers save it), and the vision tower is never
read (:func:`language_model_names`).

Hidden states move between the steps as tensors, one per batch of windows; the layers see
the same keyword arguments (rotary tables, masks) as in the model's own forward, captured
from it (:func:`embed_windows`). The same code walks a model that is wholly in memory
(:class:`ModelLayers`), so the streamed and the whole-model paths compute alike.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from torq.errors import TorqError
from torq.models.architecture import decoder_layers


class _Stop(Exception):
    pass


def _libc_trim() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc_trim()
F = TypeVar("F", bound=Callable[..., Any])


def return_free_heap() -> None:
    """Return freed heap memory to the system (glibc's ``malloc_trim``), without a garbage
    collection: cheap enough to run after every layer of every forward."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def give_back_memory() -> None:
    """Collect garbage and return freed heap memory to the system (glibc's
    ``malloc_trim``). Without it, each layer read and freed leaves ~40 MB of fragmented
    heap behind on an 8B-shaped model, and the resident set grows with the model's depth
    (measured: docs/research/streaming-and-engineering.md §9). Inside
    :func:`collecting_new_objects_only` the collection walks only the objects made since the
    pass began."""
    gc.collect()
    return_free_heap()


_FROZEN_DEPTH = 0


def collecting_new_objects_only(pass_function: F) -> F:
    """Run ``pass_function`` (a layer-by-layer pass that calls :func:`give_back_memory`
    after its steps) with the objects alive when it starts out of the garbage collector's
    sight: one full collection first, then ``gc.freeze()`` until the pass returns. A full
    collection walks every object of the process, ~400 000 once torch, transformers and
    lm-eval are imported (0.3–0.6 s on this project's machines), while a layer's garbage
    is what the pass itself made; so the collection after each layer walks only that.
    Objects alive before the pass are not collected during it (their garbage waits until
    the pass ends, after one collection cleared what was pending at its start). Nested
    passes freeze once, at the outermost."""

    @functools.wraps(pass_function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        global _FROZEN_DEPTH
        if _FROZEN_DEPTH == 0:
            gc.collect()
            gc.freeze()
        _FROZEN_DEPTH += 1
        try:
            return pass_function(*args, **kwargs)
        finally:
            _FROZEN_DEPTH -= 1
            if _FROZEN_DEPTH == 0:
                gc.unfreeze()

    return wrapped  # type: ignore[return-value]


class ResidentPeak:
    """The process's largest resident set over a stretch of work, sampled every
    ``interval`` seconds by a daemon thread (Linux, ``/proc/self/statm``; elsewhere every
    peak is ``None``). The kernel's own high-water mark covers the whole process; this one
    can be restarted, so each step of a streamed run (a layer's capture, its quantization,
    the head) gets its own peak (docs/research/streaming-and-engineering.md §9: which step
    makes a run's peak)."""

    def __init__(self, interval: float = 0.01) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._ok = Path("/proc/self/statm").is_file()
        self._peak = 0
        # a sample taken before a restart must not land in the stretch after it: the
        # watcher keeps a sample only if no restart came between reading and storing it
        self._stretch = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._ok:
            self._thread = threading.Thread(target=self._watch, args=(interval,), daemon=True)
            self._thread.start()

    def _now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            stretch = self._stretch
            now = self._now()
            with self._lock:
                if stretch == self._stretch:
                    self._peak = max(self._peak, now)

    def restart(self) -> None:
        """Begin a new stretch: its peak starts at the resident set now."""
        if self._ok:
            with self._lock:
                self._stretch += 1
                self._peak = self._now()

    def peak(self) -> int | None:
        """The largest resident set (bytes) since :meth:`restart`, this moment included."""
        if not self._ok:
            return None
        now = self._now()
        with self._lock:
            self._peak = max(self._peak, now)
            return self._peak

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Recorder(nn.Module):
    """Stands in for a decoder layer during the embedding pass: records the layer's keyword
    arguments and passes the hidden states through (the first also keeps them; the last
    stops the forward, so no later module runs)."""

    def __init__(self, index: int, last: bool, sink: dict[str, Any]) -> None:
        super().__init__()
        self.index, self.last, self.sink = index, last, sink

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise TorqError("decoder layers called with positional arguments are not supported")
        if self.index == 0:
            self.sink["hidden"] = hidden_states.detach()
        if self.sink.get("record_kwargs", True):
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}
            kw["use_cache"] = False
            self.sink["kwargs"][self.index] = kw
        if self.last:
            raise _Stop
        return hidden_states


class _Inject(nn.Module):
    """Stands in for decoder layer 0 during the scoring pass: returns the given final hidden
    states, so the model's own final norm and head turn them into logits."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.hidden


class _Identity(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def _swapped_layers(model: nn.Module, stand_ins: list[nn.Module]) -> Iterator[None]:
    layers = decoder_layers(model)
    originals = list(layers)
    try:
        for i, m in enumerate(stand_ins):
            layers[i] = m
        yield
    finally:
        for i, m in enumerate(originals):
            layers[i] = m


class LayerSource:
    """Where the driver gets the model's parts: the model (its outer modules usable after
    :meth:`load_embedding` / :meth:`load_head`) and each decoder layer in float."""

    model: nn.Module
    device: torch.device

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    def load_embedding(self) -> None:
        """Make the input embedding usable."""

    def release_embedding(self) -> None:
        """Free what :meth:`load_embedding` loaded."""

    def load_head(self) -> None:
        """Make the final norm and lm_head usable."""

    def release_head(self) -> None:
        """Free what :meth:`load_head` loaded."""

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` in float, on the device; the driver may change it."""
        raise NotImplementedError

    def release_layer(self, index: int) -> None:
        """Free layer ``index`` (the streamed source forgets what the driver did to it)."""

    @property
    def layer_prefix(self) -> str:
        """The decoder layers' name in the model (``model.layers``)."""
        layers = decoder_layers(self.model)
        return next(n for n, m in self.model.named_modules() if m is layers)

    def head_modules(self) -> list[nn.Module]:
        """Every module outside the decoder layers and the input embedding that holds
        parameters: final norm, lm_head (the rotary and other parameter-free modules need
        nothing)."""
        emb = self.model.get_input_embeddings()
        layers = decoder_layers(self.model)
        skip = {id(m) for m in emb.modules()} | {id(m) for m in layers.modules()}
        return [
            m
            for m in self.model.modules()
            if id(m) not in skip and any(True for _ in m.parameters(recurse=False))
        ]

    def transform_parts(self, parts: Any) -> None:
        """Fuse an offline rotation into every part (QuaRot's
        :class:`~torq.surgery.fusion.ResidualRotation`): a model in memory now, at once; a
        streamed one as each part is loaded."""
        parts.whole(self.model)


class ModelLayers(LayerSource):
    """A model wholly in memory, walked in place: the driver quantizes its own layers, and
    the model is the quantized model afterwards (the whole-model path; nothing is copied)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def load_layer(self, index: int) -> nn.Module:
        return decoder_layers(self.model)[index]


# where a model of text and images keeps its language model's tensors: the checkpoints
# published for Gemma 3, Llava and Mistral 3 (and transformers 5's saves) put the causal LM
# under ``language_model.``; transformers 4.52 to 4.57 saved its base model under
# ``model.language_model.`` and the head as ``lm_head``
_LANGUAGE_MODEL_PREFIXES = (("language_model.", ""), ("model.language_model.", "model."))


def language_model_names(files: dict[str, Path], folder: Path) -> dict[str, str]:
    """For a checkpoint of text and images, its language model's tensors under the names of
    the text model's causal LM (``model.layers.0…``, ``lm_head.weight``): ``{name: the
    checkpoint's name}``; one line where the checkpoint keeps none where they are looked
    for."""
    for prefix, base in _LANGUAGE_MODEL_PREFIXES:
        names = {base + k[len(prefix) :]: k for k in files if k.startswith(prefix)}
        if any(".layers." in n for n in names):
            if base and "lm_head.weight" in files:  # the head beside the language model
                names["lm_head.weight"] = "lm_head.weight"
            return names
    raise TorqError(
        f"{folder}: a model of text and images whose language model's tensors are not under "
        f"{' or '.join(p for p, _ in _LANGUAGE_MODEL_PREFIXES)}"
    )


def converted_names(
    model_type: str | None, files: dict[str, Path]
) -> tuple[dict[str, str], dict[str, list[list[str]]]]:
    """The names the model has for a checkpoint's tensors where transformers converts them
    as it loads (its conversion mapping for ``model_type``): ``{model name: checkpoint
    name}`` for a renamed tensor, and for a fused experts tensor the checkpoint's
    per-expert tensors, ``{model name: [[expert 0's parts, in order], …]}`` (each expert's
    parts concatenated, the experts stacked: ``gate_up_proj`` from ``w1`` and ``w3``).
    Empty for a checkpoint stored under the model's own names."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers before 5: it converted no names
        return {}, {}
    transforms = (get_checkpoint_conversion_mapping(model_type) if model_type else None) or []
    if not transforms:
        return {}, {}
    renamed: dict[str, str] = {}
    parts: dict[str, dict[int, dict[int, str]]] = {}
    for stored in files:
        name, merged_by = stored, None
        for transform in transforms:
            new, pattern = transform.rename_source_key(name)
            if pattern is not None and isinstance(transform, WeightConverter):
                merged_by = transform.source_patterns.index(pattern)
            name = new
        expert = re.search(r"\.experts\.(\d+)\.", stored)
        if merged_by is not None and expert is not None:  # one expert's part of a stack
            by_expert = parts.setdefault(name, {})
            by_expert.setdefault(int(expert.group(1)), {})[merged_by] = stored
        elif name != stored:
            renamed[name] = stored
    merged = {
        name: [[e[k] for k in sorted(e)] for _, e in sorted(by_expert.items())]
        for name, by_expert in parts.items()
    }
    return renamed, merged


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name → safetensors file of a Hugging Face checkpoint folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise TorqError(
            f"{folder} has no model.safetensors(.index.json): streaming reads safetensors "
            "checkpoints only"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)


class LayerStream(LayerSource):
    """A safetensors checkpoint folder read one part at a time (module docstring)."""

    def __init__(
        self, folder: str | Path, device: torch.device | str = "cpu", prefetch: bool | None = None
    ) -> None:
        """``prefetch``: read the next decoder layer in the background while the current one
        is worked on (module docstring); by default on a GPU only, since on a CPU it would
        hold a second layer in memory for no gain in transfer."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(folder)
        self.device = torch.device(device)
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self._reader: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future[dict[str, torch.Tensor]]] = {}
        self.files = checkpoint_files(self.folder)
        # the model's tensor name -> the checkpoint's (the same but for a language model
        # taken out of a model of text and images)
        self.stored: dict[str, str] = {}
        config = AutoConfig.from_pretrained(str(self.folder))
        text = config.get_text_config()
        if text is not config:
            config = text
            self.stored = language_model_names(self.files, self.folder)
            self.files = {name: self.files[stored] for name, stored in self.stored.items()}
        # a checkpoint whose names transformers converts on loading (Mixtral's
        # block_sparse_moe.experts.N.w1…, the per-expert tensors of every fused-experts
        # model): the model's names, and each fused experts tensor's per-expert parts
        renamed, self.merged = converted_names(getattr(config, "model_type", None), self.files)
        for name, stored in renamed.items():
            if name not in self.files:
                self.files[name] = self.files[stored]
                self.stored[name] = self.stored.get(stored, stored)
        # parameters on meta (no memory), buffers real (rotary tables, embedding scales)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if self.stored:  # a text config names no class: what is saved must (vLLM reads it)
            model.config.architectures = [type(model).__name__]
        self.model = model.eval()
        if self.device.type != "cpu":  # the buffers (parameters come when loaded)
            for sub in self.model.modules():
                for k, b in list(sub._buffers.items()):
                    if b is not None:
                        sub._buffers[k] = b.to(self.device)
        layers = decoder_layers(self.model)
        names = {id(m): n for n, m in self.model.named_modules()}
        self._layers_prefix = names[id(layers)]
        self._skeletons = [copy.deepcopy(layer) for layer in layers]
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.stored_dtypes = self._stored_dtypes()
        self.parts: Any = None

    def transform_parts(self, parts: Any) -> None:
        parts.check(self.model)  # before any work (the parameters are still on meta)
        self.parts = parts

    def _stored_dtypes(self) -> dict[str, int]:
        from safetensors import safe_open

        counts: dict[str, int] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    dtype = str(f.get_slice(name).get_dtype())
                    counts[dtype] = counts.get(dtype, 0) + 1
        return counts

    def _read(self, names: list[str], host: bool = False) -> dict[str, torch.Tensor]:
        """The tensors ``names`` in float32 on the device, each converted as it is read (one
        tensor's copy at a time in host memory); ``host``: all of them as stored, in host
        memory (pinned for a GPU), for :meth:`_to_device` later."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        fused: dict[str, list[list[str]]] = {}
        for name in names:
            if name not in self.files:
                parts = self.merged.get(name)
                if parts is None:
                    raise TorqError(f"{self.folder}: the checkpoint has no tensor '{name}'")
                fused[name] = parts
                for part in (p for expert in parts for p in expert):
                    by_file.setdefault(self.files[part], []).append(part)
                continue
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in group:
                    t = f.get_tensor(self.stored.get(name, name))
                    out[name] = t if host else t.to(device=self.device, dtype=torch.float32)
        for name, parts in fused.items():
            out[name] = torch.stack([torch.cat([out.pop(p) for p in e]) for e in parts])
        if host and self.device.type == "cuda":
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    def _to_device(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # blocking copies (from pinned memory at the bus's speed): the time of a layer's
        # load is then the copy's, not moved into the forward pass that would wait for it
        return {k: v.to(device=self.device, dtype=torch.float32) for k, v in host.items()}

    def _layer_names(self, index: int) -> list[str]:
        params = self._skeletons[index].named_parameters(remove_duplicate=False)
        return [f"{self._layers_prefix}.{index}.{n}" for n, _ in params]

    def _prefetch_layer(self, index: int) -> None:
        """Start reading decoder layer ``index`` on the background thread."""
        if not self.prefetch or index >= self.num_layers or index in self._pending:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="torq-prefetch")
        self._pending[index] = self._reader.submit(self._read, self._layer_names(index), True)

    def _materialize(
        self, module: nn.Module, prefix: str, read: Future[dict[str, torch.Tensor]] | None = None
    ) -> None:
        """Read ``module``'s parameters (checkpoint names ``prefix + name``) in float32, or
        take them from ``read``, the background thread's read of them."""
        params = dict(module.named_parameters(remove_duplicate=False))
        if read is not None:
            values = self._to_device(read.result())  # its error, if any, is raised here
        else:
            values = self._read([prefix + n for n in params])
        for name in params:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            sub._parameters[attr] = nn.Parameter(values[prefix + name], requires_grad=False)

    @staticmethod
    def _to_meta(module: nn.Module, recurse: bool = True) -> None:
        """Parameters back to ``meta`` (freed); ``recurse=False``: the module's own only."""
        for sub in module.modules() if recurse else [module]:
            for attr, p in list(sub._parameters.items()):
                if p is not None and p.device.type != "meta":
                    sub._parameters[attr] = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=False
                    )

    def _prefix_of(self, module: nn.Module) -> str:
        name = next(n for n, m in self.model.named_modules() if m is module)
        return f"{name}." if name else ""

    def load_embedding(self) -> None:
        emb = self.model.get_input_embeddings()
        self._materialize(emb, self._prefix_of(emb))
        if self.parts is not None:
            self.parts.embedding(self.model)

    def release_embedding(self) -> None:
        self._to_meta(self.model.get_input_embeddings())

    def load_head(self) -> None:
        for module in self.head_modules():
            prefix = self._prefix_of(module)
            if self.tied and module is self.model.get_output_embeddings():
                # the head is the input embedding: read it under that name
                emb = self.model.get_input_embeddings()
                prefix = self._prefix_of(emb)
            own = dict(module.named_parameters(recurse=False))
            values = self._read([prefix + n for n in own])
            for n in own:
                module._parameters[n] = nn.Parameter(values[prefix + n], requires_grad=False)
        if self.parts is not None:
            self.parts.head(self.model)

    def release_head(self) -> None:
        for module in self.head_modules():
            self._to_meta(module, recurse=False)

    def load_layer(self, index: int) -> nn.Module:
        layers = decoder_layers(self.model)
        layer = copy.deepcopy(self._skeletons[index])
        self._materialize(layer, f"{self._layers_prefix}.{index}.", self._pending.pop(index, None))
        self._prefetch_layer(index + 1)  # read while this layer is worked on
        if self.parts is not None:
            self.parts.layer(index, layer)
        layers[index] = layer
        return layer

    def release_layer(self, index: int) -> None:
        decoder_layers(self.model)[index] = copy.deepcopy(self._skeletons[index])


@torch.no_grad()
def embed_windows(
    source: LayerSource, windows: torch.Tensor, batch_size: int = 1, into: Any = None
) -> tuple[Any, list[dict[str, Any]]]:
    """The hidden states entering decoder layer 0 for each batch of windows, and every
    layer's keyword arguments, from the model's own forward with the layers stood in for
    (all windows have one length and no padding, so the arguments are the same for every
    batch; they are read per layer because layers may differ, as Gemma 3's do). The states
    go into ``into`` (a :class:`~torq.calibration.hidden.HiddenStates`) when given, batch
    by batch, else into a list."""
    source.load_embedding()
    n = source.num_layers
    sink: dict[str, Any] = {"kwargs": [None] * n, "record_kwargs": True}
    hidden: Any = [] if into is None else into
    try:
        with _swapped_layers(source.model, [_Recorder(i, i == n - 1, sink) for i in range(n)]):
            for i in range(0, windows.shape[0], batch_size):
                with contextlib.suppress(_Stop):
                    source.model(
                        input_ids=windows[i : i + batch_size].to(source.device), use_cache=False
                    )
                hidden.append(sink.pop("hidden"))
                sink["record_kwargs"] = False
    finally:
        source.release_embedding()
        give_back_memory()
    return hidden, sink["kwargs"]


@torch.no_grad()
def head_logits(source: LayerSource, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for final hidden states ``hidden``: its own final norm and head
    (soft-capping included), run by injecting ``hidden`` after the decoder layers (the head
    must be loaded, :meth:`LayerSource.load_head`)."""
    n = source.num_layers
    dummy = torch.zeros_like(hidden)
    with _swapped_layers(source.model, [_Inject(hidden)] + [_Identity() for _ in range(n - 1)]):
        return source.model(inputs_embeds=dummy, use_cache=False).logits
