"""Self-tests of the torchrun mode (HX-27 .. HX-32): the pieces on their own, then real torchrun jobs.

The jobs run on this machine as two nodes: two torchrun agents (``--nnodes 2 --nproc-per-node 2``,
c10d rendezvous, gloo), so ranks 0-1 are node 0 and ranks 2-3 node 1. They are started together,
once, by the ``jobs`` fixture (each costs its start-up, mostly importing torch on four ranks), and
each test reads its job's outcome:

``slice``
    a slice of every section of the suite at world sizes 4 and 2 (HYBRID_SHARD over the 2x2 layout,
    a save at one world size loaded at the other, known deviations of ``torch``);
``faults``
    the harness's own probes: the layout, subgroups, ``pools`` phases, then a rank that fails, one that
    hangs (freed: the run goes on) and one that dies (the job ends);
``deadlock`` (one node, two ranks)
    two ranks blocked on each other for good: the job ends with the report;
``mismatch`` (one node, two ranks)
    rank 1 collects a test rank 0 does not.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from conformance.harness.torchrun.agreement import Summary, agree
from conformance.harness.torchrun.hooks import collection_difference
from conformance.harness.torchrun.launch_env import LaunchEnv, detect, launcher_variables
from conformance.rank_context import hybrid_mesh_shape
from tests.conftest import REPO_ROOT

# -- the pieces, without a launcher ------------------------------------------------------------------

TORCHRUN_ENV = {
    "RANK": "5",
    "WORLD_SIZE": "16",
    "LOCAL_RANK": "5",
    "LOCAL_WORLD_SIZE": "8",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "nightly",
    "TORCHELASTIC_RESTART_COUNT": "1",
}


@pytest.mark.req("HX-27")
def test_the_launchers_environment_is_read() -> None:
    assert detect({}) is None
    assert detect(TORCHRUN_ENV) == LaunchEnv(
        rank=5, world_size=16, local_rank=5, local_world_size=8, master_addr="head", master_port=29500,
        use_agent_store=True, run_id="nightly", restart_count=1, launcher="torchrun",
    )
    partial = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        detect(partial)
    with pytest.raises(ValueError, match="RANK 16 is not in 0..WORLD_SIZE-1"):
        detect({**TORCHRUN_ENV, "RANK": "16"})
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        detect({**TORCHRUN_ENV, "MASTER_PORT": "x"})
    # srun: SLURM's task variables and the address the batch script exports; rank 0 hosts the store.
    srun = {"SLURM_PROCID": "11", "SLURM_NTASKS": "12", "SLURM_LOCALID": "3", "SLURM_NODEID": "2",
            "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_STEP_TASKS_PER_NODE": "4(x2),4",
            "MASTER_ADDR": "node-a", "MASTER_PORT": "29400"}
    assert detect(srun) == LaunchEnv(
        rank=11, world_size=12, local_rank=3, local_world_size=4, master_addr="node-a", master_port=29400,
        use_agent_store=False, run_id="77.0", restart_count=0, launcher="srun",
    )
    no_address = {k: v for k, v in srun.items() if not k.startswith("MASTER_")}
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        detect(no_address)
    assert detect({**no_address, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}) is None
    assert detect({**srun, "SLURM_STEP_ID": "batch"}) is None  # the batch script itself is no rank
    # What a rank's children must not inherit (they would take themselves for ranks of this job).
    launched = {**TORCHRUN_ENV, "GROUP_RANK": "0", "ROLE_NAME": "default", "TORCHELASTIC_ERROR_FILE": "/e", "PATH": "/bin"}
    torchrun_env = detect(launched)
    assert torchrun_env is not None
    assert launcher_variables(launched, torchrun_env) == sorted(
        [*TORCHRUN_ENV, "GROUP_RANK", "ROLE_NAME", "TORCHELASTIC_ERROR_FILE"]
    )
    srun_env = detect(srun)
    assert srun_env is not None
    assert launcher_variables(srun, srun_env) == ["MASTER_ADDR", "MASTER_PORT", "SLURM_LOCALID", "SLURM_PROCID"]


@pytest.mark.req("HX-30")
def test_two_d_meshes_follow_the_nodes() -> None:
    assert hybrid_mesh_shape(8, 2) == (4, 2)  # four nodes of two: replicas across nodes
    assert hybrid_mesh_shape(16, 8) == (2, 8)
    assert hybrid_mesh_shape(8, 8) == (2, 4)  # within one node: two replicas, as the pools do
    assert hybrid_mesh_shape(6, 4) == (2, 3)  # not whole nodes
    assert hybrid_mesh_shape(8, None) == (2, 4) and hybrid_mesh_shape(3, None) == (1, 3)


@pytest.mark.parametrize("backend, bound", [("nccl", True), ("gloo", False)])
def test_an_nccl_default_group_is_bound_to_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch, backend: str, bound: bool) -> None:
    """Under nccl the group is made for this rank's GPU (``device_id``), not for a device torch guesses
    at the first collective; gloo groups are not bound (a CPU job on a GPU machine included)."""
    import types

    import torch
    import torch.distributed as dist

    from conformance.harness.torchrun.control import DefaultGroup

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append(kwargs))
    control = types.SimpleNamespace(rank=1, store=dist.HashStore())
    group = DefaultGroup(control, torch.device("cuda", 1), pg_timeout_s=30)  # type: ignore[arg-type]
    group.ensure(2, backend, "t")
    assert [call.get("device_id") for call in calls] == [torch.device("cuda", 1) if bound else None]


@pytest.mark.req("HX-28")
def test_a_collection_difference_names_the_first_differing_test() -> None:
    a = ["t.py::test_a", "t.py::test_b", "t.py::test_c"]
    message = collection_difference(0, a, ("x", 3, 0), 2, ["t.py::test_a", "t.py::test_x", "t.py::test_c"], ("y", 3, 0))
    assert "test #1 is t.py::test_b on rank 0 but t.py::test_x on rank 2" in message
    message = collection_difference(0, a, ("x", 3, 0), 1, [*a, "t.py::test_d"], ("y", 4, 0))
    assert "rank 1 has 4 tests, rank 0 3; the first extra one is t.py::test_d" in message
    assert "rank 0 had 0 collection error(s), rank 1 1" in collection_difference(0, a, ("x", 3, 0), 1, a, ("y", 3, 1))


def _report(
    outcome: Literal["passed", "failed", "skipped"], text: str = "", failures: list[dict[str, Any]] | None = None, xfail: str | None = None
) -> pytest.TestReport:
    report = pytest.TestReport("t.py::test_x", ("t.py", 0, "test_x"), {}, outcome, text or None, "call",
                               user_properties=[("failures", failures)] if failures else [])
    if xfail is not None:
        report.wasxfail = xfail
    return report


@pytest.mark.req("HX-31")
def test_reports_that_differ_between_ranks_fail_everywhere() -> None:
    passed = _report("passed")
    failed = _report("failed", "E   AssertionError: rank three", [{"rank": None, "type": "AssertionError", "message": "rank three"}])
    summaries = {0: Summary.of(passed), 1: Summary.of(passed), 3: Summary.of(failed)}
    mine = _report("passed")
    agree(mine, summaries)
    assert mine.failed
    assert mine.longreprtext.startswith("failed on rank(s) [3] of the torchrun job (rank 0 passed, rank 1 passed)")
    assert "---------- rank 3 ----------\nE   AssertionError: rank three" in mine.longreprtext
    assert dict(mine.user_properties)["failures"] == [{"rank": 3, "type": "AssertionError", "message": "rank three"}]
    # Every rank xfailed alike: unchanged. One rank skipped where the others xfailed: a failure.
    xfailed = _report("skipped", "reason", xfail="known")
    same = _report("skipped", "reason", xfail="known")
    agree(same, {0: Summary.of(xfailed), 1: Summary.of(xfailed)})
    assert same.skipped and same.wasxfail == "known"
    mixed = _report("skipped", "reason", xfail="known")
    agree(mixed, {0: Summary.of(xfailed), 1: Summary.of(_report("skipped", "no GPU"))})
    assert mixed.failed and not hasattr(mixed, "wasxfail")
    assert "the ranks of the torchrun job disagree: rank 0 xfailed" in mixed.longreprtext and "rank 1 skipped (no GPU)" in mixed.longreprtext


# -- real jobs ----------------------------------------------------------------------------------------

FAULTS = '''
import os, time
import pytest
import torch
import torch.distributed as c10d
from hypothesis import HealthCheck, given, settings, strategies as st

from conformance.adapters.sharding import _mesh, hybrid_mesh_shape
from conformance.harness.torchrun import current_job


def test_launcher_variables_are_not_inherited():
    assert not {"RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} & set(os.environ)


def test_controller_disagrees():
    assert current_job().rank != 3, "rank three's controller disagrees"


def _echo(ctx, value):
    return (value, ctx.world_size, str(ctx.tmp_dir))


@settings(max_examples=5, derandomize=False, database=None, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**62))
def test_random_draws_are_alike_on_every_rank(pools, drawn):
    assert pools.run(2, _echo, drawn)[1][0] == drawn  # rank 0's draw is this rank's


def test_pools_get_rank_0s_arguments(pools):
    me = current_job().rank
    for world_size in (4, 2):
        values = pools.run(world_size, _echo, me)
        assert [v[:2] for v in values] == [(0, world_size)] * world_size, values
        assert len({v[2] for v in values}) == 1


def test_layout(dist):
    assert (c10d.get_rank(), c10d.get_world_size()) == (dist.rank, dist.world_size)
    where = dist.all_gather_object(os.getppid())  # the torchrun agent: one per node
    mesh = _mesh(dist.device, hybrid_mesh_shape(dist.world_size))
    replicas = c10d.get_process_group_ranks(mesh.get_group("replicate"))
    shards = c10d.get_process_group_ranks(mesh.get_group("shard"))
    print(f"layout ws{dist.world_size} rank {dist.rank}: where {where} replicas {replicas} shards {shards}")
    if dist.world_size == 4:
        assert dist.ranks_per_node == 2 and dist.hybrid_mesh_shape() == hybrid_mesh_shape(4) == (2, 2)
        assert len(set(where)) == 2, where
        assert len({where[r] for r in replicas}) == 2, (where, replicas)  # replicas on both nodes
        assert len({where[r] for r in shards}) == 1, (where, shards)  # shards within one node
    else:
        assert len(set(where)) == 1, where  # a subgroup of the first ranks: node 0


@pytest.mark.world_size(4)
def test_one_rank_fails(dist):
    print(f"output of rank {dist.rank}")
    assert dist.rank != 3, "rank three disagrees"


@pytest.mark.world_size(4)
def test_hang(dist):
    if dist.rank == 1:
        time.sleep(600)
    dist.barrier()


@pytest.mark.world_size(4)
def test_after_hang(dist):
    dist.barrier()


@pytest.mark.world_size(4)
def test_death(dist):
    if dist.rank == 3:
        os._exit(7)
    dist.barrier()


@pytest.mark.world_size(4)
def test_never_runs(dist):
    dist.barrier()
'''

DEADLOCK = '''
import torch
import torch.distributed as c10d


def test_first(dist):
    dist.barrier()


def test_deadlock(dist):
    c10d.recv(torch.zeros(1), src=1 - dist.rank)  # both ranks wait for the other, without a timeout


def test_never_runs(dist):
    dist.barrier()
'''

MISMATCH = '''
from conformance.harness.torchrun import current_job


def test_everywhere():
    pass


if current_job().rank == 1:
    def test_only_on_rank_1():
        pass


def test_after():
    pass
'''

#: A session that passes, then aborts in the interpreter's teardown on every rank: the module's object is
#: destroyed when its module is, as a c10d object left to the teardown is, and its destructor aborts as
#: that object's still-joinable thread did (std::terminate) on one rank of a job that had passed.
TEARDOWN = '''
import os


class _AbortsWhenDestroyed:
    def __del__(self):
        os.abort()


_LEFT_TO_THE_TEARDOWN = _AbortsWhenDestroyed()


def test_passes(dist):
    dist.barrier()
'''

#: The suite's slice: one or two tests of each section, at world sizes 4 and 2.
SLICE_FILES = ["conformance/test_flat_param.py", "conformance/test_state_dict.py", "conformance/test_optim_state.py",
               "conformance/test_checkpoint.py", "conformance/test_zoo.py"]
SLICE_K = ("(reference or test_zoo or torch and HYBRID) and (test_even_shards_match_element_walk and 3shards-tied "
           "or test_sharded_round_trip and mlp-sharded-separate or test_parity_and_optim_state_dict and HYBRID_SHARD-orig "
           "or test_reshard_model_and_optimizer_state and groups or test_zoo_models_are_equal_on_every_rank and mlp)")
#: How long one job may take here (start-up of four ranks on two shared cores included).
JOB_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables (a job is started fresh), and with
    this checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if not (k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
                   or k.startswith(("TORCHELASTIC_", "SLURM_")))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass
class Finished:
    """What a job left: each agent's exit status and output (rank 0's terminal is node 0's), the
    report rank 0 wrote, how long it took."""

    returncodes: list[int]
    outputs: list[str]
    report: dict[str, Any] | None
    seconds: float

    @property
    def out(self) -> str:
        """The terminal of rank 0 (the agent the rendezvous made node 0; the others print no session)."""
        return next((o for o in self.outputs if "test session starts" in o), self.outputs[0])

    def outcome(self, test_id: str) -> dict[str, Any]:
        assert self.report is not None, self.out
        return dict(self.report["tests"][test_id])


class Job:
    """A torchrun job of ``nnodes`` agents on this machine, started now."""

    def __init__(self, name: str, workdir: Path, pytest_args: list[str], *, nnodes: int, cwd: Path) -> None:
        self.report_path = workdir / f"{name}.json"
        port = _free_port()
        self.started = time.monotonic()
        self.logs = [workdir / f"{name}-node{n}.txt" for n in range(nnodes)]
        self.procs = []
        for node in range(nnodes):
            if nnodes == 1:
                launch = ["--standalone", "--nproc-per-node", "2"]
            else:
                launch = ["--nnodes", str(nnodes), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name, "--rdzv-conf", f"is_host={int(node == 0)}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "pytest", "-p", "conformance.harness.plugin",
                   "-p", "no:cacheprovider", "-v", "--report-json", str(self.report_path), *pytest_args]
            with open(self.logs[node], "wb") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=cwd, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.ended = self.started + JOB_TIMEOUT_S
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Wait for every agent (at most the job's time) and note when the last one ended."""
        deadline = self.started + JOB_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        else:
            self.ended = time.monotonic()

    def wait(self) -> Finished:
        self._reaper.join(timeout=max(1.0, self.started + JOB_TIMEOUT_S + 5 - time.monotonic()))
        self.kill()
        seconds = self.ended - self.started
        outputs = [log.read_text(errors="replace") for log in self.logs]
        report = json.loads(self.report_path.read_text()) if self.report_path.is_file() else None
        return Finished([p.returncode for p in self.procs], outputs, report, seconds)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


