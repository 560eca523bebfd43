"""A child process that saves a checkpoint through an adapter and may be killed in the middle (ML-13).

``python -m conformance.crash_child IMPL PATH FILL [OP NTH [WORLD KILLED_RANK]]`` saves
:func:`crash_state` of ``FILL`` to ``PATH`` with ``IMPL``'s checkpoint ops: in this process without a
process group, or with ``WORLD`` > 1 in that many rank processes of a gloo group (each its own part of
a sharded tensor). With ``OP NTH`` the process (rank ``KILLED_RANK``, or every rank if it is ``all``)
kills itself (SIGKILL) at the ``NTH`` ``OP`` of :data:`conformance.faults.KILL_OPS` touching
``PATH``; the other ranks are killed too if they have not ended within :data:`SURVIVOR_TIMEOUT_S`.
Exit status: 0 if the save finished everywhere, :data:`KILLED` if a rank was killed.

With the environment variable :data:`ASYNC_ENV` set to an executor (``thread``, ``process``), the save
is the adapter's async save on that executor (AS-3), waited for; a kill then lands in the background
write, on whichever of the process's threads makes the op.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

__all__ = ["crash_state", "ASYNC_ENV"]

#: The environment variable that makes the child's save an async save on the executor it names.
ASYNC_ENV = "CONFORMANCE_CRASH_ASYNC"


def _save(impl: str, state: dict[str, object], path: str, process_group: object = None) -> None:
    from conformance.adapters.base import load_adapter

    executor = os.environ.get(ASYNC_ENV)
    if executor:
        # Unsupported (an executor this adapter lacks here) reaches main(), which exits with UNSUPPORTED.
        response = load_adapter(impl).async_checkpoint().async_save(state, path, process_group=process_group, executor=executor)  # type: ignore[arg-type]
        response.upload_completion.result()
        return
    load_adapter(impl).checkpoint().save(state, path, process_group=process_group)


def crash_state(fill: float) -> dict[str, object]:
    """A few MB in several tensors (so a save makes many writes), and a non-tensor; every value
    derives from ``fill``, so two fills differ everywhere."""
    return {
        "a": torch.arange(256 * 1024, dtype=torch.float32) + fill,
        "b": torch.full((64, 1024), fill, dtype=torch.float64),
        "c": (torch.arange(100_000) + int(fill)).to(torch.int64),
        "step": int(fill),
    }


#: The exit status of a child whose adapter does not provide the save asked for (stderr says why).
UNSUPPORTED = 77
#: The exit status of a multi-rank child one of whose ranks was killed (a single-rank child dies of SIGKILL itself).
KILLED = 9
#: Seconds the ranks that were not killed get to end (they fail on the dead peer, or hang on it).
SURVIVOR_TIMEOUT_S = 20


def _rank(rank: int, world: int, port: int, impl: str, path: str, fill: float, kill: tuple[str, int] | None, killed: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from conformance.faults import kill_at

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = crash_state(fill)
    whole = state["a"]
    assert isinstance(whole, torch.Tensor)
    state["a"] = distribute_tensor(whole, mesh, [Shard(0)])  # every rank writes its part
    if kill is not None and killed in ("all", str(rank)):
        kill_at(Path(path), *kill)
    from conformance.adapters.base import Unsupported

    try:
        _save(impl, state, path, process_group=dist.group.WORLD)
    except Unsupported as exc:
        print(exc, file=sys.stderr, flush=True)
        os._exit(UNSUPPORTED)  # no teardown: the other rank may be waiting in a collective
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str]) -> int:
    from conformance.faults import kill_at

    impl, path, fill = argv[0], Path(argv[1]), float(argv[2])
    kill = (argv[3], int(argv[4])) if len(argv) > 4 else None
    world, killed = (int(argv[5]), argv[6]) if len(argv) > 6 else (1, "all")
    path.mkdir(parents=True, exist_ok=True)
    if world == 1:
        from conformance.adapters.base import Unsupported

        if kill is not None:
            kill_at(path, *kill)
        try:
            _save(impl, crash_state(fill), str(path))
        except Unsupported as exc:
            print(exc, file=sys.stderr)
            return UNSUPPORTED
        return 0
    import multiprocessing

    # Forked, not spawned: this process has imported torch and started no thread yet, so its ranks start
    # in a fraction of the time a fresh interpreter takes, and are as separate as spawned ones.
    context = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, world, port, impl, str(path), fill, kill, killed)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(SURVIVOR_TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    codes = [proc.exitcode for proc in procs]
    if UNSUPPORTED in codes:
        return UNSUPPORTED
    return KILLED if -9 in codes else (0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
