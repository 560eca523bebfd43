"""The settings of one run of the suite (:class:`HarnessConfig`), read once from the options.

The plugin builds the object in ``pytest_configure``, after the runner is chosen (a torchrun job's
world size is the default of ``--world-size``, and its ranks with a GPU decide ``--backend auto``),
and keeps it in the config's stash (:func:`harness_config`). Nothing reads these options again; what
the ranks need of it (a body's timeout, the backend) travels with each run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conformance.adapters.base import SHIPPED

__all__ = ["HarnessConfig", "SETTINGS", "harness_config", "parse_shard", "parse_world_sizes"]


def parse_world_sizes(raw: str) -> tuple[int, ...]:
    """``--world-size``'s value as sorted distinct sizes; a usage error for anything but positive integers."""
    try:
        sizes = sorted({int(part) for part in str(raw).split(",") if part.strip()})
    except ValueError:
        raise pytest.UsageError(f"--world-size expects integers like 1,2,4; got {raw!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-size expects positive integers; got {raw!r}")
    return tuple(sizes)


def parse_shard(option: str | None) -> tuple[int, int] | None:
    """``--shard K/N`` as (K, N), or None; a usage error for anything but 1 <= K <= N."""
    if option is None:
        return None
    index, _, count = option.partition("/")
    try:
        k, n = int(index), int(count)
    except ValueError:
        k, n = 0, 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard takes K/N with 1 <= K <= N (e.g. 1/2), not {option!r}")
    return k, n


@dataclass(frozen=True)
class HarnessConfig:
    """What the options of one run say, checked once."""

    #: ``--world-size``: the world sizes rank tests run at (default 1,2; under torchrun the job's)
    world_sizes: tuple[int, ...]
    #: ``--backend``: ``auto``, ``gloo`` or ``nccl``
    backend: str
    #: how many of the ranks 0, 1, ... drive a GPU of their own (this machine's devices; under
    #: torchrun the job's ranks with one): ``auto`` takes nccl up to this world size
    cuda_devices: int
    #: ``--impl``: the adapters under test, each once, in order (every shipped one by default)
    impls: tuple[str, ...]
    #: ``--rank-timeout``: seconds a rank test may run before it is cut
    rank_timeout_s: float
    #: ``--rerun-crashes``: adapter names whose memory-error crashes are run once more
    rerun_crashes: frozenset[str]
    #: ``--run-known-hangs``
    run_known_hangs: bool
    #: ``--launcher``: ``auto``, ``pool`` or ``env``
    launcher: str
    #: ``--shared-tmp``: torchrun mode's scratch root (None: the system temporary directory)
    shared_tmp: str | None
    #: ``--shard K/N``: run the K-th of N parts of the selected tests (None: all of them)
    shard: tuple[int, int] | None = None
    #: the ranks the runner has (a torchrun job's world size); None: pools of any size
    ranks: int | None = None

    @classmethod
    def from_options(cls, config: pytest.Config, *, default_world_sizes: str | None = None, cuda_devices: int | None = None,
                     ranks: int | None = None) -> HarnessConfig:
        """The settings ``config``'s options give; ``default_world_sizes``, ``cuda_devices`` and ``ranks``
        are the runner's (a torchrun job's) when it has its own, else ``1,2``, this machine's GPUs and
        pools of any size."""
        impls = [s.strip() for opt in config.getoption("--impl") for s in opt.split(",") if s.strip()]
        return cls(
            world_sizes=parse_world_sizes(config.getoption("--world-size") or default_world_sizes or "1,2"),
            backend=str(config.getoption("--backend")),
            cuda_devices=_local_cuda_devices() if cuda_devices is None else cuda_devices,
            impls=tuple(dict.fromkeys(impls)) or tuple(SHIPPED),
            rank_timeout_s=float(config.getoption("--rank-timeout")),
            rerun_crashes=frozenset(name.strip() for value in config.getoption("--rerun-crashes") for name in value.split(",") if name.strip()),
            run_known_hangs=bool(config.getoption("--run-known-hangs")),
            launcher=str(config.getoption("--launcher")),
            shared_tmp=config.getoption("--shared-tmp"),
            shard=parse_shard(config.getoption("--shard")),
            ranks=ranks,
        )

    @property
    def pg_timeout_s(self) -> float:
        """The process groups' own timeout: twice the rank timeout, at least a minute (the harness cuts
        a hang first, and names it)."""
        return max(60.0, self.rank_timeout_s * 2)

    def why_not_run(self, world_size: int) -> str | None:
        """Why a rank test of ``world_size`` is a skip here (the reason it reports), or None when it runs:
        the runner has the ranks, and nccl (the backend ``world_size`` gets) a GPU for each."""
        if self.ranks is not None and world_size > self.ranks:
            return f"world size {world_size} needs {world_size} ranks; the torchrun job has {self.ranks}"
        if self.backend_for(world_size) == "nccl" and self.cuda_devices < world_size:
            return f"nccl at world size {world_size} needs {world_size} CUDA devices; found {self.cuda_devices}"
        return None

    def can_run(self, world_size: int) -> bool:
        """Whether a rank test of ``world_size`` runs here rather than being a skip."""
        return self.why_not_run(world_size) is None

    def backend_for(self, world_size: int) -> str:
        """The backend of ``world_size``: ``auto`` is nccl where every rank has a GPU, else gloo."""
        if self.backend == "auto":
            return "nccl" if self.cuda_devices >= world_size else "gloo"
        return self.backend


def _local_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


#: The run's settings, in ``config.stash`` from ``pytest_configure`` on.
SETTINGS = pytest.StashKey[HarnessConfig]()


def harness_config(config: pytest.Config) -> HarnessConfig:
    """The settings of the run ``config`` belongs to (made by the plugin at configure)."""
    return config.stash[SETTINGS]