#: The job each test of this module reads.
JOB_OF_TEST = {
    "test_a_slice_of_the_suite_on_two_nodes": "slice",
    "test_different_collections_stop_every_rank": "mismatch",
    "test_failures_hangs_and_deaths_on_two_nodes": "faults",
    "test_ranks_that_cannot_be_freed_end_the_job_with_a_report": "deadlock",
    "test_a_rank_exits_with_its_sessions_status_whatever_its_teardown_would_do": "teardown",
}


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """The jobs of the selected tests of this module, started at once (they spend most of their time
    starting up)."""
    workdir = tmp_path_factory.mktemp("torchrun")
    (workdir / "test_faults.py").write_text(FAULTS)
    (workdir / "test_deadlock.py").write_text(DEADLOCK)
    (workdir / "test_mismatch.py").write_text(MISMATCH)
    (workdir / "test_teardown.py").write_text(TEARDOWN)
    wanted = {JOB_OF_TEST[item.name] for item in request.session.items if item.name in JOB_OF_TEST}
    specs = {
        "slice": ([*SLICE_FILES, "--impl", "reference,torch", "--world-size", "4,2,8", "-k", SLICE_K], 2, REPO_ROOT),
        "faults": (["test_faults.py", "--world-size", "4,2", "--rank-timeout", "10"], 2, workdir),
        "deadlock": (["test_deadlock.py", "--rank-timeout", "5"], 1, workdir),
        "mismatch": (["test_mismatch.py"], 1, workdir),
        "teardown": (["test_teardown.py"], 1, workdir),
    }
    started = {name: Job(name, workdir, args, nnodes=nnodes, cwd=cwd) for name, (args, nnodes, cwd) in specs.items() if name in wanted}
    yield started
    for job in started.values():
        job.kill()


