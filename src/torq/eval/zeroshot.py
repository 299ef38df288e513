"""Zero-shot accuracy through lm-evaluation-harness, offline (the paper's Tables 1, 9–13).

The six tasks of the paper are lm-eval's built-in ``arc_challenge``, ``arc_easy``,
``hellaswag``, ``lambada_openai``, ``piqa`` and ``winogrande``. For each one a task config
is generated that ``include:``s the built-in config, so prompts, metrics and splits are
exactly the standard ones, and only swaps the dataset for the local JSON file of the data
directory (``zeroshot/`` in ``../shared/data``; ``dataset_path: json``). Where the data
directory lacks a file, the built-in task and its hub dataset are used if the hub is
reachable; otherwise the error names the file it expected.

The model object is evaluated in process (wrapped as lm-eval's ``HFLM``), so a quantized
model is scored as it is, not reloaded. The paper reports ``acc_norm`` where a task has
it, else ``acc``; :func:`headline_scores` does the same and adds the average.
"""

from __future__ import annotations

import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torq.data import DATA_DIR_ENV, resolve_data_dir
from torq.errors import TorqError
from torq.eval.store import EvalStore
from torq.models.fingerprint import check_fingerprint, fingerprint_ids, logits_fingerprint
from torq.results import now_iso
from torq.seeding import seeded_subset_ids


@dataclass(frozen=True)
class ZeroShotTask:
    """A paper task: lm-eval's built-in config and the local file that replaces its data."""

    name: str
    builtin_yaml: str  # relative to lm_eval/tasks
    local_file: str  # relative to the data directory
    split: str  # the split lm-eval scores ("test" or "validation")
    label: str  # column name in the paper's tables


TASKS: dict[str, ZeroShotTask] = {
    t.name: t
    for t in (
        ZeroShotTask(
            "arc_challenge",
            "arc/arc_challenge.yaml",
            "zeroshot/arc_challenge_test.jsonl",
            "test",
            "ARC-C",
        ),
        ZeroShotTask(
            "arc_easy", "arc/arc_easy.yaml", "zeroshot/arc_easy_test.jsonl", "test", "ARC-E"
        ),
        ZeroShotTask(
            "hellaswag",
            "hellaswag/hellaswag.yaml",
            "zeroshot/hellaswag_validation.jsonl",
            "validation",
            "Hella",
        ),
        ZeroShotTask(
            "lambada_openai",
            "lambada/lambada_openai.yaml",
            "zeroshot/lambada_openai_test.jsonl",
            "test",
            "LAMBADA",
        ),
        ZeroShotTask(
            "piqa", "piqa/piqa.yaml", "zeroshot/piqa_validation.jsonl", "validation", "PIQA"
        ),
        ZeroShotTask(
            "winogrande",
            "winogrande/default.yaml",
            "zeroshot/winogrande_xl_validation.jsonl",
            "validation",
            "WinG",
        ),
    )
}
PAPER_TASKS = tuple(TASKS)
LOCAL_PREFIX = "torq_"


def parse_tasks(spec: str) -> list[str]:
    """``"all"`` or a comma-separated list of the paper's task names."""
    names = (
        list(PAPER_TASKS)
        if spec.strip().lower() == "all"
        else [t.strip() for t in spec.split(",") if t.strip()]
    )
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise TorqError(
            f"unknown zero-shot task(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(PAPER_TASKS)} or 'all'"
        )
    return names


