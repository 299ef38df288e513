"""Every ``torq`` command the README and docs show is one the command line takes: a whole
command in a code block parses with the real parser (and names methods that exist); a
command quoted inline, often a fragment (`torq quantize --rotate-biased`), names a real
subcommand and only options it has. The research log is left out: it keeps each command as
it was run on its date, options since renamed included."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from torq.cli.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_SHELL_OPS = ("|", "||", "&&", ";", ">", ">>", "2>&1", "&")


def commands_in(text: str) -> list[tuple[str, bool]]:
    """The ``torq`` commands of a markdown page: ``(command, whole)``, ``whole`` for a line
    of a code block (continuations joined), not for an inline code span."""
    found: list[tuple[str, bool]] = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"(?:^|&&|;|\$)\s*(torq\s.*)$", line.strip())
            if m:
                found.append((m.group(1), True))
    for span in re.findall(r"`([^`\n]+)`", _FENCE.sub("", text)):
        if span.startswith("torq "):
            found.append((span, False))
    return found


def _words(command: str) -> list[str]:
    words = shlex.split(command, comments=True)[1:]
    for i, w in enumerate(words):
        if w in _SHELL_OPS:
            return words[:i]
    return words


def _parse_error(words: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser(True).parse_args(words)
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if exc.code else None
    from torq.errors import TorqError
    from torq.methods import get_method

    for name in (getattr(args, "methods", None) or "").split(","):
        try:
            if name.strip():
                get_method(name.strip())
        except TorqError as exc:
            return str(exc)
    return None


def _options_of(command: str) -> set[str] | None:
    parser = build_parser(True)
    sub = next(a for a in parser._actions if a.dest == "command")
    chosen = sub.choices.get(command)  # type: ignore[union-attr]
    return None if chosen is None else set(chosen._option_string_actions)


def problem(command: str, whole: bool) -> str | None:
    """What is wrong with one quoted command, or ``None``."""
    try:
        words = _words(command)
    except ValueError as exc:
        return f"not a shell command ({exc})"
    if whole:
        return _parse_error(words)
    if not words or words[0].endswith(":"):  # a message torq printed, not a command
        return None
    options = _options_of(words[0])
    if options is None:
        return f"no subcommand '{words[0]}'"
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    unknown = [w for w in unknown if w not in options]
    return f"torq {words[0]} has no {', '.join(unknown)}" if unknown else None


def problems(pages: list[Path]) -> list[str]:
    return [
        f"{page.name}: `{command}`: {why}"
        for page in pages
        for command, whole in commands_in(page.read_text())
        if (why := problem(command, whole))
    ]


def test_every_documented_command_is_one_torq_takes() -> None:
    assert len([c for p in PAGES for c in commands_in(p.read_text())]) > 50
    assert problems(PAGES) == []


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("```bash\ntorq run --methods fp --portable-dir x\n```\n", "--portable-dir"),
        ("Run `torq run --stream` to stream.", "--stream"),
        ("```bash\ntorq quantize m --out q \\\n  --recipe nope\n```\n", "nope"),
        ("```bash\ncd x && torq run --methods had33\n```\n", "had33"),
        ("`torq serve`", "no subcommand"),
    ],
)
def test_a_planted_bad_command_is_found(tmp_path: Path, text: str, bad: str) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n" + text + "\n`torq quantize --rotate-biased` is fine.\n")
    found = problems([page])
    assert len(found) == 1 and bad in found[0], found


def test_every_documented_benchmark_module_exists() -> None:
    """``python -m benchmarks.NAME`` in the README and docs names a module there is."""
    named = {
        m
        for page in PAGES
        for m in re.findall(r"python3? -m (benchmarks(?:\.\w+)+)", page.read_text())
    }
    assert named
    named.discard("benchmarks.NAME")  # the placeholder of the page that says how they run
    missing = [m for m in sorted(named) if not (ROOT / (m.replace(".", "/") + ".py")).is_file()]
    assert missing == []


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces
    as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(pages: list[Path]) -> list[str]:
    """Each relative link of ``pages`` whose file, or whose heading in that file, is not
    there."""
    out = []
    for page in pages:
        text = _FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                out.append(f"{page.name}: {target}: no such file")
            elif anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", _FENCE.sub("", path.read_text()), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    out.append(f"{page.name}: {target}: no such heading")
    return out


def test_every_link_of_the_docs_leads_somewhere() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages = [p for p in pages if "records" not in p.parts]
    assert broken_links(pages) == []


def test_a_planted_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Part two\n\n[ok](#part-two) [gone](#part-three) [no](x.md)\n")
    assert broken_links([page]) == [
        "page.md: #part-three: no such heading",
        "page.md: x.md: no such file",
    ]
