"""Recipes: the methods a user picks by what they want (a checkpoint to serve, the lowest
perplexity, no calibration, the paper's TORQ), each with every setting it needs.

A recipe is a method of the registry plus the run settings that method needs for that use:
``default`` folds the channel balancing into the float weights (so that only the 32-block
Hadamard stays online and compressed-tensors can hold the model) and quantizes activations
with the ``nearest`` MXFP4 scale rule (the rule transformers' compressed-tensors loader
applies, so torq's numbers are the served model's). The method names stay available for
research (``torq run --methods``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.errors import TorqError
from torq.methods.registry import MethodSpec, method_spec
from torq.methods.settings import TorqSettings
from torq.surgery.qlinear import QuantConfig


@dataclass(frozen=True)
class Recipe:
    """A method (:func:`torq.methods.get_method`'s name) and the settings it runs with."""

    name: str
    method: str
    use_when: str
    calibrates: bool = True
    # the MXFP4 block scale rule (weights and activations); other formats take their own
    # standard rule unless ``scale_by_format`` names one
    scale_mode: str = "ocp"
    # the rule in a format where the measurements chose one: ``(format, rule)`` pairs
    scale_by_format: tuple[tuple[str, str], ...] = ()
    # torq's channel balancing folded into the norms and the v/up rows
    # (:mod:`torq.rotations.fold`) instead of done online
    fold_balance: bool = False
    # TORQ exactly as the paper states it (:meth:`TorqSettings.paper`)
    paper: bool = False
    # a group the engines run no transform on gets no rotation (TORQ's transforms: their
    # balancing alone; the block Hadamard: nothing), the ``unrotated`` setting of the
    # method's own settings: a linear with a bias (Qwen2's q/k/v; vLLM), MoE experts (both)
    unrotate_served: bool = False
    # the method in a format where the measurements chose another: ``(format, method)``
    # pairs (docs/recipes.md, "Recipes per format")
    by_format: tuple[tuple[str, str], ...] = ()

    def in_format(self, fmt: str) -> Recipe:
        """This recipe as it runs in ``fmt``: its method there (``by_format``), the rest as
        it is."""
        method = dict(self.by_format).get(fmt)
        return self if method is None else replace(self, method=method, by_format=())

    def spec(self, *given: Any, unrotated: tuple[str, ...] = ()) -> MethodSpec:
        """This recipe's method with its settings: the recipe's own (the folded balancing,
        or the paper's TORQ) over ``given`` settings values (GPTQ's, the solver's knobs),
        which the method takes as :func:`~torq.methods.registry.method_spec` does.
        ``unrotated``: the model's groups the engines run no transform on
        (:func:`torq.models.architecture.served_unrotated`), left unrotated where the recipe
        says so."""
        base = next((g for g in given if isinstance(g, TorqSettings)), None) or TorqSettings()
        settings = (
            base.paper() if self.paper else replace(base, fold=self.fold_balance or base.fold)
        )
        others = [g for g in given if not isinstance(g, TorqSettings)]
        spec = method_spec(self.method, settings, *others)
        own = spec.settings
        # the method's settings have an ``unrotated`` field, and the caller set none
        settable = own is not None and hasattr(own, "unrotated") and own.unrotated is None
        if self.unrotate_served and unrotated and settable:
            spec = replace(spec, settings=replace(own, unrotated=tuple(unrotated)))
        return spec

    def capture(self, calibration: CalibrationConfig | None = None) -> CaptureSettings:
        """The calibration of this recipe: ``calibration`` (default:
        :class:`CalibrationConfig`'s, 128 windows of WikiText-2's validation text)."""
        return CaptureSettings(calibration=calibration or CalibrationConfig())

    def formats(self) -> list[str]:
        """The formats this recipe runs with another method or scale rule than MXFP4's."""
        return list(dict.fromkeys(f for f, _ in (*self.by_format, *self.scale_by_format)))

    def described_in(self, fmt: str) -> str:
        """What this recipe runs in ``fmt``: its method there, and its rule where it has one."""
        rule = dict(self.scale_by_format).get(fmt)
        method = self.in_format(fmt).method
        return method if rule is None else f"{method} ({rule})"

    def scale_mode_in(self, fmt: str) -> str:
        """The block scale rule this recipe runs ``fmt`` with (a run's ``scale_mode``)."""
        return dict(self.scale_by_format).get(fmt, self.scale_mode)

    def quant_config(self, fmt: str) -> QuantConfig:
        """Weights and activations in ``fmt`` with this recipe's scale rule there
        (:meth:`scale_mode_in`); NVFP4 activations with a static tensor scale, calibrated
        (what compressed-tensors and vLLM serve)."""
        act_scale = "static" if fmt == "nvfp4" else "dynamic"
        return QuantConfig.from_names(fmt, fmt, self.scale_mode_in(fmt), act_scale)

    def cannot_serve(self, fmt: str = "mxfp4") -> str | None:
        """Why this recipe in ``fmt`` cannot be written as compressed-tensors (transformers,
        vLLM), in one line, as its method answers it; ``None`` when it can."""
        if fmt not in ("mxfp4", "nvfp4"):
            return f"compressed-tensors holds MXFP4 and NVFP4 models, not {fmt}"
        spec = self.in_format(fmt).spec()
        ctx = spec.context(self.capture())
        reason = spec.method.transform.compressed_tensors(self.quant_config(fmt), ctx)
        return None if reason is None else f"recipe '{self.name}': {reason}"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "default",
            # GPTAQ's weights: 6.1 % under GPTQ's on SmolLM2's 16-window set (26.45 against
            # 28.16), the same servable transform (docs/results.md)
            "torq-had32+gptaq",
            use_when="a checkpoint to serve: transformers and vLLM load it",
            scale_mode="nearest",
            # Four Over Six on the NVFP4 weights: standard NVFP4 that engines serve as it is
            # (docs/recipes.md, "Recipes per format")
            scale_by_format=(("nvfp4", "4over6-weights"),),
            fold_balance=True,
            unrotate_served=True,
        ),
        Recipe(
            "best-ppl",
            # TORQ's rotations with GPTAQ's weights and the nearest rule: 26.27 and 26.07 on
            # SmolLM2's 16-window set (two calibration seeds) against the default's 26.45 and
            # 26.56, 28.32 against 28.72 on the full test (docs/results.md)
            "torq+gptaq",
            use_when="the lowest perplexity measured: TORQ's own calibrated rotations, run in "
            "torq (they cannot be exported)",
            scale_mode="nearest",
        ),
        Recipe(
            "fast",
            "had32",
            use_when="no calibration data or time: a fixed 32-block Hadamard (none in NVFP4, "
            "where it hurts), seconds",
            calibrates=False,
            scale_mode="nearest",
            unrotate_served=True,
            # in NVFP4 a fixed Hadamard, of 32 or of its own 16, is worse than none: SmolLM2's
            # 16-window set 40.90 and 40.22 against RTN's 32.93, Qwen's first 8 windows 32.56
            # and 33.58 against 31.71 (docs/recipes.md)
            by_format=(("nvfp4", "rtn"),),
            # RTN's NVFP4 weights with Four Over Six: SmolLM2's 16-window set 31.53 against
            # 32.93 (each activation tensor its own scale); in vLLM 38.23 against torq's 38.43
            scale_by_format=(("nvfp4", "4over6-weights"),),
        ),
        Recipe(
            "paper",
            "torq",
            use_when="the paper's TORQ as published (no balancing, RTN weights), to compare",
            paper=True,
        ),
    )
}
DEFAULT_RECIPE = "default"


def get_recipe(name: str, fmt: str | None = None) -> Recipe:
    """The recipe called ``name`` (as it runs in ``fmt``, when given:
    :meth:`Recipe.in_format`), or a one-line error listing the recipes."""
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise TorqError(
            f"unknown recipe '{name}'; choose from {', '.join(RECIPES)} "
            "(or name a method with torq run --methods)"
        ) from None
    return recipe if fmt is None else recipe.in_format(fmt)
