"""Self-tests of the rank harness: each proves one HX promise by running a small suite in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conformance.child_process import run_child
from conformance.harness.axes import DistSpec, below_the_largest_world_size
from conformance.harness.config import SETTINGS, HarnessConfig
from conformance.harness.shards import COSTS_FILE, CostTable, deal, deal_together, load_costs
from tests.conftest import REPO_ROOT, run_suite
from tests.forked import python_c

FAULTS = '''
import os, signal, time
import pytest
import torch
import torch.distributed as c10d


def test_sum(dist):
    t = torch.tensor([float(dist.rank + 1)])
    c10d.all_reduce(t)
    assert t.item() == dist.world_size * (dist.world_size + 1) / 2


def test_one_rank_fails(dist):
    print(f"output of rank {dist.rank}")
    assert dist.rank != 1, "rank one disagrees"


def test_assertion_shows_values(dist):
    expected = [dist.rank, 1]
    assert [dist.rank, 2] == expected


def test_hang(dist):
    if dist.rank == 1:
        time.sleep(600)
    dist.barrier()


def test_after_hang(dist):
    dist.barrier()


def test_exit(dist):
    if dist.rank == 1:
        os._exit(7)
    dist.barrier()


def test_after_exit(dist):
    dist.barrier()


def test_signal(dist):
    if dist.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_after_signal(dist):
    dist.barrier()
'''


@pytest.mark.req("HX-1", "HX-3", "HX-5", "HX-6")
def test_failures_hangs_and_crashes_are_reported_and_contained(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_faults=FAULTS)
    start = time.monotonic()
    result = run_suite(suite, "--world-size", "2", "--rank-timeout", "8")
    elapsed = time.monotonic() - start
    out = result.stdout.str()
    result.assert_outcomes(passed=4, failed=5)
    for name in ("test_sum", "test_after_hang", "test_after_exit", "test_after_signal"):
        assert f"test_{name.removeprefix('test_')}[ws2] PASSED" in out, out
    # HX-3: the failing rank's traceback and every rank's output, labelled by rank.
    assert "rank 0: passed" in out and "rank 1: FAILED" in out
    assert "---------- rank 1 traceback ----------" in out and "rank one disagrees" in out
    # Assertions are rewritten on the ranks as on the controller: a failure shows the values.
    assert "assert [0, 2] == [0, 1]" in out and "assert [1, 2] == [1, 1]" in out
    assert "output of rank 0" in out and "output of rank 1" in out
    # HX-5: the hung rank is named, its stack shows where it is, and the run went on.
    assert "rank 1: HUNG" in out and "in test_hang" in out
    assert "the pool was killed and is restarted" in out
    # HX-6: exit codes and signals are reported.
    assert "rank 1: DIED (exit code 7)" in out
    assert "rank 0: DIED (signal 9)" in out
    assert elapsed < 150, f"a hang must be cut by --rank-timeout; the run took {elapsed:.0f}s"


RANK_TIMEOUT = '''
import time
import pytest


def _wait_on_rank_1(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    ctx.barrier()


def test_warm_up(dist):  # starts the pool, so the next test's duration is the hang alone
    dist.barrier()


@pytest.mark.rank_timeout(2)
def test_short_limit(dist):
    _wait_on_rank_1(dist)


@pytest.mark.rank_timeout(2)
def test_short_limit_in_pools(pools):
    pools.run(2, _wait_on_rank_1)


@pytest.mark.rank_timeout(300)
def test_marker_cannot_raise_the_limit(dist):
    _wait_on_rank_1(dist)


def test_after(dist):
    dist.barrier()
'''


@pytest.mark.req("HX-14")
def test_rank_timeout_marker_cuts_a_test_early(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_limits=RANK_TIMEOUT)
    # The limits are short (the session's 12 s, the markers' 2 s): what is checked is which limit cuts
    # which test, and 10 s between them leaves room for a pool restart on a loaded machine.
    result = run_suite(suite, "--world-size", "2", "--rank-timeout", "12", "--durations=0", "--durations-min=0")
    out = result.stdout.str()
    result.assert_outcomes(passed=2, failed=3)
    # Counted in the failure sections only: the short summary repeats the message, whole where pytest
    # sees a CI environment and cut to the terminal width elsewhere.
    failures = out.split("short test summary info")[0]
    assert failures.count("rank 1: HUNG (no answer within 2s") == 2, out
    assert "rank 1: HUNG (no answer within 12s" in out, out  # the marker lowers the limit, never raises it
    assert "test_after[ws2] PASSED" in out
    # A marked hang is cut well before the session's 12 s limit. The pool restart after a hang falls in
    # the next test, so the second marked test is compared with the unmarked one, which pays it too.
    durations = {m.group(2): float(m.group(1)) for m in re.finditer(r"^([\d.]+)s call\s+\S+::(\S+)$", out, re.M)}
    assert durations["test_short_limit[ws2]"] < 8, durations
    unmarked = durations["test_marker_cannot_raise_the_limit[ws2]"]
    assert unmarked >= 11 and durations["test_short_limit_in_pools"] < unmarked - 6, durations


@pytest.mark.req("HX-14")
def test_rank_timeout_marker_needs_one_positive_number(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_bad='import pytest\n\n@pytest.mark.rank_timeout("soon")\ndef test_x(dist):\n    pass\n')
    result = run_suite(suite, "--world-size", "1")
    assert "rank_timeout takes one positive number of seconds" in result.stdout.str() + result.stderr.str()
    assert result.ret != 0


SKIPS = '''
import pytest


def test_same_reason(dist):
    pytest.skip("not on this build")


def test_different_reasons(dist):
    pytest.skip(f"rank {dist.rank} has no GPU")


def test_some_ranks_skip(dist):
    if dist.rank == 1:
        pytest.skip("only rank one skips")


@pytest.mark.world_size(4)
def test_needs_four(dist):
    pass


def test_pairs(world_size_pair):
    assert world_size_pair[0] != world_size_pair[1]
'''


@pytest.mark.req("HX-4", "HX-8")
def test_skips_propagate_and_disagreement_is_reported(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_skips=SKIPS)
    result = run_suite(suite, "--world-size", "1,2")
    out = result.stdout.str()
    assert "SKIPPED" in out and "not on this build" in out
    assert "ranks gave different reasons: rank 0: rank 0 has no GPU; rank 1: rank 1 has no GPU" in out
    assert "ranks disagree" in out and "rank 1: skipped: only rank one skips" in out
    assert "needs world size in [4]; selected --world-size 1,2" in out
    assert "test_pairs[ws1-ws2] PASSED" in out and "test_pairs[ws2-ws1] PASSED" in out
    # ws1 runs the "some ranks skip" test on rank 0 only, which passes.
    result.assert_outcomes(passed=3, skipped=5, failed=1)


ON_ONE_RANK = '''
import pytest


def test_value(dist):
    assert dist.on_one_rank(lambda: f"made on rank {dist.rank}", src=1) == "made on rank 1"


def test_skip(dist):
    dist.on_one_rank(lambda: pytest.skip("the file is not what this case damages"))


def test_error(dist):
    dist.on_one_rank(lambda: 1 / 0)


def test_suite_failure(dist):
    dist.on_one_rank(lambda: pytest.fail("no data file holds one rank's shard alone", pytrace=False))
'''


@pytest.mark.req("HX-3", "HX-4")
def test_set_up_on_one_rank_ends_alike_on_every_rank(suite: pytest.Pytester) -> None:
    """What the set-up function of ``on_one_rank`` ends with (its value, a skip, an error, the suite's own
    ``fail()``, which is a BaseException) reaches every rank: none waits for a broadcast that never comes."""
    suite.makepyfile(test_one_rank=ON_ONE_RANK)
    result = run_suite(suite, "--world-size", "2", "--rank-timeout", "20")
    out = result.stdout.str()
    assert "HUNG" not in out, out
    assert "test set-up on rank 0 failed: ZeroDivisionError" in out, out
    assert "test set-up on rank 0 failed: no data file holds one rank's shard alone" in out, out
    assert "the file is not what this case damages" in out, out
    result.assert_outcomes(passed=1, skipped=1, failed=2)


LARGEST = '''
import pytest


@pytest.mark.parametrize("case", ["every", pytest.param("costly", marks=pytest.mark.largest_world_size)])
def test_grid(dist, case):
    pass


@pytest.mark.largest_world_size
def test_marked(dist):
    pass
'''


@pytest.mark.req("HX-8")
def test_a_case_marked_largest_world_size_runs_at_the_largest_selected_only(suite: pytest.Pytester) -> None:
    # End to end through the plugin; which sizes run in other runs: the unit test below.
    suite.makepyfile(test_largest=LARGEST)
    report = suite.path / "out.json"
    result = run_suite(suite, "--world-size", "1,2", "--report-json", str(report), "-k", "costly or marked")
    tests = json.loads(report.read_text())["tests"]
    skipped = {"test_grid[ws1-costly]", "test_marked[ws1]"}
    assert {t.split("::")[-1] for t, v in tests.items() if v["outcome"] == "skipped"} == skipped, result.stdout.str()[-2000:]
    for test in skipped:
        assert "runs at the largest world size this run can run (2)" in tests[f"test_largest.py::{test}"]["reason"]
    assert {v["outcome"] for t, v in tests.items() if t.split("::")[-1] not in skipped} == {"passed"}


def _marked_case(world_size: int, settings: HarnessConfig) -> Any:
    """What the plugin sees of a case marked ``largest_world_size`` at ``world_size`` in a run of ``settings``."""
    config = SimpleNamespace(stash={SETTINGS: settings})
    marker = pytest.mark.largest_world_size.mark
    return SimpleNamespace(config=config, callspec=SimpleNamespace(params={"dist": DistSpec(world_size, settings.backend_for(world_size))}),
                           get_closest_marker=lambda name: marker if name == marker.name else None)


@pytest.mark.req("HX-8")
@pytest.mark.parametrize(("sizes", "backend", "gpus", "ranks", "profile", "runs_at"), [
    ((2, 3), "gloo", 0, None, "ci", {3}),  # the largest, not a fixed size
    ((1, 2), "gloo", 0, None, "thorough", {1, 2}),  # the exhaustive run: every size
    ((1,), "gloo", 0, None, "ci", {1}),  # one size: it runs there
    ((2, 4, 8), "gloo", 0, 4, "ci", {4, 8}),  # a torchrun job of 4: 8 is a skip of its own, 4 runs the case
    ((1, 2), "auto", 1, None, "ci", {2}),  # nccl at 1, gloo at 2: both run
    ((1, 2), "nccl", 1, None, "ci", {1, 2}),  # nccl at 2 has one GPU: only 1 runs (2 is a skip of its own)
], ids=["largest", "thorough", "one-size", "torchrun-job", "auto-backend", "nccl-one-gpu"])
def test_the_largest_world_size_is_the_largest_the_run_can_run(sizes: tuple[int, ...], backend: str, gpus: int, ranks: int | None,
                                                              profile: str, runs_at: set[int]) -> None:
    from hypothesis import settings as profiles

    from conformance.generated import register_profiles

    before = profiles.get_current_profile_name()
    register_profiles()  # the suite's profiles, where this run has not collected conformance/
    settings = HarnessConfig(world_sizes=sizes, backend=backend, cuda_devices=gpus, impls=("reference",), rank_timeout_s=60.0,
                             rerun_crashes=frozenset(), run_known_hangs=False, launcher="pool", shared_tmp=None, ranks=ranks)
    profiles.load_profile(profile)
    try:
        runs = {size for size in sizes if below_the_largest_world_size(_marked_case(size, settings)) is None}
    finally:
        profiles.load_profile(before)
    assert runs == runs_at


@pytest.mark.req("HX-8")
def test_nccl_without_gpus_is_a_skip_that_says_so(suite: pytest.Pytester) -> None:
    import torch

    found = torch.cuda.device_count()
    if found >= 2:
        pytest.skip(f"this machine has {found} GPUs: nccl at world size 2 runs for real")
    suite.makepyfile(test_nccl="def test_body(dist):\n    pass\n")
    result = run_suite(suite, "--world-size", "2", "--backend", "nccl")
    result.assert_outcomes(skipped=1)
    assert f"nccl at world size 2 needs 2 CUDA devices; found {found}" in result.stdout.str()


ADAPTER = '''
from conformance.adapters.base import Adapter, Unsupported


class PartialAdapter(Adapter):
    name = "partial"

    def state_dict(self):
        return object()

    def checkpoint(self):
        raise Unsupported("this fork has no DCP")
'''

CAPABILITY_TESTS = '''
import pytest


@pytest.mark.req("HX-9")
def test_uses_state_dict(impl):
    assert impl.name == "partial"
    impl.require("state_dict")


@pytest.mark.req("HX-9")
def test_uses_checkpoint(impl):
    impl.require("checkpoint")


def test_fails_for_xfail(impl):
    assert False, "known deviation"


def test_passes(impl):
    pass
'''


@pytest.mark.req("HX-9", "HX-10")
def test_capability_skips_and_xfails_files(suite: pytest.Pytester) -> None:
    suite.makepyfile(partial_adapter=ADAPTER, test_caps=CAPABILITY_TESTS)
    xfails = suite.path / "xfails.txt"
    xfails.write_text(
        "# known deviations\n"
        "test_caps.py::test_fails_for_xfail  # the fork returns the wrong keys\n"
        "test_caps.py::test_renamed_long_ago  # stale entry\n"
    )
    result = run_suite(suite, "--impl", "partial_adapter:PartialAdapter", "--xfails", str(xfails), "-W", "default")
    out = result.stdout.str()
    result.assert_outcomes(passed=2, skipped=1, xfailed=1)
    assert "partial does not provide checkpoint: this fork has no DCP" in out
    assert "the fork returns the wrong keys" in out
    assert "StaleXfailWarning" in out and "test_renamed_long_ago" in out


KNOWN_HANG = '''
import time


def test_rank_1_never_arrives(dist):
    if dist.rank == 1:
        time.sleep(600)
    dist.barrier()


def test_after(dist):
    dist.barrier()
'''


@pytest.mark.req("HX-15")
@pytest.mark.parametrize("run_hangs", [False, True], ids=["default", "run-known-hangs"])
def test_an_entry_flagged_hangs_is_not_run(suite: pytest.Pytester, run_hangs: bool) -> None:
    """A ``hangs`` entry is an expected failure that is not run (so it costs no timeout), unless
    ``--run-known-hangs`` asks for it: then it runs, is cut at the rank timeout, and is still expected."""
    suite.makepyfile(test_hang=KNOWN_HANG)
    xfails = suite.path / "xfails.txt"
    xfails.write_text("test_hang.py::test_rank_1_never_arrives  hangs  # rank 1 never reaches the barrier\n")
    extra = ["--run-known-hangs"] if run_hangs else []
    result = run_suite(
        suite, "--world-size", "2", "--rank-timeout", "3", "--xfails", str(xfails), "-rx", "--durations=0",
        "--durations-min=0", *extra,
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, xfailed=1)
    assert "rank 1 never reaches the barrier" in out
    assert ("[NOTRUN]" in out) is not run_hangs, out
    ran = re.search(r"^([\d.]+)s call\s+test_hang.py::test_rank_1_never_arrives", out, re.M)
    assert (ran is not None) is run_hangs, out
    assert ran is None or float(ran.group(1)) >= 3, out  # it ran until the timeout cut it


@pytest.mark.req("HX-15")
def test_a_malformed_xfails_file_is_a_usage_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_x="def test_x(dist):\n    pass\n")
    xfails = suite.path / "xfails.txt"
    xfails.write_text("test_x.py::test_x  hang  # typo\n")
    result = run_suite(suite, "--world-size", "1", "--xfails", str(xfails))
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    assert f"{xfails}:1: unknown flag 'hang'" in out and "INTERNALERROR" not in out, out


@pytest.mark.req("HX-8")
def test_unknown_impl_is_a_usage_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_x="def test_x(impl):\n    pass\n")
    result = run_suite(suite, "--impl", "no-such-impl")
    assert result.ret != 0
    assert "unknown implementation 'no-such-impl'" in result.stderr.str() + result.stdout.str()


PIDS = '''
import os, time


def test_record(dist, tmp_path_factory):
    path = os.environ["SDC_PID_FILE"]
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\\n")
    dist.barrier()
    if os.environ.get("SDC_BLOCK"):
        time.sleep(600)


def test_fails_for_x(dist):
    assert False


def test_never_reached(dist):
    pass
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # reaped between the signal and the read
        return False
    return "State:\tZ" not in status


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.req("HX-7")
def test_no_rank_outlives_the_run_after_x(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = suite.path / "pids.txt"
    monkeypatch.setenv("SDC_PID_FILE", str(pid_file))
    suite.makepyfile(test_pids=PIDS)
    result = run_suite(suite, "--world-size", "2", "-x")
    result.assert_outcomes(passed=1, failed=1)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    assert _wait_gone(pids, 10) == []


@pytest.mark.req("HX-7")
def test_no_rank_outlives_a_killed_controller(suite: pytest.Pytester, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.txt"
    suite.makepyfile(test_pids=PIDS)
    env = dict(os.environ, SDC_PID_FILE=str(pid_file), SDC_BLOCK="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    controller = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conformance.harness.plugin", "-p", "no:cacheprovider",
         "--world-size", "2", "test_pids.py"],
        cwd=suite.path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (pid_file.exists() and len(pid_file.read_text().split()) == 2):
            time.sleep(0.2)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=10)
        assert _wait_gone(pids, 10) == [], "rank processes survived their controller"
    finally:
        if controller.poll() is None:
            controller.kill()


REUSE = '''
import os
import torch


def bump(dist, t):
    if dist.rank == 0:
        t.add_(100)
    dist.barrier()
    return float(t.sum())


def test_tensor_arguments_are_copies_per_rank(pools):
    # Rank 0's in-place update must not show on rank 1: each rank has its own copy, as on separate hosts.
    assert pools.run(2, bump, torch.zeros(3)) == [300.0, 0.0]


def test_a(dist):
    with open(os.environ["SDC_PID_FILE"], "a") as f:
        f.write(f"a {dist.rank} {os.getpid()}\\n")


def test_b(dist):
    with open(os.environ["SDC_PID_FILE"], "a") as f:
        f.write(f"b {dist.rank} {os.getpid()}\\n")
'''


@pytest.mark.req("HX-2")
def test_pools_are_reused_across_tests(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = suite.path / "pids.txt"
    monkeypatch.setenv("SDC_PID_FILE", str(pid_file))
    suite.makepyfile(test_reuse=REUSE)
    result = run_suite(suite, "--world-size", "2", "--report-json", "out.json")
    result.assert_outcomes(passed=3)
    seen: dict[str, dict[str, str]] = {}
    for line in pid_file.read_text().splitlines():
        test, rank, pid = line.split()
        seen.setdefault(test, {})[rank] = pid
    assert seen["a"] == seen["b"], "the second test must run on the same rank processes"
    payload = json.loads((suite.path / "out.json").read_text())
    assert {v["outcome"] for v in payload["tests"].values()} == {"passed"}


THREADS = '''
import os
import torch

from conformance.child_process import run_child
from conformance.harness.axes import DistSpec, below_the_largest_world_size
from conformance.harness.config import SETTINGS, HarnessConfig


def test_rank(dist):
    assert (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()) == ("1", 1)


def report_threads(argv):
    print("threads", os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
    return 0


def test_child():
    status, output = run_child(report_threads, [], timeout=60)
    assert status == 0 and "threads 1 1" in output, output
'''


@pytest.mark.req("HX-2")
def test_ranks_and_children_run_one_intra_op_thread_unless_the_environment_says(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    suite.makepyfile(test_threads=THREADS)
    run_suite(suite, "--world-size", "1,2").assert_outcomes(passed=3)


@pytest.mark.req("HX-2")
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_child_runs_the_intra_op_threads_its_environment_sets(threads: str) -> None:
    # The server imported torch under its own environment: the child's threads come from the child's.
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    code = "import os, torch; print('threads', os.environ['OMP_NUM_THREADS'], torch.get_num_threads())"
    status, output = run_child(python_c, [code], env=env, timeout=60, description="the thread probe")
    assert status == 0 and f"threads {threads} {threads}" in output, output


CRASH_ADAPTERS = '''
from conformance.adapters.base import Adapter


class UpstreamAdapter(Adapter):
    name = "upstream"


class ForkAdapter(UpstreamAdapter):
    name = "fork"
'''

CRASHES = '''
import os
import signal
from pathlib import Path


def _attempt(dist, name, crash_on, barrier=True):
    """Count this run of test ``name`` (each rank appends a line to its log); rank 0 dies of
    ``SIGSEGV`` on the runs numbered in ``crash_on``."""
    log = Path(__file__).parent / f"attempts-{name}-{dist.rank}"
    with log.open("a") as f:
        f.write("run\\n")
    run = len(log.read_text().splitlines())
    if dist.rank == 0 and run in crash_on:
        os.kill(os.getpid(), signal.SIGSEGV)
    if barrier:
        dist.barrier()


def test_crashes_once(dist, impl):
    _attempt(dist, f"once-{impl.name}", crash_on=(1,))


def test_crashes_always(dist, impl):
    _attempt(dist, f"always-{impl.name}", crash_on=(1, 2, 3))


def _abort_once(dist, name, message):
    """Rank 0 writes ``message`` to its stderr, as glibc does, and aborts, on the first run only."""
    log = Path(__file__).parent / f"attempts-{name}-{dist.rank}"
    with log.open("a") as f:
        f.write("run\\n")
    if dist.rank == 0 and len(log.read_text().splitlines()) == 1:
        os.write(2, message.encode())
        os.abort()
    dist.barrier()


def test_heap_abort_once(dist, impl):
    _abort_once(dist, f"heap-{impl.name}", "malloc(): unaligned tcache chunk detected\\n")


def test_plain_abort_once(dist, impl):
    _abort_once(dist, f"abort-{impl.name}", "terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n")


def test_killed(dist, impl):
    if dist.rank == 0:
        _attempt(dist, f"killed-{impl.name}", crash_on=())
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_pinned_crash(dist, impl):
    _attempt(dist, f"pinned-{impl.name}", crash_on=(1, 2, 3), barrier=False)  # rank 1 passes


def test_after(dist, impl):
    dist.barrier()
'''


def _runs(suite: pytest.Pytester, name: str) -> int:
    """How many times rank 1 ran the crash test ``name`` (rank 1 never dies in them)."""
    log = suite.path / f"attempts-{name}-1"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.req("HX-33")
def test_rerun_crashes_reruns_a_segfault_of_the_named_adapter_once_and_reports_it(suite: pytest.Pytester) -> None:
    """``--rerun-crashes upstream``: a segfault in a test of ``upstream``, or glibc's abort on a corrupt
    heap, runs the test once more on a fresh pool, whose outcome counts; the crash is listed in the
    summary and the JSON report. A crash on the second run too fails with both runs; SIGKILL, any other
    abort, a crash its known deviation pins, and every test of an adapter derived from ``upstream``
    are not rerun."""
    suite.makepyfile(crash_adapters=CRASH_ADAPTERS, test_crashes=CRASHES)
    xfails = suite.path / "xfails.txt"
    xfails.write_text("test_crashes.py::test_pinned_crash  raises=DIED ranks=0  # dies of SIGSEGV\n")
    result = run_suite(
        suite, "--world-size", "2", "--impl", "crash_adapters:UpstreamAdapter,crash_adapters:ForkAdapter",
        "--rerun-crashes", "upstream", "--xfails", str(xfails), "--report-json", "out.json",
    )
    out = result.stdout.str()
    # upstream: once and heap pass on their rerun; always, killed and abort fail; pinned is xfailed.
    # fork: once, always, killed, heap and abort fail on their first run; pinned is xfailed.
    # test_after passes for both.
    result.assert_outcomes(passed=4, failed=8, xfailed=2)
    assert "test_crashes_once[ws2-upstream] PASSED" in out and "test_crashes_once[ws2-fork] FAILED" in out
    assert "test_heap_abort_once[ws2-upstream] PASSED" in out and "test_plain_abort_once[ws2-upstream] FAILED" in out
    names = ("once-upstream", "always-upstream", "pinned-upstream", "once-fork", "always-fork", "heap-upstream", "abort-upstream", "heap-fork")
    runs = {name: _runs(suite, name) for name in names}
    assert runs == {"once-upstream": 2, "always-upstream": 2, "pinned-upstream": 1, "once-fork": 1, "always-fork": 1,
                    "heap-upstream": 2, "abort-upstream": 1, "heap-fork": 1}, runs
    assert len((suite.path / "attempts-killed-upstream-0").read_text().splitlines()) == 1  # SIGKILL: no rerun
    summary = out[out.index("crashes rerun (--rerun-crashes)") : out.index("short test summary info")]
    assert "test_crashes_once[ws2-upstream]: rank 0 signal 11" in summary, summary
    assert "test_crashes_always[ws2-upstream]: rank 0 signal 11" in summary, summary
    assert "test_heap_abort_once[ws2-upstream]: rank 0 signal 6" in summary and "unaligned tcache chunk" in summary, summary
    assert "Fatal Python error: Segmentation fault" in summary and "in _attempt" in summary  # the rank's stack
    assert "fork]" not in summary and "pinned" not in summary and "killed" not in summary and "plain_abort" not in summary, summary
    assert "the test was run twice (--rerun-crashes): first run" in out  # the failed rerun shows the first run
    payload = json.loads((suite.path / "out.json").read_text())
    crashed = {test_id for test_id, record in payload["tests"].items() if record.get("crashes")}
    assert crashed == {"test_crashes.py::test_crashes_once[ws2-upstream]", "test_crashes.py::test_crashes_always[ws2-upstream]",
                       "test_crashes.py::test_heap_abort_once[ws2-upstream]"}, crashed


@pytest.mark.req("HX-33")
def test_without_rerun_crashes_a_segfault_fails_its_test(suite: pytest.Pytester) -> None:
    """The default: no adapter's crash is rerun, a segfault or a heap abort."""
    suite.makepyfile(crash_adapters=CRASH_ADAPTERS, test_crashes=CRASHES)
    result = run_suite(suite, "--world-size", "2", "--impl", "crash_adapters:UpstreamAdapter", "-k", "crashes_once or heap_abort or after")
    result.assert_outcomes(passed=1, failed=2)
    assert _runs(suite, "once-upstream") == 1 and _runs(suite, "heap-upstream") == 1
    assert "crashes rerun" not in result.stdout.str()


