"""Untrusted generated code runs isolated: each hostile program is contained and fails."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from torq.errors import TorqError
from torq.eval.sandbox import SandboxLimits, isolation_problem, run_untrusted

PROBLEM = isolation_problem()
needs_isolation = pytest.mark.skipif(
    PROBLEM is not None, reason=f"the sandbox cannot isolate here: {PROBLEM}"
)
QUICK = SandboxLimits(wall_seconds=4.0, cpu_seconds=2, processes=8)


def _nobody_processes() -> list[str]:
    out = subprocess.run(["ps", "-u", "65534", "-o", "pid="], capture_output=True, text=True)
    return out.stdout.split()


def _sandboxes() -> set[str]:
    return {p.name for p in Path("/tmp").glob("torq-sandbox-*")}


@needs_isolation
def test_a_correct_program_passes_and_a_failing_one_does_not() -> None:
    ok = run_untrusted("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('fine')\n", QUICK)
    assert ok.passed and ok.stdout == "fine\n"
    bad = run_untrusted("assert 1 + 1 == 3\n", QUICK)
    assert not bad.passed and bad.reason == "AssertionError"


@needs_isolation
@pytest.mark.parametrize(
    ("name", "program"),
    [
        ("endless loop", "while True:\n    pass\n"),
        ("sleep past the wall clock", "import time\ntime.sleep(60)\n"),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n",
        ),
        ("unbounded memory", "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 26))\n"),
        ("a socket", "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)\n"),
        ("the user's home", "print(open('HOME/.torq-sandbox-secret').read())\n"),
        ("writing outside", "open('OUTSIDE/written-by-the-sandbox', 'w').write('x')\n"),
        ("deleting outside", "import os\nos.remove('OUTSIDE/canary')\n"),
        ("the environment", "import os\nassert 'TORQ_SANDBOX_SECRET' in os.environ\n"),
    ],
)
def test_hostile_programs_are_contained(name, program, tmp_path, monkeypatch) -> None:
    """Each program fails within its limits, leaves no process behind, touches nothing
    outside its scratch directory (removed afterwards), reaches no network and reads
    nothing of root's home or of the caller's environment."""
    home = Path(os.path.expanduser("~"))
    secret = home / ".torq-sandbox-secret"
    secret.write_text("secret")
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # even a folder anyone may write to is read-only in the sandbox
    (outside / "canary").write_text("still here")
    (outside / "canary").chmod(0o666)
    monkeypatch.setenv("TORQ_SANDBOX_SECRET", "secret")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    before = _sandboxes()
    source = (
        program.replace("PORT", str(port))
        .replace("HOME", str(home))
        .replace("OUTSIDE", str(outside))
    )
    try:
        t0 = time.perf_counter()
        result = run_untrusted(source, QUICK)
        elapsed = time.perf_counter() - t0
    finally:
        server.close()
        secret.unlink()
    assert not result.passed, (name, result)
    assert elapsed < QUICK.wall_seconds + 3
    assert "secret" not in result.stdout
    assert (outside / "canary").read_text() == "still here"
    assert sorted(p.name for p in outside.iterdir()) == ["canary"]
    assert _sandboxes() == before  # the scratch directory is gone
    assert _nobody_processes() == [], name  # run_untrusted waits for its namespace to empty


@needs_isolation
def test_the_program_writes_in_its_own_scratch_directory_only() -> None:
    result = run_untrusted(
        "import os, tempfile\nopen('here.txt', 'w').write('x')\n"
        "print(os.getuid(), os.getcwd() == os.environ['HOME'] == tempfile.gettempdir())\n",
        QUICK,
    )
    assert result.passed and result.stdout == "65534 True\n"


def test_without_isolation_nothing_runs(monkeypatch) -> None:
    """Where the namespaces or the tools are missing the code is refused, not run bare."""
    import torq.eval.sandbox as sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "root is needed")
    with pytest.raises(TorqError, match="not run without isolation: root is needed"):
        run_untrusted("print('x')")


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    from torq.eval.humaneval import pass_at_k

    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 − C(7,5)/C(10,5)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer failures than draws
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@needs_isolation
def test_humaneval_canonical_solutions_pass_and_wrong_ones_do_not() -> None:
    """The problems' own solutions score 100 % through the sandbox (the first 12 here;
    ``benchmarks/humaneval_canonical.py`` runs all 164), a wrong or hostile completion 0."""
    from tests.conftest import SHARED_DATA
    from torq.eval.humaneval import load_humaneval, score

    if not (SHARED_DATA / "humaneval").is_dir():
        pytest.fail(f"HumanEval is expected in {SHARED_DATA}/humaneval (../shared/data)")
    problems = load_humaneval(SHARED_DATA)
    assert len(problems) == 164
    some = problems[:12]
    right = score(some, {p.task_id: [p.canonical_solution] for p in some})
    assert right["pass@1"] == 1.0 and right["problems"] == 12
    wrong = score(
        some[:3],
        {
            some[0].task_id: ["    return None\n"],
            some[1].task_id: ["    while True:\n        pass\n"],
            some[2].task_id: ["    import os\n    os.system('rm -rf /')\n"],
        },
        limits=QUICK,
    )
    assert wrong["pass@1"] == 0.0
    assert wrong["tasks"][some[1].task_id]["first_failure"] == "killed (a limit was reached)"
    assert wrong["tasks"][some[0].task_id]["first_failure"] == "AssertionError"


@needs_isolation
def test_humaneval_completions_are_the_models_greedy_continuations(tiny_tokenizer) -> None:
    """lm-eval generates each completion offline (torq's own config of its humaneval task):
    the model's greedy continuation of the prompt, cut at the task's first stop sequence;
    the completions are then scored in the sandbox."""
    from tests.conftest import SHARED_DATA, tiny_model
    from torq.eval.generation import STOP, evaluate_humaneval
    from torq.eval.humaneval import load_humaneval

    model = tiny_model("llama")
    result = evaluate_humaneval(model, tiny_tokenizer, str(SHARED_DATA), limit=2, max_gen_toks=8)
    assert result["problems"] == 2 and result["pass@1"] == 0.0  # a random tiny model
    for problem in load_humaneval(SHARED_DATA)[:2]:
        ids = tiny_tokenizer(problem.prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(ids.input_ids, max_new_tokens=8, do_sample=False)
        text = tiny_tokenizer.decode(out[0, ids.input_ids.shape[1] :])
        for stop in STOP:
            text = text.split(stop)[0]
        got = result["tasks"][problem.task_id]
        assert got["completion"] == text
        assert got["first_failure"] is not None
