"""A small, portable copy of one method's kept evaluation, to carry it to another machine.

A resume directory (:mod:`torq.eval.resume`, ``--resume-dir``) holds a method's zero-shot
answers in lm-eval's SQLite request cache, its perplexity windows, its sessions and often the
quantized model: hundreds of MB, tied to the machine it was made on. A full zero-shot row
costs 2.5–3 core-hours on a 2-core machine (``docs/RESULTS.md`` §5.0), longer than some
machines are lent for; the evaluation then has to move to another machine part-done.

:func:`export_portable` writes the part worth carrying into one ``.npz``: per answer a
64-bit prefix of lm-eval's request hash, the log-likelihood and the greedy flag (17 bytes,
about 12 compressed), plus the logits fingerprint, the sessions and the perplexity windows
as JSON; a generation task's answers (HumanEval's completions, GSM8K's worked answers) are
text, kept in the JSON by the same key prefix.
:func:`seed_resume_dir` reads it into a new resume directory on the other machine, after
checking that the model there gives the same fingerprint; the answers it carries are then
handed to lm-eval without running the model (:class:`SeededAnswers`, and
:class:`SeededGenerations` for the generated ones), and the sessions' wall time keeps
counting from where it was.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torq.errors import TorqError
from torq.eval.resume import (
    check_fingerprint,
    fingerprint_ids,
    logits_fingerprint,
    recorded_setting,
    write_json_atomic,
)
from torq.eval.zeroshot import sessions_seconds
from torq.results import cpu_model

PORTABLE_VERSION = 1
ANSWERS_DB = "requests_rank0.db"  # lm-eval's CachingLM file for the stem "requests"

Answer = tuple[float, bool]


def answer_key(args: Iterable[Any], attr: str = "loglikelihood") -> int:
    """The first 64 bits of lm-eval's cache key for a request (``hash_args``: SHA-256 of the
    JSON of ``[attr, *args]``). 64 bits keep the chance of any collision among a table's
    ~66 000 answers below 10⁻¹⁰."""
    from lm_eval.api.model import hash_args

    return int(hash_args(attr, args)[:16], 16)


def _db_answers(db: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """The log-likelihood answers of lm-eval's request cache ``db`` as arrays (key prefix,
    log-likelihood, greedy flag), and its generated answers (key prefix → text)."""
    keys: list[int] = []
    lls: list[float] = []
    greedy: list[bool] = []
    texts: dict[int, str] = {}
    if db.is_file():
        # read-only, beside lm-eval's writer; a locked database raises (the caller then
        # keeps its previous copy) rather than pass for an empty one
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
            rows = (
                con.execute("SELECT key, value FROM unnamed").fetchall()
                if "unnamed" in tables
                else []
            )
        finally:
            con.close()
        for key, value in rows:
            answer = pickle.loads(value)
            if isinstance(answer, str):  # a generate_until answer
                texts[int(key[:16], 16)] = answer
                continue
            if not (isinstance(answer, tuple) and len(answer) == 2):
                continue  # not a log-likelihood answer
            keys.append(int(key[:16], 16))
            lls.append(float(answer[0]))
            greedy.append(bool(answer[1]))
    return (
        np.asarray(keys, dtype=np.uint64),
        np.asarray(lls, dtype=np.float64),
        np.asarray(greedy, dtype=np.bool_),
        texts,
    )


def export_portable(resume: Path, path: Path) -> dict[str, int]:
    """Write ``resume``'s answers (scored and generated), perplexity windows and sessions to
    ``path`` (``.npz``, replaced atomically, so a stop mid-write leaves the previous copy).
    Answers the file already holds but the directory does not (seeded ones not yet asked
    for) are kept."""
    resume, path = Path(resume), Path(path)
    meta_path = resume / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    keys, lls, greedy, texts = _db_answers(resume / ANSWERS_DB)
    ppl = {p.name: json.loads(p.read_text()) for p in sorted(resume.glob("ppl-*.json"))}
    # the zero-shot fingerprint (fingerprint_ids); a perplexity checkpoint keeps its own
    fingerprint = meta.get("fingerprint")
    setting = recorded_setting(resume)
    if path.is_file():
        old = load_portable(path)
        if fingerprint is None:
            fingerprint = old["meta"].get("fingerprint")
        if setting is None:
            setting = old["meta"].get("setting")
        known = set(keys.tolist())
        extra = [(k, v) for k, v in old["answers"].items() if k not in known]
        if extra:
            keys = np.concatenate([keys, np.asarray([k for k, _ in extra], dtype=np.uint64)])
            lls = np.concatenate([lls, np.asarray([v[0] for _, v in extra], dtype=np.float64)])
            greedy = np.concatenate([greedy, np.asarray([v[1] for _, v in extra], dtype=bool)])
        texts = {**old["generations"], **texts}
        ppl = _longer_ppl(ppl, old["meta"].get("ppl", {}))
    info = {
        "version": PORTABLE_VERSION,
        "fingerprint": fingerprint,
        # what the file's hash names (method, format, calibration): the file says it itself
        "setting": setting,
        "sessions": meta.get("sessions", []),
        "ppl": ppl,
        # JSON keys are strings: the 64-bit prefix in hex, as in lm-eval's own key
        "generations": {f"{k:016x}": t for k, t in sorted(texts.items())},
    }
    _write_portable(path, keys, lls, greedy, info)
    return {
        "answers": int(keys.size),
        "ppl_windows": sum(len(c["nll"]) for c in ppl.values()),
        "generations": len(texts),
    }


def _write_portable(
    path: Path, keys: np.ndarray, lls: np.ndarray, greedy: np.ndarray, info: dict[str, Any]
) -> None:
    """Write a portable copy under a temporary name and rename it: a stop mid-write leaves
    the previous copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp, keys=keys, loglik=lls, greedy=greedy, meta=np.asarray(json.dumps(info))
    )
    os.replace(tmp, path)


