"""How a rank joins a torchrun job (:func:`join_job`): the job's store, rank 0's scratch directory and
seed, every rank's :class:`~conformance.harness.torchrun.control.Peer`, the device, each rank its private pytest
directories, the output of ranks other than 0 to their log, and the handlers of SIGTERM, of the
watchdog's cut signal and of the process's exit (which ends the job when a rank ends early).
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from conformance.harness.torchrun.control import ControlStore, DefaultGroup, Peer
from conformance.harness.torchrun.job import CUT_SIGNAL, BodyCut, BodyTerminated, Job, set_current_job
from conformance.harness.torchrun.launch_env import LaunchEnv
from conformance.harness.torchrun.watchdog import wait_for_report

__all__ = ["join_job"]


def join_job(
    config: pytest.Config,
    env: LaunchEnv,
    *,
    rank_timeout_s: float,
    shared_tmp: str | None,
    write_report: Callable[[pytest.Session, int], None],
) -> Job:
    """This rank's :class:`Job`, once every rank of the job ``env`` describes has joined: the scratch
    directory (under ``shared_tmp``) and seed are rank 0's, the peers every rank's; ranks other than 0
    write to their log from now on. Installs the handlers of SIGTERM, of :data:`CUT_SIGNAL` and of the
    exit of this process. ``write_report`` writes the session's report (for a job that ends early)."""
    import torch

    control = ControlStore(env)
    control.start_heartbeat()
    if env.rank == 0:
        root = Path(shared_tmp or tempfile.gettempdir()).resolve()
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
    if has_gpu:
        torch.cuda.set_device(env.local_rank)
    device_type = "cuda" if has_gpu else "cpu"
    pg_timeout_s = max(60.0, rank_timeout_s * 2)
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
        rank_timeout_s=rank_timeout_s,
        write_report=write_report,
    )
    job.thread_store = control.client()
    _private_dirs(config, job)
    if env.rank != 0:
        config.option.report_json = None
        job.log_path = base / "logs" / f"rank{env.rank}.log"
        _redirect_output(config, job.log_path)
        print(f"rank {env.rank} of {env.world_size} (local rank {env.local_rank}, {me.host}, pid {me.pid})", flush=True)
    signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, job))
    signal.signal(CUT_SIGNAL, functools.partial(_on_cut, job))
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


def _on_sigterm(job: Job, signum: int, frame: FrameType | None) -> None:
    job.control.terminated.set()
    if job.stopping is None:
        job.control.post_abort("terminated", f"was terminated by the launcher (SIGTERM) during {job.test_label()}", job.test_label())
        if job.in_body:
            raise BodyTerminated()


def _on_cut(job: Job, signum: int, frame: FrameType | None) -> None:
    if job.in_body and job.cut_pending:
        raise BodyCut()



def _at_exit(job: Job) -> None:
    """At exit: a rank that ends before its session finished ends the job; the reporter says it has
    written the report; the others wait for that before they exit (the launcher ends every rank once
    one has exited with a failure)."""
    store = job.control
    try:
        if not job.session_finished and job.stopping is None:
            store.post_abort("ended", f"ended its pytest before the run did (after {job.test_label()})", job.test_label())
        if job.is_reporter:
            store.put("reported", job.rank)
        else:
            wait_for_report(job, store)
    except Exception:  # the store is gone: nobody is left to tell
        pass
    store.stop_heartbeat()
    shutil.rmtree(job.base / f"rank{job.rank}", ignore_errors=True)
    if job.is_reporter:
        shutil.rmtree(job.base / "tmp", ignore_errors=True)
    set_current_job(None)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if job.session is not None:
        _leave(int(job.session.exitstatus))


def _leave(status: int) -> None:
    """End this rank now with ``status``, as the pool's ranks end: without the interpreter's teardown.
    That teardown destroys c10d's C++ objects (stores, the last group's threads); one whose thread is
    still joinable then calls std::terminate, and the rank aborts after a session that passed. Its
    launcher then fails the node, and the other nodes' launchers wait out torchrun's exit barrier.
    What the teardown would still do for this rank is done here: logs flushed, children ended."""
    logging.shutdown()
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM once the job is left: exit as the signal says."""
    raise SystemExit(128 + signum)
