"""The torchrun mode: every rank of a launched job is a pytest process (SPEC HX-27 .. HX-32).

::

    torchrun --nproc-per-node 8 -m pytest conformance/ --impl torch
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m pytest conformance/ --impl torch --report-json run.json

When :mod:`conformance.harness.torchrun.launch_env` finds a launcher's environment, the plugin runs
the tests on the job's own ranks (:class:`TorchrunRunner`, made by :func:`start_runner`) in place of
the pools of :mod:`conformance.harness.pool`; everything else (adapters, capabilities, known
deviations, the judgement of a rank test, ``--report-json``) is the plugin's, the same in both modes. How a run goes, on every rank:

1. *Join.* Connect to the job's store (:class:`~conformance.harness.torchrun.control.ControlStore`), say where
   this rank runs, agree on a scratch directory (``--shared-tmp``) and on what the ranks drive (nccl
   with ``cuda:LOCAL_RANK`` where every rank has its GPU, gloo otherwise; ``--backend`` as in pool
   mode). Ranks other than 0 write their output to ``<scratch>/logs/rank<N>.log``.
2. *Collect.* Every rank collects, orders the tests by world size (stably: few group changes) and the
   ranks compare a digest of the ordered ids; a difference stops every rank with a usage error naming
   the first differing id.
3. *Run, in lockstep.* A test with ``dist`` at world size ``w`` runs its body on ranks ``0 .. w-1``,
   whose default process group is made for it (:class:`~conformance.harness.torchrun.control.DefaultGroup`);
   the others wait. Each member writes its :class:`~conformance.harness.worker.RankOutcome` and output
   to the store; every rank reads them all into the :class:`~conformance.harness.runner.RankRun` the
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

The mode's parts, each a module: this one starts the mode (:func:`launched`, :func:`start_runner`);
:mod:`~conformance.harness.torchrun.launch_env` reads the launcher's environment;
:mod:`~conformance.harness.torchrun.job` the :class:`Job` (:func:`current_job` for a test that wants its
rank); :mod:`~conformance.harness.torchrun.startup` the join (step 1) and the signal and exit handlers;
:mod:`~conformance.harness.torchrun.hooks` the pytest hooks of the mode (step 2, the test in progress,
the end); :mod:`~conformance.harness.torchrun.runner` the lockstep runs (step 3);
:mod:`~conformance.harness.torchrun.watchdog` the capture and the cut of a body, and the report of a
rank that cannot be freed; :mod:`~conformance.harness.torchrun.agreement` the agreement (step 4);
:mod:`~conformance.harness.torchrun.control` the job's store and its default process group.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import pytest

from conformance.harness.torchrun.agreement import Agreement
from conformance.harness.torchrun.hooks import JobHooks
from conformance.harness.torchrun.job import Job, current_job, set_current_job
from conformance.harness.torchrun.launch_env import LaunchEnv, detect, launcher_variables
from conformance.harness.torchrun.runner import TorchrunRunner
from conformance.harness.torchrun.startup import join_job

__all__ = ["Job", "LaunchEnv", "TorchrunRunner", "current_job", "launched", "start_runner"]


def launched(launcher: str, environ: Mapping[str, str]) -> LaunchEnv | None:
    """The launch environment this process is a rank of under ``--launcher`` (``auto``, ``pool``,
    ``env``), or None for the pools; a ValueError for a partial environment, or none under ``env``."""
    if launcher == "pool":
        return None
    env = detect(environ)
    if env is None and launcher == "env":
        raise ValueError("--launcher env: no launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    return env


def start_runner(
    config: pytest.Config,
    env: LaunchEnv,
    *,
    rank_timeout_s: float,
    shared_tmp: str | None,
    write_report: Callable[[pytest.Session, int], None],
) -> TorchrunRunner:
    """Join the job ``env`` describes (step 1) and return its runner; registers the mode's hooks.
    ``write_report`` writes the session's report, for a job that ends while a rank is stuck."""
    job = join_job(config, env, rank_timeout_s=rank_timeout_s, shared_tmp=shared_tmp, write_report=write_report)
    set_current_job(job)
    # Read once: from now on this process runs tests as pool mode's controller and ranks would, and the
    # processes its tests start (a save killed on purpose, a second job) are not ranks of this job.
    for name in launcher_variables(os.environ, env):
        del os.environ[name]
    config.pluginmanager.register(JobHooks(job), "conformance-torchrun")
    config.pluginmanager.register(Agreement(job), "conformance-torchrun-agreement")
    return TorchrunRunner(job)