@pytest.mark.req("HX-3")
def test_a_test_module_imported_by_another_is_rewritten_on_ranks(tmp_path: Path) -> None:
    """A rank imports the module a task names with pytest's assertion rewriting, and so every test module
    (and ``*_support`` module, which holds tests' checks) that one imports: ``from conformance.test_x import helper`` in another test file must not leave
    ``test_x``'s own asserts bare (empty messages) for the tests of ``test_x`` that run on that rank later."""
    (tmp_path / "test_importer.py").write_text("from test_imported import check\nfrom probe_support import support_check\n")
    (tmp_path / "test_imported.py").write_text("def check():\n    values = [1]\n    assert values == [2]\n")
    (tmp_path / "probe_support.py").write_text("def support_check():\n    held = (3,)\n    assert held == (4,)\n")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from conformance.harness.worker import _import_test_module\n"
        "_import_test_module('test_importer')\n"
        "imported = _import_test_module('test_imported')\n"
        "try:\n    imported.check()\nexcept AssertionError as error:\n    print(repr(str(error)))\n"
        "import probe_support\n"
        "try:\n    probe_support.support_check()\nexcept AssertionError as error:\n    print(repr(str(error)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "assert [1] == [2]" in done.stdout, done.stdout
    assert "assert (3,) == (4,)" in done.stdout, done.stdout  # a support module's checks too