@pytest.mark.req("HX-27", "HX-29", "HX-30", "HX-31")
def test_a_slice_of_the_suite_on_two_nodes(jobs: dict[str, Job]) -> None:
    done = jobs["slice"].wait()
    assert done.returncodes == [0, 0], done.out
    out = done.out
    assert "conformance: torchrun mode (torchrun): 4 ranks, 2 on this node" in out
    assert "backends ws2=gloo, ws4=gloo, ws8=gloo" in out
    assert "(replicate 2, shard 2)" in out
    # Only rank 0 prints: one session header on the terminals of both nodes.
    assert sum(o.count("test session starts") for o in done.outputs) == 1, done.outputs
    assert done.report is not None and done.report["launch"]["world_size"] == 4 and done.report["launch"]["reported_by"] == 0
    tests = done.report["tests"]
    # World sizes above the job's are skips that say so.
    above = {t: v for t, v in tests.items() if "ws8" in t}
    assert above and {v["outcome"] for v in above.values()} == {"skipped"}, above
    assert {v["reason"] for v in above.values()} == {"world size 8 needs 8 ranks; the torchrun job has 4"}, above
    tests = {t: v for t, v in tests.items() if t not in above}
    by_impl = {name: {t: v["outcome"] for t, v in tests.items() if v["impl"] == name} for name in ("reference", "torch")}
    assert by_impl["reference"] and set(by_impl["reference"].values()) == {"passed"}, by_impl["reference"]
    for section in ("test_flat_param", "test_state_dict", "test_optim_state", "test_checkpoint", "test_zoo"):
        assert any(section in t and v["outcome"] == "passed" for t, v in tests.items()), section
    # HYBRID_SHARD at the job's 2x2 layout and within node 0; torch's pinned deviation at (2, 1) applies as in pool mode.
    hybrid = "conformance/test_optim_state.py::test_parity_and_optim_state_dict[ws{}-{}-HYBRID_SHARD-orig]"
    assert tests[hybrid.format(4, "reference")]["outcome"] == tests[hybrid.format(2, "reference")]["outcome"] == "passed"
    assert tests[hybrid.format(4, "torch")]["outcome"] == "passed"
    assert tests[hybrid.format(2, "torch")]["outcome"] == "xfailed"
    # A save at one world size loaded at the other: pools phases over subgroups of the job.
    assert tests["conformance/test_checkpoint.py::test_reshard_model_and_optimizer_state[ws4-ws2-reference-groups]"]["outcome"] == "passed"
    assert tests["conformance/test_checkpoint.py::test_reshard_model_and_optimizer_state[ws2-ws4-reference-groups]"]["outcome"] == "passed"


