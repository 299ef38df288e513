"""Knobs: a setting declared once, on its dataclass field, with its command-line flag, its
help and whether ``--help`` shows it (an everyday option) or only ``--help-all`` (a research
one). The command line is built from the fields (:func:`add_knobs`) and the settings from
the parsed arguments (:func:`from_args`), so a new knob is its field and the code that reads
it. A field may also say what the paper's method uses there (:func:`paper_values`).

This module is the bottom of the package: it imports nothing of torq, so every layer's
settings can declare their knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from typing import Any

# the commands a run's knob belongs to unless it says otherwise
RUN_COMMANDS: tuple[str, ...] = ("run", "eval")


@dataclass(frozen=True)
class Knob:
    """How a setting appears on the command line.

    ``flag``'s value goes through ``type`` (argparse's) and then ``value`` (the field's
    value from the parsed one: ``--expert-down shared`` is ``expert_down_shared=True``).
    Two fields may share a flag (``--calib-seed`` seeds the windows and the intra-block
    solver): the first declares it, the others give ``help=None``. ``group`` is the
    ``--help`` group of an everyday option; ``None``: a research knob, under ``--help-all``.
    """

    flag: str
    help: str | None
    group: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    # "store_true", or argparse's BooleanOptionalAction
    action: Any = None
    nargs: str | None = None
    const: Any = None
    value: Callable[[Any], Any] | None = None
    commands: tuple[str, ...] = RUN_COMMANDS
    # other names the flag answers to (a flag's earlier name)
    aliases: tuple[str, ...] = ()
    # the commands whose default help shows it in ``group`` (None: all of ``commands``);
    # under the others it is a research knob
    everyday_in: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser, command: str = "") -> argparse.Action:
        """This knob as an argument of ``parser`` (``command``'s), absent from the parsed
        arguments unless given (so a setting not given keeps its field's default)."""
        kwargs: dict[str, Any] = {"dest": self.dest, "default": argparse.SUPPRESS}
        for name in ("type", "choices", "metavar", "action", "nargs", "const"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        action = parser.add_argument(self.flag, *self.aliases, help=self.help or "", **kwargs)
        everyday = self.everyday_in is None or command in self.everyday_in
        action.everyday_group = self.group if everyday else None  # type: ignore[attr-defined]
        return action


def knob(default: Any = MISSING, *, factory: Any = MISSING, paper: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field with a :class:`Knob` (``kw``); ``paper``: the field's value in the
    paper's method where torq's default differs (a value, or a function of the current
    value), read by :func:`paper_values`."""
    metadata: dict[str, Any] = {"knob": Knob(**kw)} if kw else {}
    if paper is not MISSING:
        metadata["paper"] = paper
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _nested(value: Any) -> bool:
    return is_dataclass(value) and not isinstance(value, type)


def knobs_of(cls: type, command: str | None = None) -> Iterator[Knob]:
    """The knobs of ``cls`` and of the settings nested in it (a field whose default is a
    dataclass value), each flag once; with ``command``, those of that command."""
    seen: set[str] = set()
    for k in _all_knobs(cls):
        wanted = command is None or command in k.commands
        if k.flag not in seen and k.help is not None and wanted:
            seen.add(k.flag)
            yield k


def _all_knobs(cls: type) -> Iterator[Knob]:
    base = cls()
    for f in fields(cls):
        k = f.metadata.get("knob")
        if k is not None:
            yield k
        elif _nested(getattr(base, f.name)):
            yield from _all_knobs(type(getattr(base, f.name)))


def add_knobs(parser: argparse.ArgumentParser, command: str, *classes: type) -> None:
    """The knobs of ``classes`` for ``command`` as arguments of ``parser`` (a flag several
    classes share, once)."""
    have = {s for a in parser._actions for s in a.option_strings}
    for cls in classes:
        for k in knobs_of(cls, command):
            if k.flag not in have:
                k.add_to(parser, command)
                have.add(k.flag)


def from_args(base: Any, args: argparse.Namespace) -> Any:
    """``base`` (a settings value) with every knob given in ``args`` set, nested settings
    included; knobs not given keep ``base``'s values."""
    changes: dict[str, Any] = {}
    for f in fields(base):
        current = getattr(base, f.name)
        k = f.metadata.get("knob")
        if k is not None:
            if hasattr(args, k.dest):
                given = getattr(args, k.dest)
                changes[f.name] = given if k.value is None else k.value(given)
        elif _nested(current):
            nested = from_args(current, args)
            if nested != current:
                changes[f.name] = nested
    return replace(base, **changes) if changes else base


def given(base: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``base`` (not of the settings nested in it) whose knob ``args`` gives,
    with their values."""
    out: dict[str, Any] = {}
    for f in fields(base):
        k = f.metadata.get("knob")
        if k is not None and hasattr(args, k.dest):
            value = getattr(args, k.dest)
            out[f.name] = value if k.value is None else k.value(value)
    return out


def paper_values(settings: Any) -> Any:
    """``settings`` with each field that declares the paper's value (``knob(paper=…)``) set
    to it, nested settings included."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        current = getattr(settings, f.name)
        if "paper" in f.metadata:
            paper = f.metadata["paper"]
            changes[f.name] = paper(current) if callable(paper) else paper
        elif _nested(current):
            changes[f.name] = paper_values(current)
    return replace(settings, **changes)


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, else a one-line error naming ``what``."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{value}'") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n

    return parse


positive_int = int_at_least(1, "a positive integer")
nonnegative_int = int_at_least(0, "an integer >= 0")


def strength_or_none(value: str) -> float | None:
    """An argparse type: a strength in ``[0, 1]``, or ``none``/``off``."""
    if value.strip().lower() in ("none", "off"):
        return None
    try:
        alpha = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1] or 'none', got '{value}'"
        ) from None
    if not 0.0 <= alpha <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'none', got {alpha}")
    return alpha


def strength(value: str) -> float:
    """An argparse type: a strength in ``[0, 1]``."""
    alpha = strength_or_none(value)
    if alpha is None:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got '{value}'")
    return alpha
