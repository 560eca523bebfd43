"""The pytest hooks of torchrun mode (:class:`JobHooks`), registered when this process joins a job:
the header, one collection order checked on every rank, the test in progress, the skips of world
sizes above the job's, and the end of the session.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

from conformance.harness.torchrun.control import JobAborted
from conformance.harness.torchrun.job import Job
from conformance.harness.torchrun.watchdog import add_launch_info
from conformance.rank_context import hybrid_mesh_shape

__all__ = ["JobHooks", "COLLECT_WAIT_S"]

#: How long the collection (every rank importing the suite) may take beyond the first rank's.
COLLECT_WAIT_S = 900.0

_INDEX = pytest.StashKey[int]()


class JobHooks:
    """The hooks of a process that is a rank of ``job``."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        job = self.job
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

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Every rank collects, orders the tests by world size, and the ranks compare a digest of the ids."""
        job = self.job
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
            raise pytest.UsageError(collection_difference(0, ids_0, digests[0], other, ids_other, digests[other]))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        test_id = dict(item.user_properties).get("test_id", item.nodeid)
        self.job.current = (item.stash.get(_INDEX, -1), str(test_id), item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # A world size above the job's is the plugin's skip (HarnessConfig.why_not_run).
        job = self.job
        callspec = getattr(item, "callspec", None)
        spec = callspec.params.get("dist") if callspec is not None else None
        if not isinstance(getattr(spec, "world_size", None), int):
            # The pools' controller has no process group: code on it (a save without a group) must not
            # find the last rank test's group as the default one.
            job.group.drop()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        job = self.job
        job.session_finished = True
        job.session = session
        if job.is_reporter:
            add_launch_info(job)

    def pytest_internalerror(self, excrepr: Any, excinfo: Any) -> None:
        job = self.job
        last = str(excrepr).strip().splitlines()[-1:] or [""]
        job.control.post_abort("error", f"failed outside a test (pytest INTERNALERROR): {last[0]}", job.test_label())

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.job.config is config:
            self.job.group.drop()


def _layout_text(job: Job) -> str:
    replicate, shard = hybrid_mesh_shape(job.world_size, job.layout[1] if job.layout else None)
    return f"(replicate {replicate}, shard {shard})"


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


def collection_difference(a: int, ids_a: list[str], info_a: tuple[str, int, int], b: int, ids_b: list[str], info_b: tuple[str, int, int]) -> str:
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
