"""The layer-streaming driver: quantize and evaluate a model one decoder layer at a time.

For a method's :class:`~torq.methods.registry.LayerPlan` and a
:class:`~torq.models.streaming.LayerSource`:

1. the calibration windows (when the method calibrates) and the evaluation windows are
   embedded (the input embedding loaded, used, freed);
2. for each decoder layer ``l``: the float layer is loaded; the statistics of its input
   groups are captured on the calibration hidden states (Algorithm 3's capture, with the
   Hessian for GPTQ); the method quantizes it in place; the calibration hidden states move
   on through the float layer's outputs, or the quantized layer's with ``sequential``; the
   evaluation hidden states move on through the quantized layer; the layer is freed;
3. the final norm and lm_head score the evaluation hidden states: WikiText-2 perplexity,
   as GPTQ's and QuaRot's layer-wise evaluation scripts compute it.

With a :class:`LayerProgress` the driver's state after a layer (the hidden states, the
records, the random state) is kept on disk, and a run stopped after layer ``l`` continues
from layer ``l + 1`` with the same numbers bit for bit: a 70B model's calibration takes
hours, and a stop should not cost them.

Peak memory is one decoder layer in float32 (and its quantized copy), the hidden states of
the calibration and evaluation windows (float32, as the layers compute), the statistics of
one layer, and the larger of the embedding and the head: never the whole model. The
arithmetic is that of the model quantized whole in memory (:func:`apply_method`), step for
step (the same layers, keyword arguments, capture and loss), so the two give the same
numbers bit for bit on a CPU; the tests hold the driver to it.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from torq.calibration.capture import (
    LayerSolver,
    calibration_arithmetic,
    capture_layer,
    layer_outputs,
)
from torq.calibration.data import CalibrationConfig, calibration_data, calibration_windows
from torq.calibration.hidden import HIDDEN_MODES, HiddenStates
from torq.driver.budget import PrecisionBudget, budgeted
from torq.driver.progress import LayerProgress
from torq.errors import TorqError
from torq.eval.perplexity import PerplexityResult, perplexity_from_nll, summed_nll, token_nll
from torq.methods.layers import layer_plan
from torq.methods.registry import LayerPlan, Method, MethodContext
from torq.methods.settings import torq_key
from torq.models.fingerprint import fingerprint_of_logits
from torq.models.streaming import (
    LayerSource,
    ModelLayers,
    ResidentPeak,
    collecting_new_objects_only,
    embed_windows,
    give_back_memory,
    head_logits,
)
from torq.surgery.gptq import gptq_key
from torq.surgery.qlinear import QuantConfig, calibrate_activation_scales

if TYPE_CHECKING:
    from torq.export.checkpoint import CheckpointWriter


@dataclass
class StreamedRun:
    """What one method's streamed pass produced."""

    details: dict[str, Any]
    quantize_seconds: float
    perplexity: PerplexityResult | None
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    # the logits fingerprint of the quantized model (with a ``sink``), streamed
    fingerprint: list[float] | None = None


def _stable_record(record: dict[str, Any]) -> dict[str, Any]:
    """A plan's record as a progress file's name holds it: settings added to TORQ or GPTQ
    after a run began are left out at their defaults (as the settings keys leave them out),
    so the run's kept progress is still taken up by a torq that knows them."""

    out = dict(record)
    if isinstance(out.get("settings"), dict):
        out["settings"] = torq_key(out["settings"])
    if isinstance(out.get("gptq"), dict):
        out["gptq"] = gptq_key(out["gptq"])
    return out


