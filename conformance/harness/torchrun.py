"""The torchrun mode: every rank of a launched job is a pytest process (SPEC HX-27 .. HX-32).

::

    torchrun --nproc-per-node 8 -m pytest conformance/ --impl torch
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m pytest conformance/ --impl torch --report-json run.json

When :mod:`conformance.harness.launch_env` finds a launcher's environment, this plugin replaces the
pools of :mod:`conformance.harness.pool` by the job's own ranks; everything else (adapters,
capabilities, known deviations, the judgement of a rank test, ``--report-json``) is the plugin's, the
same in both modes. How a run goes, on every rank:

1. *Join.* Connect to the job's store (:class:`~conformance.harness.control.ControlStore`), say where
   this rank runs, agree on a scratch directory (``--shared-tmp``) and on what the ranks drive (nccl
   with ``cuda:LOCAL_RANK`` where every rank has its GPU, gloo otherwise; ``--backend`` as in pool
   mode). Ranks other than 0 write their output to ``<scratch>/logs/rank<N>.log``.
2. *Collect.* Every rank collects, orders the tests by world size (stably: few group changes) and the
   ranks compare a digest of the ordered ids; a difference stops every rank with a usage error naming
   the first differing id.
3. *Run, in lockstep.* A test with ``dist`` at world size ``w`` runs its body on ranks ``0 .. w-1``,
   whose default process group is made for it (:class:`~conformance.harness.control.DefaultGroup`);
   the others wait. Each member writes its :class:`~conformance.harness.worker.RankOutcome` and output
   to the store; every rank reads them all into the :class:`~conformance.harness.pool.PoolRun` the
   pool would have produced, which the plugin judges as in pool mode. Tests on the controller (and
   the controller part of ``pools`` tests) run on every rank; ``pools.run`` gives every member rank
   0's arguments, as a pool gets the controller's.
4. *Agree.* After each phase of each test the ranks compare their reports; a failure on any rank
   fails the test on every rank, with that rank's message.
5. *Report.* Rank 0 prints and writes ``--report-json`` (with the job's layout); the others wait for
   it before they exit.

A body that runs past its rank timeout (or, once another rank failed, past the pool's grace) is cut
by a watchdog thread: its Python stack is recorded as its output and it is reported HUNG, like a
pool's rank; the rank gets free (a signal ends Python code, peers destroying the group end a
collective) and the run goes on. A rank that cannot be freed, dies, is terminated by the launcher or
ends its pytest early ends the job: the test in progress fails on the ranks that are left, naming the
rank, and rank 0 (or the lowest rank left) writes the report.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pickle
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from conformance.harness.control import ControlStore, DefaultGroup, JobAborted, Peer
from conformance.harness.failures import DIED, HUNG, Failure
from conformance.harness.launch_env import LaunchEnv, detect, launcher_variables, set_active_layout
from conformance.harness.pool import FAILURE_GRACE_S, PoolManager, PoolRun, RankPool, make_task
from conformance.harness.worker import RankOutcome, Task, run_task

__all__ = [
    "Job", "TorchrunManager", "current_job", "manager_for", "job_cuda_count", "default_world_sizes", "after_unhealthy_run",
    "SESSION_FINISH",
]

#: After a cut, how long the body gets to give the thread back before the rank ends the job: its rank
#: timeout, within these bounds (a gloo collective of the default group times out 5 s after the cut).
UNSTICK_MIN_S, UNSTICK_MAX_S = 10.0, 30.0
#: How long the other ranks wait, at exit, for rank 0 to have written the report.
REPORT_WAIT_S = 60.0
#: Exit status of a rank that hung and could not be freed.
EXIT_HUNG = 124
#: The signal the watchdog sends the main thread to end a test body in Python code.
CUT_SIGNAL = signal.SIGUSR2
#: Seconds a rank may fall behind the others at the end of a test phase: this multiple of --rank-timeout,
#: at least SKEW_MIN_S (a rank that is gone is noticed at once; this bounds one that is stuck).
SKEW_FACTOR, SKEW_MIN_S = 2.0, 60.0
#: How long the collection (every rank importing the suite) may take beyond the first rank's.
COLLECT_WAIT_S = 900.0

_INDEX = pytest.StashKey[int]()
#: The plugin's ``pytest_sessionfinish`` (writes ``--report-json``), put here by the plugin at configure:
#: a job that ends early finishes the session through it (the plugin imports this module, not back).
SESSION_FINISH = pytest.StashKey[Callable[[pytest.Session, int], None]]()


class _Cut(BaseException):
    """Raised in the main thread when the watchdog cuts the test body on this rank."""


class _Terminated(BaseException):
    """Raised in a test body when the launcher terminates this rank (SIGTERM)."""


@dataclass
class Job:
    """This rank's view of the launched job, for one pytest session."""

    env: LaunchEnv
    control: ControlStore
    group: DefaultGroup
    device_type: str
    base: Path
    peers: dict[int, Peer]
    #: how many of ranks 0, 1, ... (in order) have a GPU of their own: nccl runs up to this world size
    cuda_ranks: int
    #: (job world size, ranks per node) when every node runs as many ranks; None otherwise
    layout: tuple[int, int] | None
    report_json: str | None
    config: pytest.Config
    terminal_fd: int
    log_path: Path | None = None
    thread_store: ControlStore | None = None
    #: manager runs and report exchanges so far (every rank counts the same ones)
    runs: int = 0
    exchanges: int = 0
    #: the test in progress (index, id, item)
    current: tuple[int, str, pytest.Item] | None = None
    #: why the job is ending, once it is
    stopping: str | None = None
    abort_info: dict[str, Any] = field(default_factory=dict)
    reporter: int = 0
    in_body: bool = False
    cut_pending: bool = False
    session_finished: bool = False

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_reporter(self) -> bool:
        return self.rank == self.reporter

    def skew_s(self) -> float:
        return max(SKEW_MIN_S, SKEW_FACTOR * float(self.config.getoption("--rank-timeout")))

    def test_label(self) -> str:
        return self.current[1] if self.current is not None else "(between tests)"

    def stop(self, exc: JobAborted) -> None:
        """The job ends: remember why, and take over the report if rank 0 is among the lost ranks."""
        if self.stopping is None:
            self.stopping = f"the torchrun job is ending during {self.test_label()}: {exc.reason}"
            self.abort_info = {"test": self.current[1] if self.current else None, "reason": exc.reason, "ranks": exc.kinds}
        # The reporter passes only when it is gone for sure (its process ended here, or its heartbeat
        # stopped): a rank the launcher terminates, or one that is late, still reports.
        if self.reporter != self.rank and self.control.gone(self.reporter) is not None:
            lost = {r for r, kind in exc.kinds.items() if kind in ("died", "hung", "ended", "error")} | {self.reporter}
            alive = [r for r in range(self.world_size) if r not in lost and self.control.gone(r) is None]
            if alive and alive[0] != self.reporter:
                self.reporter = alive[0]
                if self.is_reporter:
                    self.config.option.report_json = self.report_json
                    _say(self, f"conformance: rank {self.rank} writes the report: rank(s) {sorted(lost)} are gone ({exc.reason})")