def merge_portable(src: Path, dst: Path) -> dict[str, int]:
    """Add to the portable copy ``dst`` the answers, perplexity windows and sessions of
    ``src``, another copy of the same row (two processes that made one row side by side,
    ``--order shortest-first``). Refused, with ``dst`` left as it was, unless the two name
    the same setting, come from the same model (logits fingerprint within
    :data:`~torq.eval.resume.FINGERPRINT_TOL`) and, for a quantized row, the same kind of
    CPU (:func:`check_sessions_cpu`), and unless every answer both hold is the same: with
    one problem at a time an answer does not depend on the process that made it, so a
    difference means another model. Returns how many answers ``src`` added, how many
    both held, and how many ``dst`` holds now."""
    src, dst = Path(src), Path(dst)
    a, b = load_portable(dst), load_portable(src)
    meta_a, meta_b = a["meta"], b["meta"]
    method = _check_same_row(meta_b, meta_a.get("fingerprint"), meta_a.get("setting"), src)
    cpus = sessions_cpus(meta_a.get("sessions", []))
    if cpus:
        check_sessions_cpu(meta_b.get("sessions", []), src, _quantizes(method), cpus[0])
    differ = [k for k, t in b["generations"].items() if a["generations"].get(k, t) != t]
    differ += [k for k, v in b["answers"].items() if a["answers"].get(k, v) != v]
    if differ:
        raise TorqError(
            f"{len(differ)} answers of {src} differ from those {dst} holds for the same "
            "requests: another model made them; nothing merged"
        )
    shared = sum(k in a["generations"] for k in b["generations"])
    shared += sum(k in a["answers"] for k in b["answers"])
    answers = {**b["answers"], **a["answers"]}
    generations = {**b["generations"], **a["generations"]}
    ppl = _longer_ppl(meta_a.get("ppl", {}), meta_b.get("ppl", {}))
    seen = {session_key(s) for s in meta_a.get("sessions", [])}
    sessions = meta_a.get("sessions", []) + [
        s for s in meta_b.get("sessions", []) if session_key(s) not in seen
    ]
    info = {
        **meta_a,
        "version": PORTABLE_VERSION,
        "fingerprint": meta_a.get("fingerprint") or meta_b.get("fingerprint"),
        "setting": meta_a.get("setting") or meta_b.get("setting"),
        "sessions": sessions,
        "ppl": ppl,
        "generations": {f"{k:016x}": t for k, t in sorted(generations.items())},
    }
    keys = sorted(answers)
    _write_portable(
        dst,
        np.asarray(keys, dtype=np.uint64),
        np.asarray([answers[k][0] for k in keys], dtype=np.float64),
        np.asarray([answers[k][1] for k in keys], dtype=bool),
        info,
    )
    added = len(answers) + len(generations) - len(a["answers"]) - len(a["generations"])
    return {"added": added, "shared": shared, "answers": len(answers) + len(generations)}


