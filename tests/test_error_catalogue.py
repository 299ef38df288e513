"""docs/errors.md says what torq says: every bad input it lists is run here, and must give
one line and exit status 2 before any model is converted or calibrated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import tiny_model
from tests.error_catalogue import CASES, DOC, lay_out, render


@pytest.fixture(scope="module")
def messages(tmp_path_factory, tiny_tokenizer, shared_data) -> dict[tuple[str, ...], str]:
    """Each case's stderr line, run in a folder laid out for it; ``TORQ_WRITE_DOCS=1``
    writes the page from them."""
    from torq.cli import main

    folder = tmp_path_factory.mktemp("errors")

    def tiny_folder(model_type: str, path: Path) -> None:
        tiny_model(model_type).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)

    lay_out(folder, tiny_folder)
    found: dict[tuple[str, ...], str] = {}
    here = Path.cwd()
    os.chdir(folder)
    try:
        for case in CASES:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TORQ_DATA_DIR", str(shared_data))
                err = _stderr_of(main, list(case.argv), case.argv)
            found[case.argv] = err.replace(f"{folder}/", "")
    finally:
        os.chdir(here)
    if os.environ.get("TORQ_WRITE_DOCS"):
        DOC.write_text(render(found))
    return found


def _stderr_of(main, argv: list[str], label: tuple[str, ...]) -> str:
    """What ``torq ARGV`` prints on stderr, with its exit status checked to be 2."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([*argv, "--no-progress"] if argv[0] in ("run", "eval") else argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, (label, code, err.getvalue()[-2000:])
    return lines[0]


def test_every_listed_input_gets_one_line(messages) -> None:
    assert set(messages) == {case.argv for case in CASES}
    assert all(m.startswith("torq") and "Traceback" not in m for m in messages.values())


def test_the_page_says_what_torq_says(messages) -> None:
    assert DOC.read_text() == render(messages), (
        "docs/errors.md differs from what torq prints: TORQ_WRITE_DOCS=1 pytest "
        "tests/test_error_catalogue.py writes it anew"
    )