_JOB: Job | None = None


def current_job() -> Job | None:
    """The job this process is a rank of, while a pytest session runs in torchrun mode."""
    return _JOB


def job_cuda_count() -> int | None:
    """In torchrun mode, how many ranks (0, 1, ... in order) drive a GPU of their own; else None."""
    return _JOB.cuda_ranks if _JOB is not None else None


def default_world_sizes() -> str | None:
    """In torchrun mode, the job's world size (the default of ``--world-size``); else None."""
    return str(_JOB.world_size) if _JOB is not None else None


def after_unhealthy_run() -> str | None:
    """In torchrun mode, what follows a run with a hung or dead rank; None in pool mode."""
    if _JOB is None:
        return None
    return _JOB.stopping or "the hung rank(s) were freed; the process group is made anew for the next test"


def manager_for(config: pytest.Config) -> PoolManager | None:
    """The manager that runs rank bodies in torchrun mode; None in pool mode."""
    return TorchrunManager(_JOB) if _JOB is not None else None


def _say(job: Job, text: str) -> None:
    """A line on this rank's original stdout (the terminal), whatever captures fd 1 now."""
    try:
        os.write(job.terminal_fd, (text.rstrip("\n") + "\n").encode("utf-8", errors="replace"))
    except OSError:
        pass