class PartnerCopy:
    """The portable copy ``path`` that another process making the same row rewrites as it
    goes (its ``--portable-dir`` copy; ``--order shortest-first``): read again whenever the
    file changes, each time checked to be this model's (``fingerprint``), this row's
    (``setting``, where both name one) and, for a quantized row, this CPU's
    (:func:`check_sessions_cpu`). An absent file holds nothing yet."""

    def __init__(self, path: Path, fingerprint: list[float], setting: str | None = None) -> None:
        self.path, self.fingerprint, self.setting = Path(path), fingerprint, setting
        self._stamp: tuple[int, int] | None = None
        self._generations: dict[int, str] = {}

    def get(self, key: int) -> str | None:
        """The partner's answer to the request ``key`` (:func:`answer_key`), if it has one."""
        self.refresh()
        return self._generations.get(key)

    def refresh(self) -> None:
        """Read the file again if it changed since it was last read."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        data = load_portable(self.path)
        meta = data["meta"]
        method = _check_same_row(meta, self.fingerprint, self.setting, self.path)
        check_sessions_cpu(meta.get("sessions", []), self.path, _quantizes(method))
        self._generations, self._stamp = data["generations"], stamp


def _check_same_row(
    meta: dict[str, Any], fingerprint: list[float] | None, setting: str | None, where: Path
) -> str | None:
    """Refuse the copy ``where`` (its ``meta``) unless it is of the model whose logits
    fingerprint is ``fingerprint`` and of the row ``setting`` names (each checked where
    both sides have one); return the row's method, where either names it."""
    if fingerprint is not None and meta.get("fingerprint") is not None:
        check_fingerprint(meta["fingerprint"], fingerprint, where)
    theirs = meta.get("setting")
    if setting and theirs and setting != theirs:
        raise TorqError(f"{where} holds another row (their settings differ)")
    return describe_setting(setting or theirs).get("method")