@pytest.mark.req("HX-28")
def test_different_collections_stop_every_rank(jobs: dict[str, Job]) -> None:
    done = jobs["mismatch"].wait()
    assert done.returncodes == [1], done.out  # torchrun's status when a rank failed
    assert "the ranks collected different tests" in done.out
    assert "test #1 is test_mismatch.py::test_after on rank 0 but test_mismatch.py::test_only_on_rank_1 on rank 1" in done.out
    assert "exitcode  : 4" in done.out  # pytest's usage error, on the ranks
    assert done.report is not None and done.report["tests"] == {}  # nothing ran


@pytest.mark.req("HX-31")
def test_a_rank_exits_with_its_sessions_status_whatever_its_teardown_would_do(jobs: dict[str, Job]) -> None:
    """Every rank's session passed and the report is written: the job succeeds, though each rank's
    interpreter teardown would abort it (a rank that aborts there fails its node's launcher, and the
    other nodes' launchers wait out torchrun's exit barrier)."""
    done = jobs["teardown"].wait()
    assert done.returncodes == [0], done.outputs
    assert done.report is not None and [t["outcome"] for t in done.report["tests"].values()] == ["passed"], done.out


@pytest.mark.req("HX-29", "HX-30", "HX-31", "HX-32")
def test_failures_hangs_and_deaths_on_two_nodes(jobs: dict[str, Job]) -> None:
    done = jobs["faults"].wait()
    out = done.out
    assert done.returncodes[0] != 0 and done.returncodes[1] != 0, done.outputs
    assert done.report is not None, out
    assert sum(o.count("test session starts") for o in done.outputs) == 1, done.outputs

    def outcome(name: str) -> dict[str, Any]:
        return done.outcome(f"test_faults.py::{name}")

    def failures(name: str) -> list[tuple[int, str]]:
        return [(f["rank"], f["type"]) for f in outcome(name).get("failures", [])]

    # HX-29: subgroups of the job, rank 0's arguments for pools phases, world sizes above the job's skipped.
    assert outcome("test_layout[ws4]")["outcome"] == outcome("test_layout[ws2]")["outcome"] == "passed"
    assert outcome("test_pools_get_rank_0s_arguments")["outcome"] == "passed"
    assert outcome("test_random_draws_are_alike_on_every_rank")["outcome"] == "passed"
    assert outcome("test_launcher_variables_are_not_inherited")["outcome"] == "passed"
    # HX-31: a failure on one rank fails the test everywhere with that rank's message.
    assert outcome("test_controller_disagrees")["outcome"] == "failed"
    assert failures("test_controller_disagrees") == [(3, "AssertionError")]
    assert outcome("test_one_rank_fails[ws4]")["outcome"] == "failed"
    assert failures("test_one_rank_fails[ws4]") == [(3, "AssertionError")]
    assert "rank three disagrees" in out and "output of rank 2" in out and "rank 3: FAILED" in out
    # HX-32: the hung rank (and the ranks waiting for it) are cut at the rank timeout with their
    # stacks, freed, and the run goes on.
    assert outcome("test_hang[ws4]")["outcome"] == "failed"
    assert (1, "HUNG") in failures("test_hang[ws4]")
    assert "rank 1: HUNG (no answer within 10s" in out and "in test_hang" in out and "time.sleep(600)" in out
    assert "the hung rank(s) were freed; the process group is made anew for the next test" in out
    assert outcome("test_after_hang[ws4]")["outcome"] == "passed"
    # A rank of node 1 dies: the job ends; rank 0 on node 0 reports the test and the rank.
    assert outcome("test_death[ws4]")["outcome"] == "failed"
    assert (3, "DIED") in failures("test_death[ws4]")
    assert "rank 3: DIED" in out and "the torchrun job is ending during test_faults.py::test_death[ws4]" in out
    assert "test_faults.py::test_never_runs[ws4]" not in done.report["tests"]
    aborted = done.report["launch"]["aborted"]
    assert aborted["test"] == "test_faults.py::test_death[ws4]" and aborted["ranks"].get("3") == "died", aborted
    assert done.seconds < JOB_TIMEOUT_S


