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

The mode's parts, each a module: this one holds the pytest hooks (it is the plugin that
:mod:`conformance.harness.plugin` lists in ``pytest_plugins``) and the functions the plugin asks;
:mod:`~conformance.harness.torchrun_job` the :class:`Job` and the process's handle to it;
:mod:`~conformance.harness.torchrun_startup` the join (step 1) and the signal and exit handlers;
:mod:`~conformance.harness.torchrun_manager` the lockstep runs (step 3);
:mod:`~conformance.harness.torchrun_watchdog` the capture and the cut of a body, and the report of a
rank that cannot be freed; :mod:`~conformance.harness.torchrun_agreement` the agreement (step 4).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest

from conformance.harness.control import JobAborted
from conformance.harness.launch_env import detect, launcher_variables
from conformance.harness.pool import PoolManager
from conformance.harness.torchrun_agreement import Agreement
from conformance.harness.torchrun_job import SESSION_FINISH, Job, current_job, set_current_job
from conformance.harness.torchrun_manager import TorchrunManager, skip_at_test
from conformance.harness.torchrun_startup import join_job
from conformance.harness.torchrun_watchdog import add_launch_info
from conformance.rank_context import hybrid_mesh_shape

__all__ = [
    "Job", "TorchrunManager", "current_job", "manager_for", "job_cuda_count", "default_world_sizes", "after_unhealthy_run",
    "SESSION_FINISH",
]

#: How long the collection (every rank importing the suite) may take beyond the first rank's.
COLLECT_WAIT_S = 900.0

_INDEX = pytest.StashKey[int]()


def job_cuda_count() -> int | None:
    """In torchrun mode, how many ranks (0, 1, ... in order) drive a GPU of their own; else None."""
    job = current_job()
    return job.cuda_ranks if job is not None else None


def default_world_sizes() -> str | None:
    """In torchrun mode, the job's world size (the default of ``--world-size``); else None."""
    job = current_job()
    return str(job.world_size) if job is not None else None


def after_unhealthy_run() -> str | None:
    """In torchrun mode, what follows a run with a hung or dead rank; None in pool mode."""
    job = current_job()
    if job is None:
        return None
    return job.stopping or "the hung rank(s) were freed; the process group is made anew for the next test"


def manager_for(config: pytest.Config) -> PoolManager | None:
    """The manager that runs rank bodies in torchrun mode; None in pool mode."""
    job = current_job()
    return TorchrunManager(job) if job is not None else None


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
    set_current_job(join_job(config, env))
    # Read once: from now on this process runs tests as pool mode's controller and ranks would, and the
    # processes its tests start (a save killed on purpose, a second job) are not ranks of this job.
    for name in launcher_variables(os.environ, env):
        del os.environ[name]
    config.pluginmanager.register(Agreement(), "conformance-torchrun-agreement")



def pytest_report_header(config: pytest.Config) -> list[str]:
    job = current_job()
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
    replicate, shard = hybrid_mesh_shape(job.world_size, job.layout[1] if job.layout else None)
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
    job = current_job()
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
    job = current_job()
    if job is not None:
        test_id = dict(item.user_properties).get("test_id", item.nodeid)
        job.current = (item.stash.get(_INDEX, -1), str(test_id), item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    job = current_job()
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
        skip_at_test(f"world size {needed} needs {needed} ranks; the torchrun job has {job.world_size}")
    if not isinstance(getattr(spec, "world_size", None), int):
        # The pools' controller has no process group: code on it (a save without a group) must not
        # find the last rank test's group as the default one.
        job.group.drop()


# -- the end of the session ------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    job = current_job()
    if job is None:
        return
    job.session_finished = True
    if job.is_reporter:
        add_launch_info(job)



def pytest_internalerror(excrepr: Any, excinfo: Any) -> None:
    job = current_job()
    if job is not None:
        last = str(excrepr).strip().splitlines()[-1:] or [""]
        job.control.post_abort("error", f"failed outside a test (pytest INTERNALERROR): {last[0]}", job.test_label())


def pytest_unconfigure(config: pytest.Config) -> None:
    job = current_job()
    if job is not None and job.config is config:
        job.group.drop()


