"""The environment a launcher gives each rank (no torch, no pytest).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` and ``TORCHELASTIC_*`` for every worker; SLURM's ``srun`` sets ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID`` and the tasks per node, and a batch script exports
``MASTER_ADDR``/``MASTER_PORT``. :func:`detect` reads either into one :class:`LaunchEnv`; without
them the suite runs its own rank pools (the default on one machine).

The layout of the job (its ranks per node) decides the 2-D meshes of the suite: a world that spans
whole nodes is ``(nodes, ranks per node)`` (:func:`conformance.rank_context.hybrid_mesh_shape`, fed by
each body's :class:`~conformance.rank_context.RankContext`), so HYBRID_SHARD replicates across nodes
and shards within a node, the layout that strategy exists for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "detect", "launcher_variables"]

#: What a torchrun worker needs; all or none must be set.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: What an ``srun`` task needs (with ``MASTER_ADDR``/``MASTER_PORT`` exported by the batch script).
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")


@dataclass(frozen=True)
class LaunchEnv:
    """One rank of a launched job, as its launcher described it.

    ``rank`` is the rank in the job (0 .. ``world_size`` - 1); ``local_rank`` its index among the
    ``local_world_size`` ranks of its node, which is also the GPU it drives. ``use_agent_store``: a
    torchrun agent hosts the job's TCPStore at ``master_addr:master_port`` and every rank is a client;
    otherwise rank 0 hosts it there. ``run_id`` and ``restart_count`` name this incarnation of the job
    (keys of an earlier one in a shared store are never read).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool
    run_id: str
    restart_count: int
    launcher: str  # "torchrun" or "srun"

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"launch environment: RANK {self.rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {self.world_size})")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"launch environment: LOCAL_RANK {self.local_rank} is not in 0..LOCAL_WORLD_SIZE-1 "
                f"(LOCAL_WORLD_SIZE {self.local_world_size})"
            )
        if not 0 < self.master_port < 2**16:
            raise ValueError(f"launch environment: MASTER_PORT {self.master_port} is not a port number")

    @property
    def nodes(self) -> int | None:
        """Number of nodes when every node runs ``local_world_size`` ranks; None otherwise."""
        if self.world_size % self.local_world_size:
            return None
        return self.world_size // self.local_world_size


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"launch environment: {name}={raw!r} is not an integer") from None


def _tasks_on_node(spec: str, node: int) -> int:
    """The task count of node ``node`` in SLURM's compressed list, e.g. ``8(x2),4`` -> 8, 8, 4."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"launch environment: cannot read tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ValueError(f"launch environment: SLURM_NODEID {node} is not among the {len(counts)} nodes of {spec!r}")
    return counts[node]


def detect(env: Mapping[str, str]) -> LaunchEnv | None:
    """The launch environment in ``env`` (``os.environ``), or None when no launcher started this
    process. A partial set (some of torchrun's variables but not all, or srun's without
    ``MASTER_ADDR``/``MASTER_PORT``) is a ValueError naming what is missing."""
    present = [name for name in TORCHRUN_VARS if env.get(name)]
    if "RANK" in present or "WORLD_SIZE" in present:
        missing = [name for name in TORCHRUN_VARS if name not in present]
        if missing:
            raise ValueError(
                f"launch environment: RANK/WORLD_SIZE are set but {', '.join(missing)} are not "
                "(torchrun sets all of them; an srun script must export them or use SLURM's)"
            )
        return LaunchEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE"),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "job",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
        )
    # An srun step has a numeric SLURM_STEP_ID; a batch script itself ("batch") is no rank.
    if all(env.get(name) for name in SLURM_VARS) and env.get("SLURM_STEP_ID", "").isdigit():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing and _int(env, "SLURM_NTASKS") == 1:
            return None  # `srun pytest ...` of one task: the pools, as without srun
        if missing:
            raise ValueError(
                f"launch environment: an srun task (SLURM_PROCID is set) needs {' and '.join(missing)} exported by the "
                "batch script: the address and a free port of the first node"
            )
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        if not per_node:
            raise ValueError("launch environment: srun set SLURM_PROCID but not SLURM_STEP_TASKS_PER_NODE")
        return LaunchEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID"),
            local_world_size=_tasks_on_node(per_node, _int(env, "SLURM_NODEID")),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
            use_agent_store=False,
            run_id=f"{env.get('SLURM_JOB_ID', 'job')}.{env['SLURM_STEP_ID']}",
            restart_count=0,
            launcher="srun",
        )
    return None


def launcher_variables(env: Mapping[str, str], launched: LaunchEnv) -> list[str]:
    """The names in ``env`` that make a process a rank of ``launched``'s job: torchrun's (``RANK`` ..
    ``MASTER_PORT``, ``GROUP_*``, ``ROLE_*``, ``TORCHELASTIC_*``), or an srun task's identity and the
    exported address. A process the rank starts must not inherit them: ``TORCHELASTIC_USE_AGENT_STORE``
    alone makes torch's ``tcp://`` rendezvous in a child connect to a store nobody hosts."""
    if launched.launcher == "srun":
        names = {"SLURM_PROCID", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"}
    else:
        names = set(TORCHRUN_VARS) | {n for n in env if n.startswith(("GROUP_", "ROLE_", "TORCHELASTIC_"))}
    return sorted(n for n in names if n in env)
