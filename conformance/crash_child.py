"""A child process that saves a checkpoint through an adapter and may be killed in the middle (ML-13).

``python -m conformance.crash_child IMPL PATH FILL [OP NTH]`` saves :func:`crash_state` of ``FILL``
to ``PATH`` with ``IMPL``'s checkpoint ops, without a process group; with ``OP NTH`` it kills itself
(SIGKILL) at the ``NTH`` ``OP`` of :data:`conformance.faults.KILL_OPS` touching ``PATH`` first. Exit
status 0: the save finished (the kill point was never reached).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

__all__ = ["crash_state"]


def crash_state(fill: float) -> dict[str, object]:
    """A few MB in several tensors (so a save makes many writes), and a non-tensor; every value
    derives from ``fill``, so two fills differ everywhere."""
    return {
        "a": torch.arange(256 * 1024, dtype=torch.float32) + fill,
        "b": torch.full((64, 1024), fill, dtype=torch.float64),
        "c": (torch.arange(100_000) + int(fill)).to(torch.int64),
        "step": int(fill),
    }


def main(argv: list[str]) -> int:
    from conformance.adapters.base import load_adapter
    from conformance.faults import kill_at

    impl, path, fill = argv[0], Path(argv[1]), float(argv[2])
    ops = load_adapter(impl).require("checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    if len(argv) > 3:
        kill_at(path, argv[3], int(argv[4]))
    ops.save(crash_state(fill), path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