def _lm_eval_tasks_dir() -> Path:
    try:
        import lm_eval
    except ImportError:
        raise TorqError(
            "zero-shot evaluation needs lm-evaluation-harness: pip install 'torq-mx[eval]'"
        ) from None
    return Path(lm_eval.__file__).resolve().parent / "tasks"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers on its HTTPS port (the fallback needs it)."""
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def local_task_yaml(task: ZeroShotTask, data_file: Path, tasks_dir: Path) -> str:
    """The generated config: the built-in task, its data swapped for ``data_file``."""
    builtin = tasks_dir / task.builtin_yaml
    if not builtin.is_file():
        raise TorqError(f"lm-eval has no built-in config {builtin}; unsupported lm-eval version")
    splits = {"training_split": "null", "validation_split": "null", "test_split": "null"}
    splits[f"{task.split}_split"] = task.split
    lines = [
        f"include: {builtin}",
        f"task: {LOCAL_PREFIX}{task.name}",
        "tag: []",
        "dataset_path: json",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    {task.split}: {data_file}",
        *(f"{k}: {v}" for k, v in splits.items()),
    ]
    return "\n".join(lines) + "\n"


def task_data_files(names: list[str], data_dir: str | None) -> dict[str, Path | None]:
    """Each paper task's local data file, or ``None`` where it is read from the hub.

    Raises :class:`TorqError` (before any model is loaded, :func:`torq.pipeline.run`) when
    lm-eval is not installed, or a file is missing and the hub is not reachable."""
    _lm_eval_tasks_dir()
    root = resolve_data_dir(data_dir)
    files: dict[str, Path | None] = {}
    missing: list[Path] = []
    for name in names:
        data_file = None if root is None else root / TASKS[name].local_file
        if data_file is not None and data_file.is_file():
            files[name] = data_file.resolve()
        else:
            files[name] = None
            if data_file is not None:
                missing.append(data_file)
    if any(f is None for f in files.values()) and not hub_reachable():
        where = (
            f"expected {', '.join(str(m) for m in missing)}"
            if missing
            else f"no data directory given (--data-dir or ${DATA_DIR_ENV})"
        )
        raise TorqError(
            f"zero-shot data not found ({where}) and the Hugging Face hub is not reachable"
        )
    return files


def prepare_tasks(names: list[str], data_dir: str | None, config_dir: Path) -> dict[str, str]:
    """Write the offline configs into ``config_dir``; map each paper task to the lm-eval
    task name to run (the local config, or the built-in one as the hub fallback)."""
    tasks_dir = _lm_eval_tasks_dir()
    run_names: dict[str, str] = {}
    for name, data_file in task_data_files(names, data_dir).items():
        if data_file is None:
            run_names[name] = name
            continue
        (config_dir / f"{LOCAL_PREFIX}{name}.yaml").write_text(
            local_task_yaml(TASKS[name], data_file, tasks_dir)
        )
        run_names[name] = f"{LOCAL_PREFIX}{name}"
    return run_names


def from_hub(run_names: dict[str, str]) -> bool:
    """Whether any task of :func:`prepare_tasks`' map runs lm-eval's built-in config (its
    data from the hub): only then is lm-eval's own task index needed (thousands of configs,
    about 15 s to build); the local configs include their built-in one by path."""
    return any(run == name for name, run in run_names.items())


def seeded_subset(
    names: list[str], n: int, seed: int, data_dir: str | None
) -> dict[str, list[int]]:
    """``n`` questions of each task in ``names`` drawn with ``seed`` (sorted doc ids, all of
    a task that has fewer): the same questions for every method of a seed, so two rows pair
    question by question (:mod:`torq.eval.paired`); drawn at random they stand for the
    task, where the first ``n`` (``limit``) follow the file's order. The draw is
    :func:`torq.seeding.seeded_subset_ids`, as for GSM8K's problems. Needs each task's
    local file (its lines are the docs, in lm-eval's order); raises :class:`TorqError`
    naming the file otherwise."""
    if n < 1:
        raise TorqError(f"a seeded subset needs at least one question per task, got {n}")
    chosen: dict[str, list[int]] = {}
    for name, data_file in task_data_files(names, data_dir).items():
        if data_file is None:
            raise TorqError(
                f"a seeded subset of {name} needs its local file "
                f"<data-dir>/{TASKS[name].local_file} (the hub copy's size is not known here)"
            )
        with data_file.open(encoding="utf-8") as f:
            total = sum(1 for line in f if line.strip())
        chosen[name] = seeded_subset_ids(total, n, seed)
    return chosen


def headline_scores(results: dict[str, Any], run_names: dict[str, str]) -> dict[str, Any]:
    """``acc_norm`` where the task has it, else ``acc`` (as the paper), and their average."""
    scores: dict[str, Any] = {}
    for name, run_name in run_names.items():
        r = results[run_name]
        metric = "acc_norm,none" if "acc_norm,none" in r else "acc,none"
        stderr = r.get(metric.replace(",", "_stderr,"))
        scores[name] = {
            "metric": metric.split(",")[0],
            "value": float(r[metric]),
            "stderr": None if stderr in (None, "N/A") else float(stderr),
        }
    values = [s["value"] for s in scores.values()]
    return {"tasks": scores, "average": sum(values) / len(values)}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


def in_process_lm(cls: type, model: torch.nn.Module, tokenizer: Any, batch_size: int) -> Any:
    """lm-eval's model wrapper ``cls`` (``HFLM`` or a subclass) around ``model`` as it is in
    memory, on its device, with the model's own context length."""
    return cls(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        device=str(next(model.parameters()).device),
        max_length=getattr(model.config, "max_position_embeddings", 2048),
    )


def evaluate_zeroshot(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: list[str],
    data_dir: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    shared_context: bool = True,
    store: EvalStore | None = None,
    subset: int | None = None,
    subset_seed: int = 0,
) -> dict[str, Any]:
    """Score ``model`` (in process) on the paper's zero-shot tasks through lm-eval.

    ``limit`` scores the first questions of each task; ``subset`` scores ``subset``
    questions of each drawn with ``subset_seed`` (:func:`seeded_subset`) instead.

    With ``shared_context`` (the default) the choices of a question share one forward pass
    of their common context (:class:`torq.eval.shared_context.SharedContextHFLM`, same
    scores to float rounding); ``False`` uses lm-eval's ``HFLM`` as it is.

    ``store`` keeps this model's answers as they are scored (:func:`answers_cached_in`): a
    run that is stopped keeps what it scored, and the same call again scores only the rest.
    A store belongs to one model: its logits fingerprint is kept there and a different
    model is refused.

    Returns ``{"scores": headline_scores(...), "lm_eval": <lm-eval's results, configs and
    versions>, "seconds": wall time, "limit": limit, "subset": {"n", "seed", "questions"}
    or None, "shared_context": shared_context, "request_cache": {...} or None}``.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if subset is not None and limit is not None:
        raise TorqError("give either a limit (the first questions) or a seeded subset, not both")
    names = [parse_tasks(t)[0] for t in tasks] if tasks else list(PAPER_TASKS)
    drawn = None if subset is None else seeded_subset(names, subset, subset_seed, data_dir)
    with tempfile.TemporaryDirectory(prefix="torq-lmeval-") as tmp:
        run_names = prepare_tasks(names, data_dir, Path(tmp))
        manager = TaskManager(include_path=tmp, include_defaults=from_hub(run_names))
        base: type[HFLM] = HFLM
        if shared_context:
            from torq.eval.shared_context import SharedContextHFLM

            base = SharedContextHFLM
        lm = in_process_lm(base, model, tokenizer, batch_size)
        with answers_cached_in(store, model, tokenizer, lm) as cache:
            t0 = time.perf_counter()
            out = simple_evaluate(
                model=lm,
                use_cache=cache.use_cache,
                tasks=list(run_names.values()),
                task_manager=manager,
                limit=limit,
                samples=None if drawn is None else {run_names[t]: ids for t, ids in drawn.items()},
                num_fewshot=0,
                log_samples=False,
                bootstrap_iters=1000,
                verbosity="WARNING" if not progress else "INFO",
            )
            if out is None:
                raise TorqError("lm-eval returned no results")
        seconds = time.perf_counter() - t0
    cache_info = cache.info
    return {
        "scores": headline_scores(out["results"], run_names),
        "lm_eval": _jsonable(
            {k: out.get(k) for k in ("results", "configs", "versions", "n-shot", "n-samples")}
        ),
        "seconds": seconds,
        "limit": limit,
        "subset": None
        if drawn is None
        else {"n": subset, "seed": subset_seed, "questions": {t: len(i) for t, i in drawn.items()}},
        "shared_context": shared_context,
        "request_cache": cache_info,
    }


HEARTBEAT_SECONDS = 60.0


CACHE_STEM = "requests"  # lm-eval's CachingLM adds "_rank<N>.db"


def _answers_db(store: EvalStore) -> Path:
    return Path(store.file(f"{CACHE_STEM}_rank0.db"))


def _cache_entries(db: Path) -> int:
    if not db.is_file():
        return 0
    con = sqlite3.connect(db)
    try:
        return int(con.execute("SELECT COUNT(*) FROM unnamed").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        con.close()


# the store's record of the answers' sessions (and the model they belong to)
SESSIONS = "meta"


def open_request_cache(
    store: EvalStore, model: torch.nn.Module, tokenizer: Any, batch_size: Any = None
) -> dict[str, Any]:
    """Check (or claim) ``store`` for ``model`` by its logits fingerprint; log the
    session's start, with the batch size its answers are made in where given (a generated
    answer may depend on it)."""
    fingerprint = logits_fingerprint(model, fingerprint_ids(tokenizer))
    meta = store.read(SESSIONS)
    if meta is None:
        meta = {"fingerprint": fingerprint, "sessions": []}
    else:
        check_fingerprint(meta["fingerprint"], fingerprint, str(store))
    before = _cache_entries(_answers_db(store))
    session: dict[str, Any] = {"started": now_iso(), "entries_before": before}
    if batch_size is not None:
        session["batch_size"] = batch_size
    meta["sessions"].append(session)
    store.write(SESSIONS, meta)
    return {"store": str(store), "entries_before": before}


class _Heartbeat(threading.Thread):
    """Records the running session's time and answers in the store every ``every``
    seconds, so that a session that is killed still tells how long it scored."""

    def __init__(
        self,
        store: EvalStore,
        t0: float,
        every: float | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.store, self.t0 = store, t0
        self.every = HEARTBEAT_SECONDS if every is None else every
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            meta = self.store.read(SESSIONS)
            assert meta is not None, "the session was opened"
            meta["sessions"][-1].update(
                seconds_so_far=time.perf_counter() - self.t0,
                entries_so_far=_cache_entries(_answers_db(self.store)),
            )
            self.store.write(SESSIONS, meta)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def close_request_cache(store: EvalStore, info: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Log the finished session in the store; the record's summary of the kept answers."""
    meta = store.read(SESSIONS)
    assert meta is not None, "the session was opened"
    after = _cache_entries(_answers_db(store))
    meta["sessions"][-1].update(finished=now_iso(), seconds=seconds, entries_after=after)
    store.write(SESSIONS, meta)
    return {**info, "entries_after": after, "sessions": meta["sessions"]}


