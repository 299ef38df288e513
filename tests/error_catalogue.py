"""The bad inputs of docs/errors.md, each with the one line torq answers. The page is
written from these cases by ``tests/test_error_catalogue.py``, which runs every case and
fails when the page no longer says what torq says (``TORQ_WRITE_DOCS=1`` writes it anew)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


@dataclass(frozen=True)
class ErrorCase:
    """One bad input: the ``torq`` arguments as a user types them (in a folder laid out by
    :func:`lay_out`), what it is in words where the command alone does not say, and the
    section of the page it belongs to."""

    argv: tuple[str, ...]
    section: str
    what: str = ""


RUN, QUANTIZE, MODELS = "torq run and torq eval", "torq quantize", "models and files"


def _cases() -> list[ErrorCase]:
    def run(*a: str, what: str = "") -> ErrorCase:
        return ErrorCase(("run", *a), RUN, what)

    def quantize(*a: str, what: str = "") -> ErrorCase:
        return ErrorCase(("quantize", *a), QUANTIZE, what)

    def smol(*a: str, what: str = "") -> ErrorCase:
        return quantize("smollm2-135m", "--out", "q", *a, what=what)

    def model(*a: str, what: str = "") -> ErrorCase:
        return ErrorCase(a, MODELS, what)

    return [
        run("--format", "mxfp5"),
        run("--max-windows", "0"),
        run("--scale-mode", "banana"),
        run("--balance", "2"),
        run("--torq-calibrate", "o_proj,1x"),
        run("--methods", "nope"),
        run("--methods", "fp,rtn,fp"),
        run("--methods", "gptq,RTN+gptq"),
        run("--methods", "rtn", "--seqlen", "100000"),
        run("--methods", "torq", "--calib-seqlen", "9000"),
        run("--methods", "torq", "--k-top", "99"),
        run("--methods", "torq-perm", "--balance", "none"),
        run("--methods", "fp", "--device", "banana"),
        run("--methods", "fp", "--device", "meta"),
        run("--methods", "rtn", "--out", "afile/r.json", what="`afile` is a file"),
        run("--methods", "rtn", "--out", "afolder", what="`afolder` is a folder"),
        run("--methods", "rtn", "--save-dir", "afile"),
        run("--methods", "rtn", "--packed"),
        run("--methods", "torq", "--calib-data", "nowhere.txt"),
        run("--methods", "torq", "--calib-data", "stdlib"),
        run("--methods", "fp", "--eval-corpus", "wikipedia"),
        run("--methods", "rtn", "--data-dir", "/nonexistent"),
        run("--methods", "torq-had32", "--save-dir", "s", "--save-format", "compressed-tensors"),
        run(
            "--methods",
            "rtn",
            "--format",
            "nvfp4",
            "--save-dir",
            "s",
            "--save-format",
            "compressed-tensors",
        ),
        run("--methods", "rtn", "--act-scale", "static"),
        run("--methods", "rtn", "--scale-mode", "4over6"),
        quantize("smollm2-135m", "--out", "q", "--recipe", "nope"),
        quantize(
            "smollm2-135m",
            "--out",
            "q",
            "--recipe",
            "best-ppl",
            "--save-format",
            "compressed-tensors",
        ),
        quantize(
            "smollm2-135m",
            "--out",
            "q",
            "--format",
            "mxint4",
            "--save-format",
            "compressed-tensors",
        ),
        smol("--calib-data", "nowhere.txt"),
        smol("--calib-data", "empty.jsonl", what="an empty file"),
        smol("--calib-data", "prompts.jsonl", what="records with a `prompt` field only"),
        smol("--calib-data", "prompts.jsonl#question"),
        smol("--calib-data", "chats.jsonl", what="`messages` that are a string"),
        smol("--calib-data", "wikitext2-valid:100,prompts.jsonl#prompt:100"),
        smol("--ignore", "dwn_proj"),
        smol("--ignore", "re:(q|k"),
        smol("--avg-bits", "4.2"),
        smol("--avg-bits", "9"),
        smol("--avg-bits", "five"),
        smol("--avg-bits", "5", "--budget-by", "middle"),
        smol("--avg-bits", "4.4", "--format", "nvfp4", what="NVFP4 weights"),
        run("--methods", "rtn", "--avg-bits", "5", "--w-format", "none"),
        quantize("smollm2-135m", "--out", "occ", what="`occ` holds a file"),
        quantize("smollm2-135m", "--out", "occ/f"),
        quantize("smollm2-135m", "--out", "q", "--device", "banana"),
        quantize("olmo2-model", "--out", "q", what="an OLMo 2 folder"),
        quantize(
            "qwen3-moe-model",
            "--out",
            "q",
            "--format",
            "nvfp4",
            "--save-format",
            "compressed-tensors",
            what="a Qwen3-MoE folder",
        ),
        run(
            "--model",
            "qwen3-moe-model",
            "--methods",
            "had32",
            "--save-dir",
            "d",
            "--save-format",
            "compressed-tensors",
            what="a Qwen3-MoE folder",
        ),
        model("run", "--model", "no-such-model", "--methods", "fp"),
        model("quantize", "nomodel", "--out", "q"),
        model("run", "--model", "afolder", "--methods", "rtn", what="`afolder` is empty"),
        model("eval", "--model", "bad", what="`bad/config.json` is not JSON"),
        model(
            "run",
            "--model",
            "cut.gguf",
            "--methods",
            "rtn",
            what="`cut.gguf`: the first MiB of a GGUF file",
        ),
    ]


CASES = _cases()


def lay_out(folder: Path, tiny_folder: Callable[[str, Path], None]) -> None:
    """The files the cases name, in ``folder``: ``tiny_folder(model_type, path)`` writes a
    tiny model of that architecture (the test suite's)."""
    from torq.models.loading import resolve_embedded_gguf

    (folder / "afile").write_text("x")
    (folder / "empty.jsonl").write_text("")
    (folder / "prompts.jsonl").write_text('{"prompt": "Say hello."}\n')
    (folder / "chats.jsonl").write_text('{"messages": "Say hello."}\n')
    (folder / "afolder").mkdir()
    (folder / "occ").mkdir()
    (folder / "occ" / "f").write_text("x")
    (folder / "bad").mkdir()
    (folder / "bad" / "config.json").write_text("{bad")
    with open(resolve_embedded_gguf("smollm2-135m"), "rb") as f:
        (folder / "cut.gguf").write_bytes(f.read(1 << 20))
    tiny_folder("olmo2", folder / "olmo2-model")
    tiny_folder("qwen3_moe", folder / "qwen3-moe-model")


HEAD = """\
# Bad inputs and what torq says

A bad input gets one line on stderr and exit status 2, before any model is converted or
calibrated: the arguments, the model's architecture and context length, the data files and
the destinations are checked first. Each line below is what torq prints today for that
input; the test suite runs every one of them and fails when this page says otherwise
(`tests/test_error_catalogue.py`; `TORQ_WRITE_DOCS=1` writes the page anew).

The examples run in a folder holding `afile` (a file), `afolder` (an empty folder), `occ`
(a folder with a file in it), `bad/config.json` (not JSON), `cut.gguf` (the first MiB of a
GGUF file), three small JSON lines files and two tiny model folders; `smollm2-135m` is the
embedded default model, and the model of a `torq run` without `--model`.
"""

TAIL = """
The context check reads the model's `config.json` (`max_position_embeddings`, or the same
in its `text_config`) or the GGUF's `<arch>.context_length`, without loading or converting
the model; a hub id is not checked before it is fetched. A folder written by `torq
quantize` and loaded with transformers alone is refused too:
[serving](serving.md#loading-the-folder).
"""


def render(messages: dict[tuple[str, ...], str]) -> str:
    """docs/errors.md: :data:`CASES` with their ``messages``, a table a section."""
    blocks = [HEAD.strip()]
    for section in (RUN, QUANTIZE, MODELS):
        rows = [f"## {section}\n", "| input | what torq says |", "| --- | --- |"]
        for case in CASES:
            if case.section == section:
                shown = f"`torq {' '.join(case.argv)}`"
                if case.what:
                    shown += f" ({case.what})"
                message = messages[case.argv].replace("|", "\\|")
                rows.append(f"| {shown} | `{message}` |")
        blocks.append("\n".join(rows))
    return "\n\n".join([*blocks, TAIL.strip()]) + "\n"
