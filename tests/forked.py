"""Processes of the self-tests forked from the torch-preloaded server (:mod:`conformance.child_process`)
instead of started as fresh interpreters: an inner pytest session (:func:`run_forked_pytest`), and
``python -c CODE`` (:func:`python_c`, for ``conformance.child_process.run_child``).

The self-tests run about a hundred small suites (``run_suite``); a fresh ``python -m pytest`` spends
most of its seconds importing torch before it collects a test. A forked session is still a process of
its own (its own modules, rank pools, exit status and output, killed at its timeout), and it is given
what a fresh ``python -m pytest`` in the test's directory would have: the test's environment, working
directory, ``sys.path`` (that directory, then ``PYTHONPATH``), ``sys.argv``, and stdout and stderr in
files of their own. What it cannot be given is a torch imported under its environment: an inner
session whose check depends on an environment variable torch reads at import must run in a fresh
interpreter (``pytester.runpytest_subprocess``).
"""

from __future__ import annotations

import multiprocessing.forkserver  # noqa: F401  (see below)
import multiprocessing.popen_forkserver  # noqa: F401
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

# multiprocessing.forkserver is imported above, before any test, on purpose: ``pytester`` removes the
# modules a test imported when the test ends, and that module holds the client of the running server.
# Imported first inside a test, the next test would import it afresh and start another server (a fresh
# interpreter importing torch, seconds of CPU, for every test that runs an inner session), and the old
# one would live on until this session ends.

__all__ = ["python_c", "run_forked_pytest"]


def _session(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked process: become a fresh ``python -m pytest ARGV`` run in ``cwd``, then run it."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # `python -m pytest` puts its working directory first, then PYTHONPATH, then the interpreter's own.
    front = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = front + [p for p in sys.path if p not in front and p not in ("", ".")]
    sys.argv = [str(Path(pytest.__file__).parent), *argv]
    status = pytest.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(int(status))


def python_c(argv: list[str]) -> int:
    """``python -c argv[0]`` as the main function of a forked child: run the code in a fresh ``__main__``
    namespace; an exception's traceback goes to stderr and the status is 1. Nothing of the code's own
    imports is in the server, so what a module reads from the environment at import, it reads from
    the child's."""
    import traceback

    try:
        exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def run_forked_pytest(pytester: pytest.Pytester, args: Sequence[str], *, timeout: float,
                      env: Mapping[str, str] | None = None) -> pytest.RunResult:
    """``pytester.runpytest_subprocess(*args, timeout=timeout)``, forked: the same arguments (a fresh
    ``--basetemp`` under the pytester directory first), working directory, environment (``PYTHONPATH``
    led by that directory) and result, and :class:`pytest.Pytester.TimeoutExpired` after killing it."""
    # Imported here, not at the top: the forked process imports this module to find _session, and a
    # conformance module imported before its pytest starts could not be assertion-rewritten there.
    from conformance.child_process import process_context

    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    argv = [f"--basetemp={basetemp}", *(str(a) for a in args)]
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), environment.get("PYTHONPATH", "")]))
    out, err = pytester.path / "stdout", pytester.path / "stderr"
    started = time.monotonic()
    process = process_context().Process(target=_session, args=(argv, environment, os.getcwd(), str(out), str(err)),
                                         name="inner pytest session", daemon=False)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: pytest {' '.join(argv)}")
    outlines = out.read_text(encoding="utf8", errors="replace").splitlines()
    errlines = err.read_text(encoding="utf8", errors="replace").splitlines()
    # As pytester does: the inner output goes into this test's captured output, shown when it fails.
    print("\n".join(outlines))
    print("\n".join(errlines), file=sys.stderr)
    return pytest.RunResult(int(process.exitcode), outlines, errlines, time.monotonic() - started)
