"""Which implementations the benchmarks measure, and how a name becomes the code that runs.

Every benchmarked implementation is a conformance adapter (:mod:`conformance.adapters`), named as
``--impl`` names it: a shipped name (``reference``, ``torch``, ``torch-fsdp2``, ``fairscale``) or
``package.module:AdapterClass``. The workloads call only the adapter's ops protocols
(``FlatParamOps``, ``StateDictOps``, ``OptimStateOps``, ``CheckpointOps`` and ``ShardingOps``), so the
reference, torch and a fork are measured the same way. Two more names are not adapters: ``raw`` (the
plain calls or plain file I/O of the same work, the limit no implementation can beat) and, for
checkpoints, ``memcpy`` and ``raw-agreed`` (raw's I/O with the collectives every DCP implementation
runs between ranks; see :mod:`bench.workloads.checkpoint`).

``BENCH_IMPL`` (environment; ``make bench IMPL=...`` sets it) names the implementations under test,
comma-separated: they are measured beside the reference, the upstream baseline of each family (torch;
fairscale for ``FlattenParamsWrapper``) and raw, in the same run, and the first of them is what the
regression gate times (:func:`gated_impl`; the reference when ``BENCH_IMPL`` is unset). Read once, at
import: asv computes its benchmark parameters from it.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "LIMITS", "AGREED_RAW", "ENV_VAR", "under_test", "gated_impl", "family", "is_adapter", "adapter", "ops", "unavailable",
]

#: Names that are not adapters: the plain-call / plain-I/O limit, a memory copy of the same bytes, and
#: the checkpoints' plain I/O with DCP's collectives.
AGREED_RAW = "raw-agreed"
LIMITS: tuple[str, ...] = ("raw", "memcpy", AGREED_RAW)
#: The environment variable naming the implementations under test.
ENV_VAR = "BENCH_IMPL"


def _parse(value: str) -> list[str]:
    specs: list[str] = []
    for part in value.split(","):
        spec = part.strip()
        if spec and spec not in specs:
            specs.append(spec)
    for spec in specs:
        if spec in LIMITS:
            raise ValueError(f"{ENV_VAR}={value!r}: {spec!r} is a baseline every run measures, not an implementation")
    return specs


def under_test(environ: dict[str, str] | None = None) -> list[str]:
    """The implementations named by ``BENCH_IMPL`` (in ``environ``, default: the process's), in order,
    without repeats; ``[]`` when it is unset or empty."""
    return _parse((os.environ if environ is None else environ).get(ENV_VAR, ""))


def gated_impl(environ: dict[str, str] | None = None) -> str:
    """The one implementation the regression gate times: the first of ``BENCH_IMPL``, else ``reference``."""
    specs = under_test(environ)
    return specs[0] if specs else "reference"


def family(baselines: tuple[str, ...], limits: tuple[str, ...] = ("raw",), environ: dict[str, str] | None = None) -> list[str]:
    """The implementations of one benchmark family: the reference, the family's upstream ``baselines``,
    the implementations under test, then ``limits``; each once."""
    names: list[str] = []
    for name in ("reference", *baselines, *under_test(environ), *limits):
        if name not in names:
            names.append(name)
    return names


def is_adapter(name: str) -> bool:
    """False for the limits (:data:`LIMITS`), True for every adapter name."""
    return name not in LIMITS


def adapter(spec: str) -> Any:
    """The adapter named ``spec`` (one instance per process; see ``conformance.adapters.base.load_adapter``)."""
    from conformance.adapters.base import load_adapter

    return load_adapter(spec)


def ops(spec: str, capability: str) -> Any:
    """The ops object of ``capability`` (``flat_param``, ``state_dict``, ``optim_state``, ``checkpoint``,
    ``sharding``) of the adapter ``spec``; raises ``Unsupported`` when the adapter lacks it."""
    return getattr(adapter(spec), capability)()


def unavailable(spec: str, capability: str) -> str | None:
    """None if ``spec`` can run ``capability`` here (the limits always can), else why not: the skip reason
    of a benchmark, naming the adapter and capability. A ``spec`` that names no adapter is an error
    (ValueError from ``load_adapter``), not a skip."""
    if not is_adapter(spec):
        return None
    reason = adapter(spec).unsupported_reason(capability)
    return None if reason is None else f"{spec} does not provide {capability}: {reason}"
