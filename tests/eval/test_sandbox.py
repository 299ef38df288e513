"""Untrusted generated code runs isolated: each hostile program is contained and fails."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torq.errors import TorqError
from torq.eval.sandbox import SandboxLimits, isolation_problem, processes_in, run_untrusted

PROBLEM = isolation_problem()
needs_isolation = pytest.mark.skipif(
    PROBLEM is not None, reason=f"the sandbox cannot isolate here: {PROBLEM}"
)
QUICK = SandboxLimits(wall_seconds=4.0, cpu_seconds=2, processes=8)


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
        ("the user's home", "print(open('SECRET').read())\n"),
        ("writing outside", "open('OUTSIDE/written-by-the-sandbox', 'w').write('x')\n"),
        ("deleting outside", "import os\nos.remove('OUTSIDE/canary')\n"),
        ("the environment", "import os\nassert 'TORQ_SANDBOX_SECRET' in os.environ\n"),
    ],
)
def test_hostile_programs_are_contained(name, program, tmp_path, monkeypatch) -> None:
    """Each program fails within its limits, leaves no process behind, touches nothing
    outside its scratch directory (removed afterwards), reaches no network and reads
    nothing of root's home or of the caller's environment."""
    # a file of this test's own: the test suite's workers run these tests side by side
    secret = Path(os.path.expanduser("~")) / f".torq-sandbox-secret-{uuid.uuid4().hex}"
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
    source = (
        program.replace("PORT", str(port))
        .replace("SECRET", str(secret))
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
    # this run's own scratch directory is gone and its PID namespace is empty (a process
    # cannot leave its PID namespace, so nothing of the program is left anywhere); checked
    # for this run alone, since other sandboxes may run on the machine meanwhile
    assert result.scratch.startswith(tempfile.gettempdir()) and not Path(result.scratch).exists()
    assert result.namespace is not None and processes_in(result.namespace) == [], name


@needs_isolation
def test_sandboxes_side_by_side_each_clean_up_their_own() -> None:
    """Two sandboxes at once (the test suite's workers, two benchmark rows): each has its
    own scratch directory and PID namespace, and ends its own processes only."""
    with ThreadPoolExecutor(2) as pool:
        sleeper = pool.submit(run_untrusted, "import time\ntime.sleep(60)\n", QUICK)
        time.sleep(0.5)  # the second starts while the first runs
        fine = pool.submit(run_untrusted, "print('fine')\n", QUICK)
        sleeper_result, fine_result = sleeper.result(), fine.result()
    assert fine_result.passed and fine_result.stdout == "fine\n"
    assert sleeper_result.timed_out and not sleeper_result.passed
    assert fine_result.scratch != sleeper_result.scratch
    assert fine_result.namespace != sleeper_result.namespace
    for r in (sleeper_result, fine_result):
        assert not Path(r.scratch).exists()
        assert r.namespace is not None and processes_in(r.namespace) == []


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
