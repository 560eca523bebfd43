"""The control plane of a launched job: one store that outlives process groups, and who is still alive.

Every rank of a torchrun (or srun) job is a pytest process. They agree on everything through one
TCPStore: torchrun's agent hosts it when ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a
client), otherwise rank 0 hosts it at ``MASTER_ADDR:MASTER_PORT``. Keys live under
``sdc/<run id>/<restart count>/``, so a restarted job never reads its predecessor's.

Waiting is always bounded and always polled from Python (a blocking ``store.wait`` would hold off
signal handlers, e.g. the launcher's SIGTERM): :meth:`ControlStore.wait_keys` returns when the keys
are there, and raises :class:`JobAborted` when a rank reported the job over (``abort/<rank>``), when a
rank it waits for is gone (its process ended on this host, or its heartbeat stopped), or at the
deadline.

:class:`DefaultGroup` keeps the default process group the size of the test that runs: tests (and the
code they test) use ``dist.group.WORLD``, so a test of world size ``w`` below the job's gets a default
group of ranks ``0 .. w-1`` of its own, and the other ranks have none.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from conformance.harness.torchrun.launch_env import LaunchEnv
from conformance.rank_context import clear_group_caches

__all__ = ["ControlStore", "JobAborted", "Peer", "DefaultGroup", "HEARTBEAT_S", "STALE_S"]

#: How often each rank proves it is alive.
HEARTBEAT_S = 1.0
#: A rank on another host whose heartbeat has not moved for this long is taken for gone.
STALE_S = 30.0
#: Polling interval of a wait: starts small (a test's outcomes usually arrive together), grows to this.
_POLL_MAX_S = 0.2


class JobAborted(Exception):
    """The job cannot go on: ``reason`` says which rank did what, ``ranks`` are the ranks concerned."""

    def __init__(self, reason: str, ranks: Iterable[int] = (), kinds: dict[int, str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ranks = sorted(set(ranks))
        #: rank -> what happened to it: "died", "terminated", "hung", "ended", "error"
        self.kinds = dict(kinds or {})


@dataclass(frozen=True)
class Peer:
    """What a rank told the others when it joined: where it runs and what it drives."""

    rank: int
    host: str
    pid: int
    local_rank: int
    local_world_size: int
    has_gpu: bool
    sees_base: bool


@dataclass
class _Beat:
    value: int = -1
    changed_at: float = field(default_factory=time.monotonic)


class ControlStore:
    """The job's store under this incarnation's prefix; values are pickled Python objects."""

    def __init__(self, env: LaunchEnv, *, connect_timeout_s: float = 300.0) -> None:
        self.env = env
        self.rank = env.rank
        self.prefix = f"sdc/{env.run_id}/{env.restart_count}/"
        self._connect_timeout_s = connect_timeout_s
        hosting = not env.use_agent_store and env.rank == 0
        self._raw = self._connect(is_master=hosting)
        self.store = dist.PrefixStore(self.prefix, self._raw)
        self.peers: dict[int, Peer] = {}
        #: keys this rank set since it last forgot them (shared with :meth:`client` copies)
        self.posted: list[str] = []
        self._beats: dict[int, _Beat] = {}
        self._beats_checked_at = 0.0
        #: set by the SIGTERM handler: the launcher is ending this rank (shared with :meth:`client` copies)
        self.terminated = threading.Event()
        self._stop_heartbeat = threading.Event()

    def _connect(self, *, is_master: bool) -> Any:
        return dist.TCPStore(
            self.env.master_addr,
            self.env.master_port,
            world_size=self.env.world_size if is_master else None,
            is_master=is_master,
            timeout=timedelta(seconds=self._connect_timeout_s),
            wait_for_workers=False,
        )

    def client(self) -> ControlStore:
        """Another connection to the same store, for a thread of its own (one connection per thread)."""
        other = object.__new__(ControlStore)
        other.__dict__.update(self.__dict__)
        other._raw = self._connect(is_master=False)
        other.store = dist.PrefixStore(self.prefix, other._raw)
        other._beats = {}
        return other

    # -- values ------------------------------------------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        self.put_bytes(key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.store.set(key, data)  # type: ignore[arg-type]  # the stub says str; c10d stores bytes as they are
        self.posted.append(key)

    def forget(self, keep: str) -> None:
        """Delete every key this rank posted but ``keep``: call it once every rank has read them (after
        a wait for a key every rank posts after its reads), so that a long run does not fill the store."""
        old, self.posted[:] = list(self.posted), [keep]
        for key in old:
            if key != keep:
                try:
                    self.store.delete_key(key)
                except Exception:  # a key that is gone already is what was wanted
                    pass

    def take_bytes(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def take(self, key: str) -> Any:
        """The value under ``key``, which must be there (see :meth:`wait_keys`)."""
        return pickle.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def counter(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    # -- liveness ------------------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        """A daemon thread bumps ``hb/<rank>`` every :data:`HEARTBEAT_S` on a connection of its own."""
        beat_store = self.client()

        def beat() -> None:
            while not self._stop_heartbeat.wait(HEARTBEAT_S):
                try:
                    beat_store.counter(f"hb/{self.rank}", 1)
                except Exception:  # the store is gone: the job is ending, waits notice it
                    return

        beat_store.counter(f"hb/{self.rank}", 1)
        threading.Thread(target=beat, name="sdc-heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        self._stop_heartbeat.set()

    def gone(self, rank: int) -> str | None:
        """Why ``rank`` is taken for gone (its process ended here, or no heartbeat for :data:`STALE_S`),
        or None while it is alive."""
        peer = self.peers.get(rank)
        if peer is not None and peer.host == socket.gethostname() and not _process_alive(peer.pid):
            return f"its process (pid {peer.pid} on {peer.host}) has ended"
        now = time.monotonic()
        beat = self._beats.setdefault(rank, _Beat())
        try:
            value = self.counter(f"hb/{rank}")
        except Exception:  # a store that stopped answering: judged by the caller's deadline
            return None
        if value != beat.value:
            beat.value, beat.changed_at = value, now
        elif now - beat.changed_at > STALE_S:
            return f"no heartbeat for {now - beat.changed_at:.0f}s"
        return None

    # -- aborts --------------------------------------------------------------------------------------

    def post_abort(self, kind: str, reason: str, test: str | None) -> None:
        """Tell every rank that this rank ends the job (``kind``: died/terminated/hung/ended/error)."""
        try:
            self.put(f"abort/{self.rank}", {"rank": self.rank, "kind": kind, "reason": reason, "test": test})
            self.counter("aborts", 1)
        except Exception:  # the store is gone too: the others notice that instead
            pass

    def aborts(self) -> dict[int, dict[str, Any]]:
        """Every abort posted so far, by rank."""
        if self.counter("aborts") == 0:
            return {}
        found = {}
        for rank in range(self.env.world_size):
            if self.has(f"abort/{rank}"):
                found[rank] = self.take(f"abort/{rank}")
        return found

    def raise_if_aborted(self) -> None:
        """Raise :class:`JobAborted` once the launcher terminated this rank or any rank posted an abort;
        the reason names every rank that is gone by then (a launcher ends the others when one died)."""
        found = {r: (a["kind"], a["reason"]) for r, a in self.aborts().items()}
        if self.terminated.is_set():
            found[self.rank] = ("terminated", "terminated by the launcher (SIGTERM)")
        if not found:
            return
        for rank in range(self.env.world_size):
            if rank not in found and rank != self.rank:
                why = self.gone(rank)
                if why is not None:
                    found[rank] = ("died", f"gone: {why}")
        order = sorted(found, key=lambda r: (found[r][0] == "terminated", r))  # the cause first
        raise JobAborted("; ".join(f"rank {r} {found[r][1]}" for r in order), found, {r: kind for r, (kind, _) in found.items()})

    # -- waiting -------------------------------------------------------------------------------------

    def watch(self, ranks: Iterable[int], *, deadline: float | None, what: str, check_liveness: bool = True) -> None:
        """One step of a wait for ``ranks``: raises :class:`JobAborted` when a rank posted an abort, one of
        ``ranks`` is gone (checked once per :data:`HEARTBEAT_S`), or ``deadline`` (monotonic) passed."""
        ranks = sorted(set(ranks))
        self.raise_if_aborted()
        now = time.monotonic()
        if check_liveness and now - self._beats_checked_at >= HEARTBEAT_S:
            self._beats_checked_at = now
            for rank in ranks:
                why = self.gone(rank)
                if why is not None:
                    raise JobAborted(f"rank {rank} is gone ({why}) while {what}", [rank], {rank: "died"})
        if deadline is not None and now >= deadline:
            raise JobAborted(f"rank(s) {ranks} did not answer in time while {what}", ranks, {r: "hung" for r in ranks})

    def wait_keys(self, keys: dict[int, list[str]], *, deadline: float | None, what: str, check_liveness: bool = True) -> None:
        """Wait until every rank's keys are set (``keys``: rank -> its keys); see :meth:`watch` for when
        it raises instead. The message says ``what`` was awaited."""
        pending = {rank: list(names) for rank, names in keys.items() if names}
        pause = 0.005
        while True:
            for rank in list(pending):
                if self.store.check(pending[rank]):
                    del pending[rank]
            if not pending:
                return
            self.watch(pending, deadline=deadline, what=what, check_liveness=check_liveness)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:  # reaped since the signal
        return False
    except (OSError, IndexError):
        return True


class DefaultGroup:
    """The default process group of a rank, sized to the test that runs.

    ``ensure(world_size, backend, tag)`` makes the default group span ranks ``0 .. world_size-1`` of the
    job (``tag`` names the rendezvous: every member passes the same one); ``drop()`` destroys it. Both
    are local: ranks agree on when to call them because they run the same tests and agree on every
    outcome. A group is replaced when it had a failure (see the manager), so a test never inherits a
    collective that another left half done.
    """

    def __init__(self, control: ControlStore, device: torch.device, pg_timeout_s: float) -> None:
        #: the device this rank computes on (``cuda:LOCAL_RANK`` under nccl)
        self._control = control
        self.device = device
        self._pg_timeout_s = pg_timeout_s
        #: (world size, backend) of the current default group, None without one
        self.current: tuple[int, str] | None = None

    def ensure(self, world_size: int, backend: str, tag: str) -> None:
        if self.current == (world_size, backend) and dist.is_initialized():
            return
        self.drop()
        if self._control.rank >= world_size:
            return
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"pg/{tag}/", self._control.store),
            rank=self._control.rank,
            world_size=world_size,
            timeout=timedelta(seconds=self._pg_timeout_s),
            # nccl: the group bound to this rank's GPU, so that its communicator is made here, for
            # that GPU, instead of at the first collective on whichever device torch guesses.
            device_id=self.device if backend == "nccl" else None,
        )
        self.current = (world_size, backend)

    def set_op_timeout(self, seconds: float) -> None:
        """Collectives of the default group started from now on fail after ``seconds`` (gloo): a test
        whose ranks wait on each other forever is freed shortly after its rank timeout."""
        if not dist.is_initialized() or self.current is None or self.current[1] != "gloo":
            return
        group = dist.group.WORLD
        assert group is not None
        group._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=seconds))  # no public per-op timeout for every collective

    def abort(self) -> None:
        """Abort the default group's pending work (nccl: frees a rank stuck on a GPU collective).
        Called from the watchdog thread; gloo has nothing to abort (its peers closing does it)."""
        if self.current is None or self.current[1] != "nccl" or not dist.is_initialized():
            return
        group = dist.group.WORLD
        if group is not None:
            try:
                group._get_backend(self.device).abort()  # the backend's abort is the documented way out
            except Exception:  # best effort: the rank gives up after UNSTICK_S otherwise
                pass

    def drop(self) -> None:
        """Destroy the default group (and every group made from it); a no-op without one. Peers blocked
        on this rank in a collective see it close and fail instead of waiting."""
        clear_group_caches()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group is as good as destroyed here
                pass
        self.current = None
        # The C++ groups close their connections when the last reference goes; test frames and
        # modules that held one may sit in reference cycles.
        gc.collect()