def sessions_seconds(sessions: list[dict[str, Any]]) -> float:
    """The wall time a resumed row took over all its sessions: each finished session's
    ``seconds``, and for one that was stopped the last heartbeat's ``seconds_so_far`` (so
    at most one heartbeat short). A record's ``seconds`` is only the last session's."""
    return float(sum(s.get("seconds", s.get("seconds_so_far", 0.0)) for s in sessions))


@dataclass
class CachedAnswers:
    """What :func:`answers_cached_in` gives the ``with`` body and leaves after it."""

    use_cache: str | None  # for ``simple_evaluate(use_cache=...)``; None: no cache
    info: dict[str, Any] | None = None  # the record's summary, set when the body finished


@contextmanager
def answers_cached_in(
    store: EvalStore | None,
    model: torch.nn.Module,
    tokenizer: Any,
    lm: Any,
) -> Iterator[CachedAnswers]:
    """An lm-eval run whose answers are kept in ``store`` as they come (lm-eval's
    ``CachingLM``, in the store's file; ``None``: not kept): the store is checked (or
    claimed) for ``model`` by its logits fingerprint, a heartbeat logs the session there,
    lm-eval's SQLite writer (on ``lm``'s cache hook) is closed after the run, and when the
    body finished, ``info`` summarises the kept answers for the record."""
    if store is None:
        yield CachedAnswers(None)
        return
    opened = open_request_cache(store, model, tokenizer, getattr(lm, "batch_size", None))
    t0 = time.perf_counter()
    cache = CachedAnswers(store.file(CACHE_STEM))
    heartbeat = _Heartbeat(store, t0)
    try:
        yield cache
    finally:
        heartbeat.stop()
        # lm-eval's CachingLM leaves its SQLite writer thread open; close it here
        db = getattr(getattr(lm, "cache_hook", None), "dbdict", None)
        if db is not None:
            db.close()
    cache.info = close_request_cache(store, opened, time.perf_counter() - t0)