SHARDED = '''
import pytest


@pytest.mark.parametrize("n", range(5))
def test_local(n):
    pass


def test_on_ranks(dist):
    dist.barrier()


@pytest.mark.parametrize("n", range(2))
def test_more_on_ranks(dist, n):
    dist.barrier()
'''


def _passed_ids(result: pytest.RunResult) -> list[str]:
    return re.findall(r"^(\S+::\S+) PASSED", result.stdout.str(), re.M)


@pytest.mark.req("HX-35")
def test_shards_run_every_test_exactly_once(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_sharded=SHARDED)
    whole = run_suite(suite, "--world-size", "1,2")
    whole.assert_outcomes(passed=11)
    every = sorted(_passed_ids(whole))
    parts = []
    for k in (1, 2, 3):
        result = run_suite(suite, "--world-size", "1,2", "--shard", f"{k}/3", "-k", "not more")
        assert result.ret == 0, result.stdout.str()
        parts.append(_passed_ids(result))
    together = sorted(test for part in parts for test in part)
    assert together == sorted(test for test in every if "test_more_on_ranks" not in test), parts
    assert all(parts), f"a part got no test: {parts}"  # dealt out, not cut in blocks of one file


@pytest.mark.req("HX-35")
@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b"])
def test_a_malformed_shard_is_a_usage_error(suite: pytest.Pytester, bad: str) -> None:
    suite.makepyfile(test_sharded=SHARDED)
    result = run_suite(suite, "--world-size", "1", f"--shard={bad}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--shard takes K/N" in result.stderr.str() + result.stdout.str()


def _loads(costs: list[float], owners: list[int], parts: int) -> list[float]:
    return [sum(c for c, owner in zip(costs, owners) if owner == part) for part in range(parts)]


@pytest.mark.req("HX-35")
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_the_deal_puts_every_test_in_one_part_the_same_way_every_time(parts: int) -> None:
    costs = [((i * 7919) % 101) / 10 for i in range(200)]
    owners = deal(costs, parts)
    assert len(owners) == len(costs) and set(owners) == set(range(parts))
    assert deal(list(costs), parts) == owners  # every part computes the same deal
    assert deal([0.5] * 11, parts) == [i % parts for i in range(11)]  # equal costs: by position


@pytest.mark.req("HX-35")
def test_the_deal_balances_what_position_dealing_does_not() -> None:
    """Parametrizations alternate cheap and costly (ws1, ws2): by position one part gets every costly one."""
    costs = [1.0, 10.0] * 50 + [30.0, 2.0, 2.0]
    by_position = _loads(costs, [i % 2 for i in range(len(costs))], 2)
    dealt = _loads(costs, deal(costs, 2), 2)
    assert sum(dealt) == sum(costs)
    assert max(dealt) - min(dealt) <= max(costs)
    assert max(dealt) < max(by_position) - 100, (dealt, by_position)


@pytest.mark.req("HX-35")
def test_tests_that_share_a_set_up_go_to_one_part_at_their_summed_cost() -> None:
    """Three tests of one module fixture (cost 4, with the fixture in its first) stay in one part; the
    rest balance around them; every test in exactly one part, the same deal every time."""
    costs = [4.0, 1.0, 1.0] + [2.0] * 6
    together = ["m", "m", "m", *range(6)]
    owners = deal_together(costs, together, 2)
    assert owners == deal_together(list(costs), list(together), 2)
    assert len({owners[0], owners[1], owners[2]}) == 1
    assert sorted(_loads(costs, owners, 2)) == [8.0, 10.0]
    assert deal_together(costs, list(range(len(costs))), 2) == deal(costs, 2)  # nothing shared: the plain deal


@pytest.mark.req("HX-35")
def test_a_run_in_parts_keeps_a_modules_fixture_to_one_part(suite: pytest.Pytester) -> None:
    """A module whose tests share a module-scoped fixture lands whole in one part of a run in parts (the
    fixture is set up once in the run), while tests without one are dealt alone."""
    suite.makepyfile(test_shared="""
import pytest

@pytest.fixture(scope="module")
def expensive():
    return object()

@pytest.mark.parametrize("i", range(6))
def test_uses(expensive, i):
    pass

@pytest.mark.parametrize("i", range(12))
def test_alone(i):
    pass
""")
    parts = []
    for k in (1, 2):
        result = run_suite(suite, "--world-size", "1", f"--shard={k}/2", "-v")
        parts.append({line.split("::")[1].split(" ")[0] for line in result.stdout.lines if "PASSED" in line and "::" in line})
    uses = {f"test_uses[{i}]" for i in range(6)}
    assert parts[0] | parts[1] == uses | {f"test_alone[{i}]" for i in range(12)} and not parts[0] & parts[1]
    assert uses <= parts[0] or uses <= parts[1], parts
    assert sorted(len(p) for p in parts) == [9, 9], parts  # the tests alone balance the parts around it


@pytest.mark.req("HX-35")
def test_a_test_the_costs_do_not_list_costs_what_its_function_usually_does() -> None:
    table = CostTable(tests={"t.py::f": {"*": 0.2, "ws2-torch": 4.0}, "t.py::g": {"": 0.0}}, default_s=0.5)
    assert table.cost("t.py::f[ws2-torch]") == 4.0  # its own measurement
    assert table.cost("t.py::f[ws2-fork]") == 0.2  # its function's usual cost
    assert table.cost("u.py::h[ws2-torch]") == 0.5  # nothing like it
    assert 0 < table.cost("t.py::g") < 0.01  # never free: every test weighs in the deal


@pytest.mark.req("HX-35")
def test_the_shipped_costs_are_keyed_by_this_suites_test_ids(tmp_path: Path) -> None:
    """A table keyed otherwise than the ids the plugin deals by would leave every cost at its default."""
    table = load_costs()
    assert table.tests, f"{COSTS_FILE} is missing or empty"
    defined = 0
    for function in table.tests:
        path, _, name = function.partition("::")
        source = REPO_ROOT / path
        defined += source.is_file() and f"def {name.rpartition('::')[2]}(" in source.read_text(encoding="utf-8")
    assert defined >= 0.9 * len(table.tests), f"{defined} of {len(table.tests)} functions of {COSTS_FILE} are in this checkout"
    assert load_costs(tmp_path / "none.json") == CostTable()  # no table: every cost equal, dealt by position
    (tmp_path / "bad.json").write_text('{"tests": []}')
    with pytest.raises(ValueError, match="bad.json"):
        load_costs(tmp_path / "bad.json")
