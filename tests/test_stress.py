"""tools.stress: a failure in any run is reported with the runs it failed in, and fails the loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools import stress


def test_failures_of_reads_failures_and_errors(tmp_path: Path) -> None:
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3">'
        '<testcase classname="conformance.test_checkpoint" name="test_a[ws2-reference]"/>'
        '<testcase classname="conformance.test_checkpoint" name="test_b"><failure message="rank 1 died (signal 6)">trace</failure></testcase>'
        '<testcase classname="tests.test_x" name="test_c"><error message="">setup broke\nmore</error></testcase>'
        "</testsuite></testsuites>"
    )
    assert stress.failures_of(xml) == {
        "conformance/test_checkpoint.py::test_b": "rank 1 died (signal 6)",
        "tests/test_x.py::test_c": "setup broke",
    }


def test_a_failure_in_one_run_fails_the_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A test that fails in every run: the loop reports it with the runs it failed in and its message,
    and exits 1."""
    test = tmp_path / "test_flaky_here.py"
    test.write_text("def test_fails():\n    assert False, 'boom'\n")
    # The suite registers the profile in its conftest; this lone test file brings its own.
    (tmp_path / "conftest.py").write_text("from hypothesis import settings\nsettings.register_profile('stress')\n")
    code = stress.main(["--runs", "2", "--seed", "3", "--out", str(tmp_path / "out"), "--", str(test)])
    out = capsys.readouterr().out
    assert code == 1
    assert "failed in runs [1, 2] of 2" in out and "boom" in out


def test_the_heap_checks_catch_a_write_past_a_blocks_end_at_its_free() -> None:
    """Under :func:`stress.heap_check_env` a one-byte overflow of a malloc'd block aborts the process at
    the block's ``free``, naming the corruption; with glibc's defaults (its per-thread cache on) the
    same program goes on past the ``free`` as if nothing happened, and a stress run would have called
    a corrupting test clean."""
    overflow = ("import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
                "p = libc.malloc(1000); ctypes.memset(p, 0x5a, 1001); libc.free(ctypes.c_void_p(p)); print('freed', flush=True)")
    plain = subprocess.run([sys.executable, "-c", overflow], env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))},
                           capture_output=True, text=True)
    checked = subprocess.run([sys.executable, "-c", overflow], env=stress.heap_check_env(165), capture_output=True, text=True)
    assert "freed" in plain.stdout, plain.stderr
    assert checked.returncode == -signal.SIGABRT and "freed" not in checked.stdout, (checked.returncode, checked.stdout, checked.stderr)
    assert "free(): " in checked.stderr or "corruption" in checked.stderr, checked.stderr


def test_heap_check_env_keeps_the_environments_other_tunables() -> None:
    env = stress.heap_check_env(7, {"LD_PRELOAD": "libx.so", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:glibc.malloc.arena_max=2"})
    assert env == {"LD_PRELOAD": "libx.so", "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{stress.NO_TCACHE}", "MALLOC_PERTURB_": "7", "MALLOC_CHECK_": "3"}