def _longer_ppl(ppl: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``ppl`` (perplexity checkpoints by name) with each of ``other``'s that holds more
    windows taken instead."""
    merged = dict(ppl)
    for name, content in other.items():
        if len(content.get("nll", [])) > len(merged.get(name, {}).get("nll", [])):
            merged[name] = content
    return merged


def _quantizes(method: str | None) -> bool:
    """Whether ``method`` quantizes (an unnamed or unknown one is taken to)."""
    from torq.methods import get_method

    if method is None:
        return True
    try:
        return get_method(method).quantizes
    except TorqError:
        return True


def load_portable(path: Path) -> dict[str, Any]:
    """``{"answers": {key prefix: (log-likelihood, greedy)}, "generations": {key prefix:
    text}, "meta": {...}}`` from a file written by :func:`export_portable`."""
    path = Path(path)
    if not path.is_file():
        raise TorqError(f"no portable evaluation file at {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            keys, lls, greedy = z["keys"], z["loglik"], z["greedy"]
            meta = json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError) as e:
        raise TorqError(f"{path} is not a portable evaluation file ({e})") from e
    if meta.get("version") != PORTABLE_VERSION:
        raise TorqError(f"{path} has version {meta.get('version')}, expected {PORTABLE_VERSION}")
    answers = {
        int(k): (float(v), bool(g))
        for k, v, g in zip(keys.tolist(), lls.tolist(), greedy.tolist(), strict=True)
    }
    generations = {int(k, 16): t for k, t in meta.pop("generations", {}).items()}
    return {"answers": answers, "generations": generations, "meta": meta}


def describe_setting(setting: str | None) -> dict[str, Any]:
    """The method, task, format, model and calibration (corpus, seed) that a copy's
    settings key names. Two key shapes exist: a zero-shot row's ``[method, {...,
    "act_format": F}]`` and a generation row's ``{"method": M, "task": T, "format": F, ...}``;
    an older copy without a key names nothing (``{}``)."""
    if not setting:
        return {}
    try:
        key = json.loads(setting)
    except ValueError as e:
        raise TorqError(f"unrecognised settings key {setting[:60]!r} ({e})") from e
    if isinstance(key, list) and len(key) == 2 and isinstance(key[1], dict):
        method, rest = key
        task = "zero-shot"
        fmt = rest.get("act_format")
    elif isinstance(key, dict):
        method, rest = key.get("method"), key
        task = key.get("task")
        fmt = key.get("format")
    else:
        raise TorqError(f"unrecognised settings key {setting[:60]!r}")
    # the calibrated methods' settings sit under "torq" (zero-shot) or "recipe" (generation)
    recipe = rest.get("torq") or (rest.get("recipe") or {}).get("torq") or {}
    calibration = recipe.get("calibration") or {}
    return {
        "method": method,
        "task": task,
        "format": fmt,
        "model": rest.get("model"),
        "calib_corpus": calibration.get("corpus"),
        "calib_seed": calibration.get("seed"),
    }


def carry_summary(path: Path) -> dict[str, Any]:
    """What the portable copy ``path`` holds, without its answers: the setting it names
    (:func:`describe_setting`), how many answers (scored and generated) and perplexity
    windows, and its sessions' count and wall time (summed as
    :func:`torq.eval.zeroshot.sessions_seconds` sums them)."""
    data = load_portable(path)
    meta = data["meta"]
    sessions = meta.get("sessions", [])
    return {
        "file": Path(path).name,
        **describe_setting(meta.get("setting")),
        "answers": len(data["answers"]),
        "generations": len(data["generations"]),
        "ppl_windows": sum(len(c.get("nll", [])) for c in meta.get("ppl", {}).values()),
        "sessions": len(sessions),
        "seconds": sessions_seconds(sessions),
        "cpus": sessions_cpus(sessions),
    }


def session_key(session: dict[str, Any]) -> Any:
    """What tells one session of a row from another in two copies of it: its ``id``, or,
    for a session recorded before ids, its start and the answers it found. A session's
    ``seconds`` grow as it runs, so two copies may hold it at different points."""
    return session.get("id") or (session.get("started"), session.get("entries_before"))


def sessions_cpus(sessions: list[dict[str, Any]]) -> list[str]:
    """The CPUs (:func:`torq.results.cpu_model`) ``sessions`` ran on, in the order they
    first appear; sessions from before the CPU was recorded name none."""
    cpus: list[str] = []
    for session in sessions:
        cpu = session.get("cpu")
        if cpu and cpu not in cpus:
            cpus.append(cpu)
    return cpus


def carried_cpus(path: Path) -> list[str]:
    """The CPUs the sessions of the portable copy ``path`` ran on (:func:`sessions_cpus`)."""
    return sessions_cpus(load_portable(path)["meta"].get("sessions", []))


def check_sessions_cpu(
    sessions: list[dict[str, Any]], where: Path, quantized: bool, cpu: str | None = None
) -> None:
    """Refuse to go on on a CPU (``cpu``, default this machine's) other than the one a
    quantized row's ``sessions`` (kept in ``where``) made its answers on.

    Why: the same W4A4 model answers otherwise on another kind of CPU. Its matrix products
    round differently there (another MKL code path), and the dynamic activation quantization
    turns a difference of one rounding into another 4-bit code, so greedy generations part
    within a few tokens: 0 of 8 GSM8K answers of ``had32`` (uncalibrated) and 0 of 4
    HumanEval answers of ``torq-had32`` were the same on an AMD EPYC as on an Intel Xeon,
    and the calibration itself gives another model (``torq-had32``'s logits fingerprint
    moves by 1.32). The float model's 8 GSM8K answers were the same on both, so FP rows
    (``quantized`` false) go on anywhere (docs/RESULTS.md §12.5). Sessions that name no
    CPU pass."""
    if not quantized:
        return
    here = cpu or cpu_model()
    other = [c for c in sessions_cpus(sessions) if c != here]
    if other:
        raise TorqError(
            f"{where} holds W4A4 answers made on {other[0]}; this {here} would answer "
            f"otherwise (docs/RESULTS.md §12.5): go on with the row on a {other[0]} machine, "
            "or remove the file to start it again here"
        )


def check_resume_cpu(root: Path, quantized: bool, cpu: str | None = None) -> None:
    """:func:`check_sessions_cpu` for the sessions a request cache ``root`` logged in its
    ``meta.json`` (:func:`torq.eval.zeroshot.open_request_cache`); none there passes."""
    meta = Path(root) / "meta.json"
    if quantized and meta.is_file():
        sessions = json.loads(meta.read_text()).get("sessions", [])
        check_sessions_cpu(sessions, Path(root), quantized, cpu)


def check_carried_cpu(path: Path, quantized: bool, cpu: str | None = None) -> None:
    """:func:`check_sessions_cpu` for the portable copy ``path``, before any model is loaded
    (rather than after its calibration); an absent copy passes."""
    path = Path(path)
    if quantized and path.is_file():
        sessions = load_portable(path)["meta"].get("sessions", [])
        check_sessions_cpu(sessions, path, quantized, cpu)


def seed_resume_dir(
    path: Path, resume: Path, model: torch.nn.Module, tokenizer: Any
) -> dict[int, Answer]:
    """Check that ``model`` is the model ``path`` was made with (its logits fingerprint),
    then fill ``resume`` with what it carries: the sessions (merged into ``meta.json``) and
    the perplexity windows (where the directory has fewer). Returns the answers, for
    :class:`SeededAnswers`. An absent ``path`` seeds nothing, but ``resume`` is still
    claimed for ``model`` (``meta.json`` with its fingerprint), which later copies carry."""
    return _seed(path, resume, model, tokenizer)["answers"]


def seed_generation_dir(
    path: Path, resume: Path, model: torch.nn.Module, tokenizer: Any
) -> dict[int, str]:
    """:func:`seed_resume_dir` for a generation task: the same checks and the same filling
    of ``resume``; returns the generated answers ``path`` carries (key prefix → text), for
    :class:`SeededGenerations`."""
    return _seed(path, resume, model, tokenizer)["generations"]


def _seed(path: Path, resume: Path, model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    path, resume = Path(path), Path(resume)
    fingerprint = logits_fingerprint(model, fingerprint_ids(tokenizer))
    data = load_portable(path) if path.is_file() else {"answers": {}, "generations": {}, "meta": {}}
    meta_in = data["meta"]
    if meta_in.get("fingerprint") is not None:
        check_fingerprint(meta_in["fingerprint"], fingerprint, path)
    resume.mkdir(parents=True, exist_ok=True)
    meta_path = resume / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        check_fingerprint(meta["fingerprint"], fingerprint, meta_path)
    else:  # claimed for this model now, so that every later copy carries its fingerprint
        meta = {"fingerprint": fingerprint, "sessions": []}
    seen = {session_key(s) for s in meta["sessions"]}
    earlier = [s for s in meta_in.get("sessions", []) if session_key(s) not in seen]
    meta["sessions"] = earlier + meta["sessions"]
    write_json_atomic(meta_path, meta)
    for name, content in meta_in.get("ppl", {}).items():
        target = resume / name
        have = json.loads(target.read_text()).get("nll", []) if target.is_file() else []
        if len(content.get("nll", [])) > len(have):
            write_json_atomic(target, content)
    return data


class SeededAnswers:
    """Mixin for lm-eval's ``HFLM`` (and :class:`~torq.eval.shared_context.SharedContextHFLM`):
    log-likelihood requests whose answer is in ``seeds`` (from :func:`seed_resume_dir`) are
    answered from it, and passed to the request cache at once; the rest are scored."""

    seeds: dict[int, Answer] | None = None
    seeded_answers: int = 0

    def _loglikelihood_tokens(  # type: ignore[no-untyped-def]
        self, requests, disable_tqdm: bool = False, override_bs: int | None = None
    ):
        if not self.seeds:
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)  # type: ignore[misc]
        results: list[Answer | None] = [None] * len(requests)
        todo: list[int] = []
        for i, request in enumerate(requests):
            args = request[0]
            hit = None if args is None else self.seeds.get(answer_key(args))
            if hit is None:
                todo.append(i)
                continue
            results[i] = hit
            self.cache_hook.add_partial("loglikelihood", args, hit)  # type: ignore[attr-defined]
            self.seeded_answers += 1
        if todo:
            scored = super()._loglikelihood_tokens(  # type: ignore[misc]
                [requests[i] for i in todo], disable_tqdm, override_bs
            )
            for i, answer in zip(todo, scored, strict=True):
                results[i] = answer
        return results


class SeededGenerations:
    """Mixin for lm-eval's ``HFLM`` (and :class:`~torq.eval.stopping.StopEachSequenceHFLM`):
    ``generate_until`` requests whose answer is in ``generation_seeds`` (from
    :func:`seed_generation_dir`) are answered from it, and passed to the request cache at
    once; the rest are generated, together, as the class generates them."""

    generation_seeds: dict[int, str] | None = None
    seeded_generations: int = 0

    def generate_until(  # type: ignore[no-untyped-def]
        self, requests, disable_tqdm: bool = False
    ) -> list[str]:
        if not self.generation_seeds:
            return super().generate_until(requests, disable_tqdm)  # type: ignore[misc]
        results: list[str | None] = [None] * len(requests)
        todo: list[int] = []
        for i, request in enumerate(requests):
            hit = self.generation_seeds.get(answer_key(request.args, "generate_until"))
            if hit is None:
                todo.append(i)
                continue
            results[i] = hit
            self.cache_hook.add_partial("generate_until", request.args, hit)  # type: ignore[attr-defined]
            self.seeded_generations += 1
        if todo:
            made = super().generate_until([requests[i] for i in todo], disable_tqdm)  # type: ignore[misc]
            for i, text in zip(todo, made, strict=True):
                results[i] = text
        return [r for r in results if r is not None]


# What a replayed request without a kept answer gets: no model wrote it, so no text can be
# mistaken for it (NUL bytes never come out of a tokenizer's decode of a generation here)
UNANSWERED = "\x00torq: no kept answer\x00"


class _Unanswered:
    """Mixin: every ``generate_until`` request that reaches it gets :data:`UNANSWERED`."""

    def generate_until(  # type: ignore[no-untyped-def]
        self, requests, disable_tqdm: bool = False
    ) -> list[str]:
        return [UNANSWERED] * len(requests)


def replaying_class(base: type, generations: dict[int, str]) -> type:
    """An lm-eval class (built on ``base``, whose tokenizer and chat template it keeps) that
    answers ``generate_until`` only from ``generations`` (key prefix → text, as
    :func:`load_portable` gives them) and every other request with :data:`UNANSWERED`,
    running no model: a row's kept answers scored again, or a part-done row scored on the
    problems it has (RESULTS §12.5). It counts the answers handed out in
    ``seeded_generations``."""
    return type(
        f"Replayed{base.__name__}",
        (SeededGenerations, _Unanswered, base),
        {"generation_seeds": dict(generations)},
    )