# -- options and start-up ------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "statedict-conformance")
    group.addoption(
        "--launcher",
        default="auto",
        choices=("auto", "pool", "env"),
        help="auto: the ranks of a torchrun/srun job when its environment is set (RANK, WORLD_SIZE, ...), else rank pools; "
        "pool: always rank pools; env: the launcher's ranks, an error without its environment",
    )
    group.addoption(
        "--shared-tmp",
        default=None,
        help="torchrun mode: a directory every node sees (e.g. on Lustre/NFS) for the tests' checkpoints and the ranks' logs "
        "(default: the system temporary directory, enough on one node)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _JOB
    choice = config.getoption("--launcher")
    if choice == "pool":
        return
    try:
        env = detect(os.environ)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if env is None:
        if choice == "env":
            raise pytest.UsageError("--launcher env: no launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return
    _JOB = _join(config, env)
    # Read once: from now on this process runs tests as pool mode's controller and ranks would, and the
    # processes its tests start (a save killed on purpose, a second job) are not ranks of this job.
    for name in launcher_variables(os.environ, env):
        del os.environ[name]
    config.pluginmanager.register(_Agreement(), "conformance-torchrun-agreement")


def _join(config: pytest.Config, env: LaunchEnv) -> Job:
    import torch

    control = ControlStore(env)
    control.start_heartbeat()
    if env.rank == 0:
        root = Path(config.getoption("--shared-tmp") or tempfile.gettempdir()).resolve()
        base = root / f"sdc-torchrun-{_safe(env.run_id)}-{env.restart_count}-{secrets.token_hex(3)}"
        base.mkdir(parents=True)
        control.put("seed", secrets.randbits(32))
        control.put("base", str(base))
    control.wait_keys({0: ["base"]}, deadline=time.monotonic() + 300.0, what="waiting for rank 0's scratch directory", check_liveness=False)
    base = Path(control.take("base"))
    _same_draws(config, control.take("seed"))
    sees_base = base.is_dir()
    (base / "logs").mkdir(parents=True, exist_ok=True)
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > env.local_rank
    me = Peer(env.rank, socket.gethostname(), os.getpid(), env.local_rank, env.local_world_size, has_gpu, sees_base)
    control.put(f"hello/{env.rank}", me)
    control.wait_keys(
        {r: [f"hello/{r}"] for r in range(env.world_size)},
        deadline=time.monotonic() + 300.0,
        what="waiting for every rank to join",
        check_liveness=False,
    )
    peers = {r: control.take(f"hello/{r}") for r in range(env.world_size)}
    control.peers = peers
    cuda_ranks = 0
    while cuda_ranks < env.world_size and peers[cuda_ranks].has_gpu:
        cuda_ranks += 1
    per_node = {p.local_world_size for p in peers.values()}
    layout = (env.world_size, env.local_world_size) if len(per_node) == 1 and env.world_size % env.local_world_size == 0 else None
    set_active_layout(layout)
    if has_gpu:
        torch.cuda.set_device(env.local_rank)
    device_type = "cuda" if has_gpu else "cpu"
    pg_timeout_s = max(60.0, float(config.getoption("--rank-timeout")) * 2)
    terminal_fd = os.dup(1)
    job = Job(
        env=env,
        control=control,
        group=DefaultGroup(control, torch.device(device_type, env.local_rank) if has_gpu else torch.device("cpu"), pg_timeout_s),
        device_type=device_type,
        base=base,
        peers=peers,
        cuda_ranks=cuda_ranks,
        layout=layout,
        report_json=config.getoption("--report-json"),
        config=config,
        terminal_fd=terminal_fd,
    )
    job.thread_store = control.client()
    _private_dirs(config, job)
    if env.rank != 0:
        config.option.report_json = None
        job.log_path = base / "logs" / f"rank{env.rank}.log"
        _redirect_output(config, job.log_path)
        print(f"rank {env.rank} of {env.world_size} (local rank {env.local_rank}, {me.host}, pid {me.pid})", flush=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(CUT_SIGNAL, _on_cut)
    atexit.register(_at_exit, job)
    return job


def _same_draws(config: pytest.Config, seed: int) -> None:
    """Every rank draws hypothesis's random examples alike (they run the same controller code and must
    call ``pools.run`` alike): rank 0's seed unless ``--hypothesis-seed`` gives one; a forced seed also
    keeps hypothesis from replaying a per-node example database. Derandomized profiles are unaffected."""
    if hasattr(config.option, "hypothesis_seed") and config.option.hypothesis_seed is None:
        config.option.hypothesis_seed = str(seed)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:40]


def _private_dirs(config: pytest.Config, job: Job) -> None:
    """Each rank its own pytest ``basetemp`` (ranks collect and clean in parallel); ``tempfile`` under
    the shared scratch directory, so a directory rank 0 makes is one every rank can use."""
    given = config.option.basetemp
    basetemp = Path(given) / f"rank{job.rank}" if given else job.base / f"rank{job.rank}" / "pytest"
    basetemp.parent.mkdir(parents=True, exist_ok=True)
    config.option.basetemp = str(basetemp)
    shared_tmp = job.base / "tmp"
    shared_tmp.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(shared_tmp)


def _redirect_output(config: pytest.Config, log_path: Path) -> None:
    """Send fd 1 and 2 (the terminal report, C++ output) to ``log_path``. pytest's global capture keeps
    a copy of the terminal fd and restores it when it suspends; it is restarted over the log so that
    the log is what it restores."""
    capman = config.pluginmanager.getplugin("capturemanager")
    sys.stdout.flush()
    sys.stderr.flush()
    if capman is not None:
        capman.stop_global_capturing()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if capman is not None:
        capman.start_global_capturing()
        capman.suspend_global_capture()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    job = _JOB
    if job is None:
        raise SystemExit(128 + signum)
    job.control.terminated.set()
    if job.stopping is None:
        job.control.post_abort("terminated", f"was terminated by the launcher (SIGTERM) during {job.test_label()}", job.test_label())
        if job.in_body:
            raise _Terminated()


def _on_cut(signum: int, frame: FrameType | None) -> None:
    job = _JOB
    if job is not None and job.in_body and job.cut_pending:
        raise _Cut()


def pytest_report_header(config: pytest.Config) -> list[str]:
    job = _JOB
    if job is None:
        return []
    hosts = sorted({p.host for p in job.peers.values()})
    lines = [
        f"conformance: torchrun mode ({job.env.launcher}): {job.world_size} ranks, {job.env.local_world_size} on this node, "
        f"hosts {', '.join(hosts)}; {job.cuda_ranks} rank(s) with a GPU of their own",
        f"conformance: 2-D meshes (HYBRID_SHARD) at the job's world size: {_layout_text(job)}",
        f"conformance: scratch directory {job.base} (checkpoints, logs of ranks 1..{job.world_size - 1} in {job.base / 'logs'})",
    ]
    blind = sorted(r for r, p in job.peers.items() if not p.sees_base)
    if blind:
        lines.append(
            f"conformance: WARNING: rank(s) {blind} do not see rank 0's scratch directory: tests that save on some ranks and "
            "load on others need --shared-tmp on a filesystem every node mounts"
        )
    return lines


def _layout_text(job: Job) -> str:
    from conformance.harness.launch_env import hybrid_mesh_shape

    replicate, shard = hybrid_mesh_shape(job.world_size)
    return f"(replicate {replicate}, shard {shard})"


# -- collection: one order, checked on every rank ------------------------------------------------------


def _order_key(item: pytest.Item) -> tuple[int, int, str]:
    """Controller tests first, then tests with ``pools``, then rank tests by world size."""
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("dist") if callspec is not None else None
    world_size = getattr(spec, "world_size", None)
    if isinstance(world_size, int):
        return 2, world_size, str(getattr(spec, "backend", ""))
    if "pools" in getattr(item, "fixturenames", ()):
        return 1, 0, ""
    return 0, 0, ""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    job = _JOB
    if job is None:
        return
    items.sort(key=_order_key)
    for index, item in enumerate(items):
        item.stash[_INDEX] = index
    ids = [item.nodeid for item in items]
    errors = int(session.testsfailed)
    digest = hashlib.sha256(("\n".join(ids) + f"\n#errors={errors}").encode()).hexdigest()
    control = job.control
    control.put(f"collect/{job.rank}", (digest, len(ids), errors))
    control.put(f"collect/ids/{job.rank}", ids)
    try:
        control.wait_keys(
            {r: [f"collect/{r}"] for r in range(job.world_size)},
            deadline=time.monotonic() + COLLECT_WAIT_S,
            what="waiting for every rank to collect",
        )
    except JobAborted as exc:
        raise pytest.UsageError(f"torchrun mode: the ranks did not all collect: {exc.reason}") from None
    digests = {r: control.take(f"collect/{r}") for r in range(job.world_size)}
    differing = [r for r in range(job.world_size) if digests[r][0] != digests[0][0]]
    if differing:
        other = differing[0]
        ids_0, ids_other = control.take("collect/ids/0"), control.take(f"collect/ids/{other}")
        raise pytest.UsageError(_collection_difference(0, ids_0, digests[0], other, ids_other, digests[other]))


def _collection_difference(a: int, ids_a: list[str], info_a: tuple[str, int, int], b: int, ids_b: list[str], info_b: tuple[str, int, int]) -> str:
    """The usage error for two ranks that collected differently: the first test id that differs."""
    head = "torchrun mode: the ranks collected different tests (every rank must run the same ones, in the same order): "
    for position, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            return head + f"test #{position} is {x} on rank {a} but {y} on rank {b}"
    if len(ids_a) != len(ids_b):
        longer, rank, shorter = (ids_a, a, b) if len(ids_a) > len(ids_b) else (ids_b, b, a)
        common = min(len(ids_a), len(ids_b))
        return head + f"rank {rank} has {len(longer)} tests, rank {shorter} {common}; the first extra one is {longer[common]}"
    return head + f"rank {a} had {info_a[2]} collection error(s), rank {b} {info_b[2]}"


# -- running ---------------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    job = _JOB
    if job is not None:
        test_id = dict(item.user_properties).get("test_id", item.nodeid)
        job.current = (item.stash.get(_INDEX, -1), str(test_id), item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    job = _JOB
    if job is None:
        return
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("dist") if callspec is not None else None
    sizes = [getattr(spec, "world_size", None)]
    pair = callspec.params.get("world_size_pair") if callspec is not None else None
    if pair:
        sizes += list(pair)
    needed = max((s for s in sizes if isinstance(s, int)), default=0)
    if needed > job.world_size:
        _skip(f"world size {needed} needs {needed} ranks; the torchrun job has {job.world_size}")
    if not isinstance(getattr(spec, "world_size", None), int):
        # The pools' controller has no process group: code on it (a save without a group) must not
        # find the last rank test's group as the default one.
        job.group.drop()


def _skip(reason: str) -> None:
    # pytest's own (private) switch to report the skip at the test, not at this line.
    raise pytest.skip.Exception(reason, _use_item_location=True)


class TorchrunManager(PoolManager):
    """Runs a rank body on the job's ranks ``0 .. world_size-1`` and returns what every member did, as
    the :class:`PoolRun` a pool would return; every rank of the job calls :meth:`run` in the same
    order with the same world size (they run the same test) and gets the same PoolRun."""

    def __init__(self, job: Job | None) -> None:
        super().__init__()
        assert job is not None
        self.job = job

    def get(self, world_size: int, backend: str) -> RankPool:
        raise RuntimeError("torchrun mode has no rank pools: the job's ranks run the tests")

    def stop_all(self) -> None:
        """Nothing to stop: the default group is dropped when the session ends."""

    def run(
        self,
        world_size: int,
        backend: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        tmp_dir: str,
        timeout_s: float,
        seed: int = 0,
    ) -> PoolRun:
        job = self.job
        if world_size > job.world_size:
            _skip(f"world size {world_size} needs {world_size} ranks; the torchrun job has {job.world_size}")
        job.runs += 1
        k = job.runs
        start = time.monotonic()
        member = job.rank < world_size
        if job.stopping is not None:
            run = PoolRun(world_size=world_size)
            _fill_lost(job, run)
            return run
        if job.rank == 0:
            # Every member runs rank 0's task (the pool's controller is rank 0 here): one tmp_dir, one
            # set of arguments, each rank its own unpickled copy.
            task = make_task(fn, args, kwargs, tmp_dir=tmp_dir, seed=seed)
            job.control.put_bytes(f"run{k}/task", pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            make_task(fn, args, kwargs, tmp_dir=tmp_dir, seed=seed)  # the same check of fn on every rank
        if job.group.current not in (None, (world_size, backend)):
            # Every rank, member or not, leaves a group of another size: the members all make the new
            # one together (a rank left holding an old group would skip joining it).
            job.group.drop()
        run = PoolRun(world_size=world_size)
        try:
            if member:
                _member(job, k, world_size, backend, timeout_s)
            _collect(job, k, run, timeout_s, start)
        except JobAborted as exc:
            job.stop(exc)
            _fill_lost(job, run, exc)
        return run


def _fill_lost(job: Job, run: PoolRun, exc: JobAborted | None = None) -> None:
    """Complete the run of a test that the end of the job cut short: each member that did not answer
    is reported by what happened to it (died, terminated, hung); one whose fate is unknown is hung if
    it is still alive, else died."""
    kinds = exc.kinds if exc is not None else {}
    for rank in range(run.world_size):
        if rank in run.outcomes or rank in run.died or rank in run.hung:
            continue
        kind = kinds.get(rank) or ("died" if job.control.gone(rank) is not None else "hung")
        if kind == "hung":
            run.hung.append(rank)
        else:
            run.died[rank] = -int(signal.SIGTERM) if kind == "terminated" else None
        run.output.setdefault(rank, f"(no answer: {job.stopping})")
    run.hung.sort()


def _member(job: Job, k: int, world_size: int, backend: str, timeout_s: float) -> None:
    """This rank's part of run ``k``: join the group, run rank 0's task under the watchdog, post the outcome."""
    control = job.control
    deadline = time.monotonic() + job.skew_s()
    control.wait_keys({0: [f"run{k}/task"]}, deadline=deadline, what=f"waiting for rank 0's task (run {k})")
    task: Task = pickle.loads(control.take_bytes(f"run{k}/task"))
    if job.group.current != (world_size, backend):
        # Every member checks in first, so that the group's own rendezvous (C++, not interruptible)
        # only starts once every member is there.
        control.put(f"run{k}/in/{job.rank}", True)
        control.wait_keys({r: [f"run{k}/in/{r}"] for r in range(world_size)}, deadline=deadline, what=f"forming the group of world size {world_size}")
        job.group.ensure(world_size, backend, tag=f"run{k}")
    job.group.set_op_timeout(timeout_s + 5.0)
    Path(task.tmp_dir).mkdir(parents=True, exist_ok=True)
    capture_path = job.base / f"rank{job.rank}" / f"run{k}.out"
    capture_path.parent.mkdir(parents=True, exist_ok=True)
    with _Capture(capture_path) as capture:
        watch = _Watchdog(job, k, world_size, timeout_s, capture)
        outcome: RankOutcome | None = None
        job.in_body, job.cut_pending = True, False
        try:
            outcome = run_task(task, job.rank, world_size, backend, device=job.group.device)
        except (_Cut, _Terminated):
            outcome = None
        finally:
            job.in_body = False
        cut = watch.finish()
        output = capture.read()
    capture_path.unlink(missing_ok=True)
    if not cut and outcome is not None and outcome.status == "fail" and any(
        control.has(f"run{k}/hung/{r}") for r in range(world_size) if r != job.rank
    ):
        # This body failed once another member had been cut (freeing it closes the group under this
        # one): it had no answer at that rank's deadline either, and a pool would call it hung.
        control.put(f"run{k}/hung/{job.rank}", output + f"\n---------- rank {job.rank}: still running when another rank was cut ----------\n")
        cut = True
    if cut:
        job.group.drop()
        control.put(f"run{k}/back/{job.rank}", True)
        return
    if outcome is None:
        outcome = RankOutcome(rank=job.rank, status="fail", error=f"rank {job.rank} was terminated by the launcher during the test body")
    try:
        payload = pickle.dumps((outcome, output), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # the value did not pickle: say so, as a pool's rank does
        failed = RankOutcome(
            rank=job.rank,
            status="fail",
            error=f"the test body's return value could not be sent to the other ranks:\n{traceback.format_exc()}",
        )
        payload = pickle.dumps((failed, output), protocol=pickle.HIGHEST_PROTOCOL)
        outcome = failed
    control.put_bytes(f"run{k}/out/{job.rank}", payload)
    control.put(f"run{k}/st/{job.rank}", outcome.status)


def _collect(job: Job, k: int, run: PoolRun, timeout_s: float, start: float) -> None:
    """Every member's outcome of run ``k`` into ``run``, on every rank of the job (its own included)."""
    control = job.control
    world_size = run.world_size
    member = job.rank < world_size
    pending = set(range(world_size))
    # A member that hangs with the GIL held cannot post: the others call it hung once its watchdog's
    # deadline and the time it gets to come back have passed.
    hard_deadline = start + job.skew_s() + timeout_s + _unstick_s(timeout_s) + 10.0
    what = f"waiting for the outcome of {job.test_label()} at world size {world_size}"
    pause = 0.005
    while pending:
        for rank in sorted(pending):
            if control.has(f"run{k}/st/{rank}"):
                outcome, text = pickle.loads(control.take_bytes(f"run{k}/out/{rank}"))
                run.outcomes[rank], run.output[rank] = outcome, text
                pending.discard(rank)
            elif control.has(f"run{k}/hung/{rank}"):
                run.hung.append(rank)
                run.output[rank] = control.take(f"run{k}/hung/{rank}")
                pending.discard(rank)
        if run.hung and member and job.group.current is not None:
            job.group.drop()  # frees a hung member blocked on this rank in a collective
        if pending:
            control.watch(pending, deadline=hard_deadline, what=what)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
    run.hung.sort()
    if run.hung:
        control.wait_keys(
            {r: [f"run{k}/back/{r}"] for r in run.hung},
            deadline=time.monotonic() + _unstick_s(timeout_s) + 10.0,
            what=f"waiting for hung rank(s) {run.hung} to get free",
        )
    if member and (not run.healthy or any(o.status == "fail" for o in run.outcomes.values())):
        job.group.drop()  # a group that saw a failure is not reused


class _Capture:
    """fd 1 and 2 and ``sys.stdout``/``sys.stderr`` of this process into ``path`` while a body runs
    (what a pool's rank writes to its log), nested inside pytest's own capture."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self._saved: tuple[int, int] = (-1, -1)
        self._streams: tuple[Any, Any] = (None, None)

    def __enter__(self) -> _Capture:
        sys.stdout.flush()
        sys.stderr.flush()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        return self

    def write(self, text: str) -> None:
        """Append ``text`` (from any thread)."""
        os.write(self.fd, text.encode("utf-8", errors="replace"))

    def read(self) -> str:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        return self.path.read_bytes().decode("utf-8", errors="replace")

    def __exit__(self, *exc: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = self._streams
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in (*self._saved, self.fd):
            os.close(fd)


class _Watchdog:
    """Cuts this member's body of run ``k`` when it runs past ``timeout_s``, or past the pool's grace
    (:data:`~conformance.harness.pool.FAILURE_GRACE_S`) after another member failed or died, or when
    the job ends: posts ``hung`` with the body's output and Python stack, then gets the main thread
    free (:data:`CUT_SIGNAL`; nccl: the group's abort; gloo: the peers drop the group). A body that is
    not free after its rank timeout (10 to 30 s) ends the job."""

    def __init__(self, job: Job, k: int, world_size: int, timeout_s: float, capture: _Capture) -> None:
        self.job, self.k, self.world_size, self.timeout_s, self.capture = job, k, world_size, timeout_s, capture
        self._lock = threading.Lock()
        self._finished = False
        self._cut = False
        self._back = threading.Event()
        self._main = threading.main_thread().ident or 0
        self._thread = threading.Thread(target=self._loop, name=f"sdc-watchdog-run{k}", daemon=True)
        self._thread.start()

    def finish(self) -> bool:
        """Called by the main thread when the body returned: True if it had been cut."""
        with self._lock:
            self._finished = True
            cut = self._cut
        self._back.set()
        return cut

    def _loop(self) -> None:
        job = self.job
        store = job.thread_store
        assert store is not None
        start = time.monotonic()
        first_failure: float | None = None
        next_check = start
        peers = [r for r in range(self.world_size) if r != job.rank]
        reason = ""
        while not self._back.wait(0.05):
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                try:
                    if store.terminated.is_set() or store.counter("aborts") > 0:
                        reason = "the job is ending"
                        break
                    if first_failure is None and any(self._failed(store, r) for r in peers):
                        first_failure = now
                except Exception:  # the store is gone: the job is ending
                    reason = "the job's store is gone"
                    break
            limit = start + self.timeout_s if first_failure is None else min(start + self.timeout_s, first_failure + FAILURE_GRACE_S)
            if now >= limit:
                reason = f"no answer within {self.timeout_s:.0f}s" if first_failure is None or limit == start + self.timeout_s else (
                    f"still running {FAILURE_GRACE_S:.0f}s after another rank failed"
                )
                break
        else:
            return
        if not self._cut_body(store, reason):
            return
        unstick_s = _unstick_s(self.timeout_s)
        give_up = time.monotonic() + unstick_s
        while not self._back.wait(1.0):
            if time.monotonic() >= give_up:
                detail = f"hung in {job.test_label()} ({reason}) and could not be freed within {unstick_s:.0f}s"
                _give_up(job, store, detail, self.capture.path.read_bytes().decode("utf-8", errors="replace"))
            try:
                signal.pthread_kill(self._main, CUT_SIGNAL)  # again: a body may have caught the first
            except (ProcessLookupError, OSError):
                pass

    def _failed(self, store: ControlStore, rank: int) -> bool:
        if store.has(f"run{self.k}/st/{rank}") and store.take(f"run{self.k}/st/{rank}") == "fail":
            return True
        return store.gone(rank) is not None

    def _cut_body(self, store: ControlStore, reason: str) -> bool:
        job = self.job
        with self._lock:
            if self._finished:
                return False
            self._cut = True
        stack = _body_stack(sys._current_frames().get(self._main))
        self.capture.write(f"\n---------- rank {job.rank} cut: {reason}; its Python stack (most recent call last) ----------\n{stack}")
        store.put(f"run{self.k}/hung/{job.rank}", self.capture.path.read_bytes().decode("utf-8", errors="replace"))
        job.cut_pending = True
        job.group.abort()
        try:
            signal.pthread_kill(self._main, CUT_SIGNAL)
        except (ProcessLookupError, OSError):
            pass
        return True


def _unstick_s(timeout_s: float) -> float:
    return min(UNSTICK_MAX_S, max(UNSTICK_MIN_S, timeout_s))


def _body_stack(frame: FrameType | None) -> str:
    """The main thread's Python stack from the test body down (the harness frames above it left out)."""
    frames: list[tuple[FrameType, int]] = []
    while frame is not None and frame.f_code is not run_task.__code__:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    if not frames:
        return "(no Python stack)\n"
    return "".join(traceback.StackSummary.extract(reversed(frames)).format())


def _give_up(job: Job, store: ControlStore, detail: str, output: str) -> None:
    """From the watchdog: this rank cannot be freed (``detail`` says how it hung, ``output`` is what the
    body wrote and where it is stuck). End the job with a report, then this process."""
    store.post_abort("hung", detail, job.test_label())
    reason = f"rank {job.rank} {detail}"
    if job.stopping is None:
        job.stopping = f"the torchrun job is ending during {job.test_label()}: {reason}"
        job.abort_info = {"test": job.current[1] if job.current else None, "reason": reason, "ranks": {job.rank: "hung"}}
    if job.is_reporter:
        _emergency_report(job, store, reason, output)
    else:
        _wait_for_report(job, store)
    os._exit(EXIT_HUNG)


def _emergency_report(job: Job, store: ControlStore, reason: str, output: str) -> None:
    """The report of a reporting rank whose main thread is stuck: the test in progress as failed (HUNG
    on this rank), ``--report-json`` as the session would write it, a summary on the terminal."""
    config = job.config
    text = f"{reason}\n(the job ended: this rank could not be freed)\n\n---------- rank {job.rank} output ----------\n{output.rstrip()}"
    if job.current is not None:
        _, test_id, item = job.current
        failure = Failure(rank=job.rank, type=HUNG, message=reason)
        report = pytest.TestReport(
            item.nodeid,
            item.location,
            {},
            "failed",
            text,
            "call",
            user_properties=[*item.user_properties, ("failures", [failure.to_json()])],
        )
        try:
            config.hook.pytest_runtest_logreport(report=report)
        except Exception:  # the report is written below whatever a reporter plugin thinks of it
            pass
    session = getattr(job.current[2], "session", None) if job.current is not None else None
    if session is not None and SESSION_FINISH in config.stash:
        config.stash[SESSION_FINISH](session, int(pytest.ExitCode.INTERRUPTED))
        _add_launch_info(job)
    written = f"; report written to {job.report_json}" if job.report_json else ""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    counts = ", ".join(f"{len(reports)} {kind}" for kind, reports in stats.items() if kind and reports)
    failed = [getattr(r, "nodeid", "?") for r in stats.get("failed", [])]
    _say(job, f"\n{'=' * 30} the job ended: {job.test_label()} {'=' * 30}\n{text}")
    _say(job, "\n".join([f"FAILED {nodeid}" for nodeid in failed] + [f"!!!!! conformance: {job.stopping}{written} !!!!!", f"({counts})"]))
    try:
        store.put("reported", job.rank)
    except Exception:  # the store is gone: nobody is left waiting
        pass


def _wait_for_report(job: Job, store: ControlStore) -> None:
    """Wait (bounded) until the reporting rank has written the report, so the launcher does not end
    it early because this rank exited."""
    try:
        store.wait_keys({job.reporter: ["reported"]}, deadline=time.monotonic() + REPORT_WAIT_S, what="waiting for the report", check_liveness=True)
    except JobAborted:
        pass
    except Exception:  # the store is gone with the reporter: nothing to wait for
        pass


# -- agreement of every test's outcome -------------------------------------------------------------------


@dataclass(frozen=True)
class _Summary:
    """One rank's report of one phase of one test."""

    outcome: str
    xfail: bool
    text: str
    failures: tuple[tuple[Any, str, str], ...]

    @classmethod
    def of(cls, report: pytest.TestReport) -> _Summary:
        failures: list[dict[str, Any]] = list(dict(report.user_properties).get("failures") or [])  # type: ignore[call-overload]
        return cls(
            outcome=report.outcome,
            xfail=getattr(report, "wasxfail", None) is not None,
            text=report.longreprtext if report.outcome != "passed" else "",
            failures=tuple((f.get("rank"), str(f.get("type")), str(f.get("message"))) for f in failures),
        )

    def label(self) -> str:
        if self.xfail:
            return "xfailed" if self.outcome == "skipped" else "xpassed"
        return self.outcome


class _Agreement:
    """The ranks agree on every phase of every test (HX-31). Registered after the suite's plugin: its
    ``tryfirst`` wrapper is then the outermost one and sees each report as the plugin left it (pinned
    deviations judged)."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        job = _JOB
        if job is None:
            return report
        if job.stopping is None:
            try:
                summaries = _exchange(job, _Summary.of(report))
            except JobAborted as exc:
                job.stop(exc)
                if not report.failed:
                    _fail_report(report, str(job.stopping), _lost_failures(exc))
            else:
                _agree(report, summaries)
        if job.stopping is not None:
            item.session.shouldstop = job.stopping
        return report


def _lost_failures(exc: JobAborted) -> list[dict[str, Any]]:
    """One failure per rank the end of the job is about (``--report-json`` names them)."""
    return [
        Failure(rank=rank, type=HUNG if kind == "hung" else DIED, message=f"{kind}: {exc.reason}").to_json()
        for rank, kind in sorted(exc.kinds.items())
    ]


#: How many different failure texts a test's agreed report shows (the JSON has every rank's).
_MAX_SECTIONS = 4


def _exchange(job: Job, mine: _Summary) -> dict[int, _Summary]:
    """Every rank's summary of the phase that just ended (the ranks run the same phases in order)."""
    control = job.control
    job.exchanges += 1
    key = f"rep/{job.exchanges}"
    control.put(f"{key}/{job.rank}", mine)
    control.wait_keys(
        {r: [f"{key}/{r}"] for r in range(job.world_size) if r != job.rank},
        deadline=time.monotonic() + job.skew_s(),
        what=f"waiting for every rank to finish {job.test_label()}",
    )
    summaries = {r: (mine if r == job.rank else control.take(f"{key}/{r}")) for r in range(job.world_size)}
    # Every rank posted this key after reading all it needed of this rank's earlier keys.
    control.forget(keep=f"{key}/{job.rank}")
    return summaries


def _agree(report: pytest.TestReport, summaries: dict[int, _Summary]) -> None:
    """Make ``report`` what the ranks' reports say together: unchanged when they agree; else failed,
    with each failing (or disagreeing) rank's message and failures labelled by rank."""
    labels = {r: s.label() for r, s in summaries.items()}
    failing = [r for r, s in summaries.items() if s.outcome == "failed"]
    texts = {summaries[r].text for r in failing}
    if len(set(labels.values())) == 1 and len(texts) <= 1:
        return
    if failing:
        others = ", ".join(f"rank {r} {labels[r]}" for r in sorted(summaries) if r not in failing)
        head = f"failed on rank(s) {failing} of the torchrun job" + (f" ({others})" if others else "")
        by_text: dict[str, list[int]] = {}
        for r in failing:
            by_text.setdefault(summaries[r].text.rstrip(), []).append(r)
        parts = [f"---------- rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ----------\n{text}"
                 for text, ranks in list(by_text.items())[:_MAX_SECTIONS]]
        if len(by_text) > _MAX_SECTIONS:
            parts.append(f"(and {len(by_text) - _MAX_SECTIONS} more different messages: every failing rank's is in --report-json)")
    else:
        head = "the ranks of the torchrun job disagree: " + "; ".join(
            f"rank {r} {labels[r]}" + (f" ({summaries[r].text.strip().splitlines()[-1]})" if summaries[r].text.strip() else "")
            for r in sorted(summaries)
        )
        parts = []
    failures = [
        {"rank": rank if rank is not None else r, "type": type_, "message": message}
        for r in (failing or sorted(summaries))
        for rank, type_, message in summaries[r].failures
    ]
    _fail_report(report, "\n\n".join([head, *parts]), failures)


def _fail_report(report: pytest.TestReport, text: str, failures: list[dict[str, Any]]) -> None:
    report.outcome = "failed"
    report.longrepr = text
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    if failures:
        report.user_properties = [(k, v) for k, v in report.user_properties if k != "failures"] + [("failures", failures)]


# -- the end of the session ------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    job = _JOB
    if job is None:
        return
    job.session_finished = True
    if job.is_reporter:
        _add_launch_info(job)


def _add_launch_info(job: Job) -> None:
    """Add the job's layout (and why it ended early, if it did) to rank 0's ``--report-json``."""
    path = job.report_json
    if not path or not Path(path).is_file():
        return
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    payload["launch"] = {
        "launcher": job.env.launcher,
        "world_size": job.world_size,
        "local_world_size": job.env.local_world_size,
        "hosts": {str(r): p.host for r, p in sorted(job.peers.items())},
        "gpu_ranks": job.cuda_ranks,
        "reported_by": job.rank,
        "aborted": job.abort_info or None,
    }
    Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")


def pytest_internalerror(excrepr: Any, excinfo: Any) -> None:
    job = _JOB
    if job is not None:
        last = str(excrepr).strip().splitlines()[-1:] or [""]
        job.control.post_abort("error", f"failed outside a test (pytest INTERNALERROR): {last[0]}", job.test_label())


def pytest_unconfigure(config: pytest.Config) -> None:
    job = _JOB
    if job is not None and job.config is config:
        job.group.drop()
        set_active_layout(None)


def _at_exit(job: Job) -> None:
    """At exit: a rank that ends before its session finished ends the job; the reporter says it has
    written the report; the others wait for that before they exit (the launcher ends every rank once
    one has exited with a failure)."""
    global _JOB
    store = job.control
    try:
        if not job.session_finished and job.stopping is None:
            store.post_abort("ended", f"ended its pytest before the run did (after {job.test_label()})", job.test_label())
        if job.is_reporter:
            store.put("reported", job.rank)
        else:
            _wait_for_report(job, store)
    except Exception:  # the store is gone: nobody is left to tell
        pass
    store.stop_heartbeat()
    shutil.rmtree(job.base / f"rank{job.rank}", ignore_errors=True)
    if job.is_reporter:
        shutil.rmtree(job.base / "tmp", ignore_errors=True)
    _JOB = None
