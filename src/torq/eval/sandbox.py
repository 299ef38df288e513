"""Running untrusted generated code (HumanEval samples) in isolation.

A model's completion is code nobody has read. Each program runs in its own process tree,
in a fresh scratch directory that is removed afterwards, with:

* **no network**: a new network namespace (only a loopback interface, down);
* **its own process tree**: a new PID namespace, killed whole when the program ends or its
  wall-clock limit passes (so a fork bomb's children die with it), and a process limit;
* **a read-only file system** but for the scratch directory: a new mount namespace in which
  every mount is remounted read-only, the scratch directory bound writable;
* **no privileges**: the program runs as ``nobody`` (uid 65534) with no capabilities, so
  root's home, other users' files and the process limit are enforced;
* **limits**: CPU seconds, address space, file size, open files, no core dumps;
* **a cleared environment**: ``PATH``, ``HOME`` and ``TMPDIR`` (the scratch directory) only,
  and Python in isolated mode (``-I``: no user site, no ``PYTHON*`` variables).

It needs root (to create the namespaces and drop to ``nobody``) and util-linux's
``unshare``, ``setpriv`` and ``prlimit``; where any is missing :func:`run_untrusted` refuses
in one line instead of running the code unprotected. The interpreter is the system's
``/usr/bin/python3`` (the project's own may live under root's home, which ``nobody`` cannot
read); HumanEval's programs need only the standard library.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torq.errors import TorqError

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
_TOOLS = ("unshare", "setpriv", "prlimit", "mount")

# Run inside the new namespaces (as root there): bind the scratch directory writable,
# remount every other mount read-only, then drop to nobody under the limits.
_INNER = r"""
set -e
S="$1"; shift
mount --bind "$S" "$S"
awk '{print $2}' /proc/self/mounts | sort -u | while read -r mp; do
  case "$mp" in
    "$S"|/proc|/proc/*|/sys|/sys/*|/dev|/dev/pts) ;;
    *) mount -o remount,bind,ro "$mp" 2>/dev/null || true ;;
  esac
done
cd "$S"
exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all \
  --no-new-privs "$@"
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # address space
    processes: int = 16
    file_bytes: int = 8 << 20
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """How a program ended: ``passed`` when it exited 0 within its limits."""

    passed: bool
    returncode: int | None
    timed_out: bool
    seconds: float
    stdout: str
    stderr: str
    # where it ran (removed before the call returned) and its PID namespace (empty of
    # processes when the call returned): for checks of this run alone, whatever other
    # sandboxes run on the machine at the same time
    scratch: str = ""
    namespace: str | None = None

    @property
    def reason(self) -> str:
        if self.passed:
            return "passed"
        if self.timed_out:
            return "timed out"
        last = self.stderr.strip().splitlines()
        if last and last[-1].startswith("unshare:"):
            # the program died by a signal (the CPU limit's SIGXCPU, the kernel's SIGKILL),
            # which unshare reports in its own words
            return "killed (a limit was reached)"
        return last[-1] if last else f"exit code {self.returncode}"


def isolation_problem() -> str | None:
    """Why untrusted code cannot be isolated here (``None``: it can)."""
    if os.name != "posix" or not Path("/proc/self/mounts").is_file():
        return "Linux namespaces are needed"
    if os.geteuid() != 0:
        return "root is needed to create the namespaces and run the code as nobody"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"util-linux's {', '.join(missing)} not found"
    if not Path(SYSTEM_PYTHON).is_file():
        return f"{SYSTEM_PYTHON} not found"
    return None


def run_untrusted(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (Python source) isolated as the module doc says; refuse (TorqError)
    where it cannot be isolated. Output is kept to its last 4 000 characters."""
    problem = isolation_problem()
    if problem is not None:
        raise TorqError(f"untrusted code is not run without isolation: {problem}")
    lim = limits or SandboxLimits()
    scratch = Path(tempfile.mkdtemp(prefix="torq-sandbox-"))
    try:
        (scratch / "program.py").write_text(program, encoding="utf-8")
        os.chown(scratch, NOBODY, NOBODY)
        os.chmod(scratch, 0o700)
        out, err = scratch / ".stdout", scratch / ".stderr"
        command = [
            "unshare", "--net", "--pid", "--fork", "--mount", "--propagation", "private",
            "--mount-proc", "--kill-child",
            "sh", "-c", _INNER, "sandbox", str(scratch),
            "prlimit", f"--cpu={lim.cpu_seconds}", f"--as={lim.memory_bytes}",
            f"--nproc={lim.processes}", f"--fsize={lim.file_bytes}",
            f"--nofile={lim.open_files}", "--core=0", "--",
            "env", "-i", "PATH=/usr/bin:/bin", f"HOME={scratch}", f"TMPDIR={scratch}",
            SYSTEM_PYTHON, "-I", "-B", "program.py",
        ]  # fmt: skip
        t0 = time.perf_counter()
        with out.open("wb") as fo, err.open("wb") as fe:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, start_new_session=True
            )
            namespace = _pid_namespace_of_child(proc.pid)
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=lim.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
                # the session holds unshare; its death kills the namespace's init, and the
                # kernel then kills every process in the namespace
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.perf_counter() - t0
        _wait_until_gone(namespace)
        return SandboxResult(
            passed=returncode == 0 and not timed_out,
            returncode=returncode,
            timed_out=timed_out,
            seconds=seconds,
            stdout=_tail(out),
            stderr=_tail(err),
            scratch=str(scratch),
            namespace=namespace,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _pid_namespace_of_child(pid: int, wait_s: float = 2.0) -> str | None:
    """The PID namespace of ``pid``'s first child (the sandbox's init), read as soon as it
    exists; ``None`` if it never appears (the sandbox failed to start)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                return os.readlink(f"/proc/{children[0]}/ns/pid")
        except OSError:
            return None  # unshare is gone already
        time.sleep(0.002)
    return None


def _wait_until_gone(namespace: str | None, wait_s: float = 10.0) -> None:
    """Wait until no process is left in the sandbox's PID namespace: the kernel kills them
    all when its init dies, but not at once (a fork bomb's thousands take a moment)."""
    if namespace is None:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not processes_in(namespace, first_only=True):
            return
        time.sleep(0.02)
    raise TorqError(f"the sandbox's processes ({namespace}) did not end")


def processes_in(namespace: str, first_only: bool = False) -> list[int]:
    """The pids of the processes in the PID namespace ``namespace`` (as
    :attr:`SandboxResult.namespace` names it); with ``first_only`` at most one."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "pid") == namespace:
                    found.append(int(entry.name))
                    if first_only:
                        break
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def _tail(path: Path, chars: int = 4000) -> str:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 4 * chars))
        return f.read().decode("utf-8", errors="replace")[-chars:]