def _digest(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _clock(device: torch.device) -> float:
    """The wall clock once ``device``'s queued work is done, so that each step's seconds
    are its own on a GPU (whose kernels run after the call that queued them returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
@collecting_new_objects_only
def run_layerwise(
    source: LayerSource,
    plan: LayerPlan,
    calibration_windows: torch.Tensor | None,
    eval_windows: torch.Tensor | None,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "layers",
    sink: CheckpointWriter | None = None,
    hidden_states: str = "memory",
    progress_file: LayerProgress | None = None,
) -> StreamedRun:
    """Quantize with ``plan`` and evaluate, one layer of ``source`` at a time (module doc):
    the paper's Algorithm 3 per layer (capture, transform, fuse, quantize), then the
    WikiText-2 perplexity of ``eval_windows`` (method-notes §3) from the quantized layers.
    Either set of windows may be absent (no calibration; no evaluation). With ``sink``
    the quantized model is written as it goes (the embedding, each layer when done, the
    head) and its logits fingerprint is computed, streamed, for the sink's manifest.
    ``hidden_states``: how the windows' states are kept between layers (``"memory"``,
    ``"bfloat16"``, ``"disk"``: :mod:`torq.calibration.hidden`). With ``progress_file``
    (:class:`LayerProgress`; with a ``sink``, a resumable one) a run stopped after a layer
    continues after it."""
    if hidden_states not in HIDDEN_MODES:
        raise ValueError(f"hidden states are kept in {', '.join(HIDDEN_MODES)}")
    if progress_file is not None and sink is not None and not sink.resumable:
        raise TorqError("a streamed run that keeps its progress writes a resumable checkpoint")
    if plan.calibration is not None and calibration_windows is None:
        raise ValueError("the method calibrates: calibration windows are needed")
    run = _Pass(source, plan, batch_size, sink, hidden_states)
    try:
        run.embed(calibration_windows, eval_windows)
        embed_peak = run.rss.peak()
        held = run.held()
        if progress_file is not None:
            identity = {
                "method": desc,
                "record": _stable_record(plan.record),
                "calibration": None if plan.calibration is None else plan.calibration.to_dict(),
                "capture": [plan.block_size, plan.reservoir, plan.sequential, plan.hessian]
                + ([plan.arithmetic] if plan.arithmetic != "exact" else [])
                + ([f"float states {plan.reference_windows}"] if plan.reference_windows else []),
                "quantizes": plan.quantize is not None,
                "residual": plan.parts is not None,
                "layers": source.num_layers,
                "device": source.device.type,
                "calibration_windows": _digest(calibration_windows),
                "eval_windows": _digest(eval_windows),
                "batch_size": batch_size,
                "hidden_states": hidden_states,
            }
            if sink is not None:
                identity["saves"] = str(sink.out)
            progress_file.bind(identity)
            run.resume(progress_file.load())
        last = source.num_layers - 1
        with tqdm(
            total=source.num_layers,
            initial=run.start,
            desc=desc,
            unit="layer",
            disable=not progress,
            leave=False,
        ) as bar:
            for li in range(run.start, source.num_layers):
                run.layer(li)
                if progress_file is not None and progress_file.due(li == last):
                    progress_file.save(run.kept(li, last=li == last))
                    give_back_memory()
                bar.update(1)
        run.seconds.quant += run.seconds.forward + run.seconds.solve
        run.drop_calibration()
        result, fingerprint = run.head(eval_windows)
        details = run.details(held, embed_peak)
        if progress_file is not None:
            progress_file.clear()  # done: the row is the record now
        return StreamedRun(details, run.seconds.quant, result, run.per_layer, fingerprint)
    finally:
        run.close()


@dataclass
class _Seconds:
    """A streamed pass's clock: loading and quantizing, evaluating, the capture forwards,
    the solves, saving."""

    quant: float = 0.0
    eval: float = 0.0
    forward: float = 0.0
    solve: float = 0.0
    save: float = 0.0


class _Pass:
    """One method's streamed pass (:func:`run_layerwise`): the hidden states it carries from
    layer to layer (calibration, the float model's beside them for GPTAQ, evaluation, the
    fingerprint's), its records and its clock."""

    def __init__(
        self,
        source: LayerSource,
        plan: LayerPlan,
        batch_size: int,
        sink: CheckpointWriter | None,
        hidden_states: str,
    ) -> None:
        self.source, self.plan, self.batch_size, self.sink = source, plan, batch_size, sink
        self.hidden_states = hidden_states
        self.stores: list[HiddenStates] = []
        self.clock = functools.partial(_clock, source.device)
        # each step's own peak resident set, so a run's record says which step makes its peak
        self.rss = ResidentPeak()
        self.seconds = _Seconds()
        self.calib: Any = None
        self.calib_kwargs: list[dict[str, Any]] = []
        # the float model's calibration states beside the quantized model's, for a weight
        # quantizer that sees both (GPTAQ); the same states until the first layer is quantized
        self.calib_fp: Any = None
        self.hidden: Any = None
        self.eval_kwargs: list[dict[str, Any]] = []
        self.fp_hidden: list[torch.Tensor] | None = None
        self.fp_kwargs: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.per_layer: list[dict[str, Any]] = []
        self.start = 0

    def new_store(self) -> HiddenStates | None:
        if self.hidden_states == "memory":
            return None  # plain lists: the arithmetic and memory of the model quantized whole
        store = HiddenStates(self.hidden_states) if not self.stores else self.stores[0].empty_like()
        self.stores.append(store)
        return store

    def embed(
        self, calibration_windows: torch.Tensor | None, eval_windows: torch.Tensor | None
    ) -> None:
        """The whole-model parts of the method, then the windows embedded (and with a sink,
        the embedding saved and the fingerprint's input embedded)."""
        source, plan, sink, clock = self.source, self.plan, self.sink, self.clock
        if plan.parts is not None:
            t0 = clock()
            source.transform_parts(plan.parts)
            self.seconds.quant += clock() - t0
        if plan.calibration is not None:
            assert calibration_windows is not None
            t0 = clock()
            self.calib, self.calib_kwargs = embed_windows(
                source, calibration_windows, into=self.new_store()
            )
            self.seconds.forward += clock() - t0
        if plan.asymmetric and self.calib is not None:
            self.calib_fp = _copied(self.calib, self.new_store(), plan.reference_windows)
        if eval_windows is not None:
            t0 = clock()
            self.hidden, self.eval_kwargs = embed_windows(
                source, eval_windows, self.batch_size, into=self.new_store()
            )
            self.seconds.eval += clock() - t0
        if sink is not None:
            t0 = clock()
            source.load_embedding()
            try:
                sink.add_outer("embedding", [source.model.get_input_embeddings()])
            finally:
                source.release_embedding()
                give_back_memory()
            # the fingerprint's input goes through the quantized layers beside the windows
            self.fp_hidden, self.fp_kwargs = embed_windows(source, sink.fingerprint_ids)
            self.seconds.save += clock() - t0

    def held(self) -> dict[str, Any]:
        """Where the states are kept (on the model's device in the layers' float32, for exact
        arithmetic, unless asked otherwise), recorded so that memory reads off the record."""
        kind = self.source.device.type
        return {
            "where": {
                "memory": f"{kind} memory, float32",
                "bfloat16": f"{kind} memory, bfloat16 (float32 as layers read them)",
                "disk": "files of a temporary folder, float32, read one batch at a time",
            }[self.hidden_states],
            "calibration_bytes": _bytes(self.calib),
            "evaluation_bytes": _bytes(self.hidden),
        }

    def resume(self, state: dict[str, Any] | None) -> None:
        """The states, records, clock and random state a stopped run kept after its last
        saved layer (the embedding step gave every layer's keyword arguments)."""
        if state is None:
            return
        device = self.source.device
        self.start = int(state["next_layer"])
        self.calib = _restored(self.calib, state["calibration"], self.new_store, device)
        self.calib_fp = _restored(
            self.calib_fp, state.get("calibration_float"), self.new_store, device
        )
        self.hidden = _restored(self.hidden, state["evaluation"], self.new_store, device)
        if self.sink is not None:
            self.fp_hidden = _restored(self.fp_hidden, state["fingerprint"], lambda: None, device)
            self.sink.restore(state["sink"])
        self.records, self.per_layer = state["records"], state["per_layer"]
        quant, ev, fwd, solve, *saving = state["seconds"]
        self.seconds = _Seconds(quant, ev, fwd, solve, saving[0] if saving else 0.0)
        _set_rng_state(state["rng"])
        del state
        give_back_memory()

    def kept(self, li: int, last: bool) -> dict[str, Any]:
        """What a stop after layer ``li`` keeps (after the last layer only the evaluation
        states are left to use)."""
        s = self.seconds
        return {
            "next_layer": li + 1,
            "calibration": None if last else _stored(self.calib),
            "calibration_float": None if last else _stored(self.calib_fp),
            "evaluation": _stored(self.hidden),
            "fingerprint": _stored(self.fp_hidden),
            "sink": None if self.sink is None else self.sink.snapshot(),
            "records": self.records,
            "per_layer": self.per_layer,
            "seconds": [s.quant, s.eval, s.forward, s.solve, s.save],
            "rng": _rng_state(),
        }

    def layer(self, li: int) -> None:
        """Layer ``li``: loaded, its groups captured, quantized, the states moved on through
        it (and with a sink, saved), freed."""
        source, plan, rss, clock = self.source, self.plan, self.rss, self.clock
        rss.restart()
        t0 = clock()
        layer = source.load_layer(li)
        load = clock() - t0
        peaks: dict[str, int | None] = {"load": rss.peak()}
        groups, stats, outputs, fwd = self._capture(li, layer, peaks)
        t0 = clock()
        record = plan.quantize(li, layer, groups, stats) if plan.quantize is not None else {}
        solve = clock() - t0
        peaks["quantize"] = rss.peak()
        rss.restart()
        del stats
        if self.calib is not None:
            fwd += self._move_calibration(li, layer, outputs, record)
        del outputs
        ev = 0.0
        if self.hidden is not None:
            t0 = clock()
            moved = layer_outputs(layer, self.hidden, self.eval_kwargs[li])
            _release(self.hidden, moved)
            self.hidden = moved
            ev = clock() - t0
        if self.sink is not None and self.fp_hidden is not None:
            t0 = clock()
            self.sink.add_layer(f"{source.layer_prefix}.{li}.", li, layer)
            self.fp_hidden = layer_outputs(layer, self.fp_hidden, self.fp_kwargs[li])
            self.seconds.save += clock() - t0
        source.release_layer(li)
        del layer
        give_back_memory()
        # moving the states on (and saving the layer)
        peaks["evaluate"] = rss.peak()
        self.seconds.forward += fwd
        self.seconds.solve += solve
        self.seconds.eval += ev
        self.seconds.quant += load
        self.per_layer.append(
            {
                "load_seconds": load,
                "forward_seconds": fwd,
                "solve_seconds": solve,
                "eval_seconds": ev,
                "peak_rss_bytes": peaks,
            }
        )
        if plan.calibration is not None or plan.quantize is not None:
            self.records.append({"layer": li, "groups": [g.__dict__ for g in groups], **record})

    def _capture(
        self, li: int, layer: nn.Module, peaks: dict[str, int | None]
    ) -> tuple[list[Any], dict[str, Any], list[torch.Tensor], float]:
        """The statistics of the layer's input groups on the calibration states (Algorithm
        3's capture), the float layer's outputs, and the seconds it took."""
        plan = self.plan
        if self.calib is None or not plan.capture_stats:
            return [], {}, [], 0.0
        assert plan.calibration is not None
        t0 = self.clock()
        groups, stats, outputs = capture_layer(
            li,
            layer,
            self.calib,
            self.calib_kwargs[li],
            plan.block_size,
            plan.reservoir,
            plan.calibration.seed,
            plan.hessian,
            keep_outputs=not plan.sequential,
            reference=self.calib_fp,
            arithmetic=plan.arithmetic,
        )
        if self.calib_fp is not None:
            # the float layer's outputs are the float states on; the quantized model's come
            # from the layer once quantized (:meth:`_move_calibration`: sequential)
            _release(self.calib_fp, outputs)
            self.calib_fp, outputs = outputs, []
        fwd = self.clock() - t0
        peaks["capture"] = self.rss.peak()
        self.rss.restart()
        return groups, stats, outputs, fwd

    def _move_calibration(
        self, li: int, layer: nn.Module, outputs: list[torch.Tensor], record: dict[str, Any]
    ) -> float:
        """The calibration states moved on to the next layer: the float layer's outputs, or
        the quantized layer's (``sequential``; static activation scales observed on its
        inputs); the seconds of the forwards it ran."""
        plan, fwd = self.plan, 0.0
        if plan.observe_activations:
            # static activation scales from the quantized layer's own inputs; its outputs
            # are the next layer's states when the run is sequential (or nothing was
            # captured: a fixed transform reads no statistics)
            t0 = self.clock()
            observed, record["activation_scales"] = calibrate_activation_scales(
                layer, functools.partial(layer_outputs, layer, self.calib, self.calib_kwargs[li])
            )
            fwd += self.clock() - t0
            if plan.sequential or not plan.capture_stats:
                outputs = observed
            del observed
        elif plan.sequential:
            t0 = self.clock()
            with calibration_arithmetic(plan.arithmetic):
                outputs = layer_outputs(layer, self.calib, self.calib_kwargs[li])
            fwd += self.clock() - t0
        _release(self.calib, outputs)
        self.calib = outputs
        return fwd

    def drop_calibration(self) -> None:
        """The calibration states are done: not held through the head step."""
        _release(self.calib, None)
        _release(self.calib_fp, None)
        self.calib = self.calib_fp = None
        give_back_memory()

    def head(
        self, eval_windows: torch.Tensor | None
    ) -> tuple[PerplexityResult | None, list[float] | None]:
        """The head step: the perplexity of the evaluation states, and with a sink the head
        saved and the fingerprint of the quantized model's logits."""
        source, sink, clock = self.source, self.sink, self.clock
        result = fingerprint = None
        self.rss.restart()
        if self.hidden is None and self.fp_hidden is None:
            return None, None
        source.load_head()
        try:
            if self.fp_hidden is not None and sink is not None:
                t0 = clock()
                tied = bool(getattr(source.model.config, "tie_word_embeddings", False))
                sink.add_outer("head", source.head_modules(), tied_head=tied)
                logits = head_logits(source, self.fp_hidden[0])
                fingerprint = fingerprint_of_logits(logits[0, -1])
                self.seconds.save += clock() - t0
            if self.hidden is not None:
                assert eval_windows is not None
                t0 = clock()
                nll: list[float] = []
                for bi, h in enumerate(self.hidden):
                    first = bi * self.batch_size
                    batch = eval_windows[first : first + h.shape[0]].to(source.device)
                    nll.extend(_head_nll(source, h, batch, first))
                self.seconds.eval += clock() - t0
                seqlen = int(eval_windows.shape[1])
                result = perplexity_from_nll(nll, seqlen, self.seconds.eval)
        finally:
            source.release_head()
            give_back_memory()
        return result, fingerprint

    def details(self, held: dict[str, Any], embed_peak: int | None) -> dict[str, Any]:
        """The pass's record: the plan's, where the states were held, the peaks of the steps
        outside the layers (embedding, head), the calibration and its seconds, each layer's
        record (or, quantized without data, what was replaced in total)."""
        plan = self.plan
        details: dict[str, Any] = {**plan.record, "hidden_states": held}
        if self.start:
            details["resumed_at_layer"] = self.start
        details["peak_rss_bytes"] = {"embed": embed_peak, "head": self.rss.peak()}
        if self.sink is not None:
            details["save_seconds"] = self.seconds.save
        if plan.calibration is not None:
            details["calibration"] = plan.calibration.to_dict() | {"sequential": plan.sequential}
            if plan.arithmetic != "exact":
                details["calibration"]["arithmetic"] = plan.arithmetic
            details["calibration_seconds"] = {
                "capture_forward": self.seconds.forward,
                "solve": self.seconds.solve,
            }
            details["layers"] = self.records
        elif self.records:
            totals: dict[str, int] = {}
            for rec in self.records:
                for k, n in rec.get("replaced", {}).items():
                    totals[k] = totals.get(k, 0) + n
            details["replaced"] = totals
        return details

    def close(self) -> None:
        self.rss.close()
        for store in self.stores:  # the disk store's folder goes with its first store
            store.close()


def _bytes(states: Any) -> int:
    """Bytes of hidden states in memory (a list of tensors, or a store)."""
    if states is None:
        return 0
    if isinstance(states, HiddenStates):
        return states.nbytes
    return sum(h.numel() * h.element_size() for h in states)


def _stored(states: Any) -> list[torch.Tensor] | None:
    """The batches of hidden states as a stopped run keeps them (on the CPU, as held:
    a bf16 store's batches in bf16)."""
    if states is None:
        return None
    if isinstance(states, HiddenStates):
        return [t.cpu() for t in states.batches()]
    return [t.cpu() for t in states]


def _restored(
    current: Any, saved: list[torch.Tensor] | None, new_store: Any, device: torch.device
) -> Any:
    """``saved`` batches in place of ``current`` (freed), held the way the run holds them."""
    _release(current, None)
    if saved is None:
        return None
    store = new_store()
    out: Any = [] if store is None else store
    while saved:
        out.append(saved.pop(0).to(device))  # one batch at a time: no second copy of all
    return out


def _copied(states: Any, store: HiddenStates | None, windows: int = 0) -> Any:
    """A copy of the batches of ``states`` that hold their first ``windows`` windows (0:
    every batch), held the same way (``store``: files)."""
    out: Any = [] if store is None else store
    taken = 0
    for h in states:
        if windows and taken >= windows:
            break
        out.append(h.clone())
        taken += h.shape[0]
    return out


def _release(old: Any, new: Any) -> None:
    """Free a layer's input states (a store's files) once its outputs replace them."""
    if isinstance(old, HiddenStates) and old is not new:
        old.release()


@dataclass
class CaptureTimes:
    """Seconds of a layer-by-layer calibration: the capture forwards, the rotation solves
    (Algorithms 1 and 2), and both per layer."""

    forward_seconds: float = 0.0
    solve_seconds: float = 0.0
    per_layer: list[dict[str, float]] = field(default_factory=list)


def calibrate_layerwise(
    model: nn.Module,
    windows: torch.Tensor,
    solve_layer: LayerSolver,
    block_size: int = 32,
    reservoir: int = 2048,
    sequential: bool = False,
    seed: int = 0,
    progress: bool = True,
    hessian: bool = False,
) -> tuple[list[dict[str, Any]], CaptureTimes]:
    """:func:`run_layerwise` on a model in memory with given calibration ``windows`` and a
    ``solve_layer(index, layer, groups, stats)`` callback (for experiments: the methods
    run through their :class:`~torq.methods.registry.LayerPlan`). The model is quantized
    in place; returns each layer's record and the capture and solve times."""
    calibration = CalibrationConfig(
        n_samples=int(windows.shape[0]), seqlen=int(windows.shape[1]), seed=seed
    )
    plan = LayerPlan(solve_layer, calibration, block_size, reservoir, sequential, hessian)
    run = run_layerwise(ModelLayers(model), plan, windows, None, progress=progress)
    seconds = run.details["calibration_seconds"]
    times = CaptureTimes(
        seconds["capture_forward"],
        seconds["solve"],
        [
            {"forward_seconds": p["forward_seconds"], "solve_seconds": p["solve_seconds"]}
            for p in run.per_layer
        ],
    )
    return run.details["layers"], times


# positions of a window whose logits the head computes at once (their log-softmax too): a
# window's full logits are 400 MB at 2048 tokens of a 49k vocabulary, 1.2 GB at 151k
HEAD_CHUNK = 512


def _head_nll(
    source: LayerSource, hidden: torch.Tensor, batch: torch.Tensor, first: int
) -> list[float]:
    """:func:`~torq.eval.perplexity.window_nll` of the head's logits for final hidden states
    ``hidden``, computed :data:`HEAD_CHUNK` positions at a time: the final norm, the head and
    the loss act on each position alone, so the losses are those of the whole window's
    logits, bit for bit (the tests hold the driver to the whole model's perplexity)."""
    last = hidden.shape[1] - 1  # the last position predicts nothing in the window
    parts = [
        token_nll(
            head_logits(source, hidden[:, a : min(a + HEAD_CHUNK, last)]),
            batch[:, a + 1 : min(a + HEAD_CHUNK, last) + 1],
        )
        for a in range(0, last, HEAD_CHUNK)
    ]
    return summed_nll(torch.cat(parts, dim=1), first)


def apply_method(
    method: Method,
    model: nn.Module,
    qconfig: QuantConfig,
    ctx: MethodContext,
    budget: PrecisionBudget | None = None,
) -> dict[str, Any]:
    """Quantize ``model`` in place with ``method`` (its whole-model step, then
    :func:`run_layerwise` over its layers in memory); returns the record of what was done.
    ``budget``: the groups it keeps in MXFP8 chosen first (:mod:`torq.driver.budget`)."""
    record: dict[str, Any] = {}
    if ctx.model_config is None:
        ctx = replace(ctx, model_config=model.config)
    probe = None
    if budget is not None and method.quantizes:
        t0 = time.perf_counter()
        data_dir = ctx.options.get("data_dir")
        probe = calibration_windows(ctx.tokenizer, ctx.capture.calibration, data_dir)
        progress = ctx.options.get("progress", True)
        qconfig, record["precision_budget"] = budgeted(
            ModelLayers(model), probe, qconfig, budget, progress
        )
        record["precision_budget"]["seconds"] = time.perf_counter() - t0
    plan = layer_plan(method, qconfig, ctx)
    if plan.quantize is None:
        return record
    t0 = time.perf_counter()
    windows = None
    if plan.calibration is not None and probe is not None:
        windows = probe if plan.calibration is ctx.capture.calibration else None
    if plan.calibration is not None and windows is None:
        windows = calibration_windows(ctx.tokenizer, plan.calibration, ctx.options.get("data_dir"))
    t_data = time.perf_counter() - t0
    run = run_layerwise(
        ModelLayers(model), plan, windows, None, progress=ctx.options.get("progress", True),
        desc=method.name,
    )  # fmt: skip
    record.update(run.details)
    if plan.calibration is not None:
        record["calibration_data"] = calibration_data(plan.calibration, ctx.options.get("data_dir"))
    if "calibration_seconds" in record:
        record["calibration_seconds"] = {"data": t_data, **record["calibration_seconds"]}
    return record