@pytest.mark.req("HX-27", "HX-32")
def test_ranks_that_cannot_be_freed_end_the_job_with_a_report(jobs: dict[str, Job]) -> None:
    done = jobs["deadlock"].wait()
    out = done.out
    assert "exitcode  : 124" in out, out  # the rank that gave up
    assert done.report is not None, out
    tests = done.report["tests"]
    assert tests["test_deadlock.py::test_first[ws2]"]["outcome"] == "passed"
    assert all(t.endswith("[ws2]") for t in tests), list(tests)  # --world-size: the job's
    deadlock = tests["test_deadlock.py::test_deadlock[ws2]"]
    assert deadlock["outcome"] == "failed" and deadlock["failures"][0]["type"] == "HUNG", deadlock
    assert "test_deadlock.py::test_never_runs[ws2]" not in tests
    aborted = done.report["launch"]["aborted"]
    assert aborted["test"] == "test_deadlock.py::test_deadlock[ws2]" and "hung" in aborted["ranks"].values(), aborted
    # Either rank may give up first. When rank 0 (the reporter) does, it ends the job itself ("the job
    # ended"); when the other rank does, the launcher stops rank 0, which reports the job ending. Both
    # name the test and say that a hung rank could not be freed.
    assert "could not be freed" in deadlock["reason"] or "could not be freed" in aborted["reason"], (deadlock, aborted)
    assert ("the job ended: test_deadlock.py::test_deadlock[ws2]" in out
            or "the torchrun job is ending during test_deadlock.py::test_deadlock[ws2]" in out), out
    assert "c10d.recv(torch.zeros(1)" in out
