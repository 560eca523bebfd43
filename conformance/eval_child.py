"""An evaluation job that loads a checkpoint again and again while a training job saves over it (AS-3).

``python -m conformance.eval_child IMPL PATH WORLD READY STOP OUT`` loads ``PATH`` with ``IMPL``'s
checkpoint ops in this one process, without a group, into
:func:`conformance.async_support.full_training_state` of ``WORLD`` ranks (the sharded values whole),
until the file ``STOP`` exists; it creates ``READY`` before its first load. ``OUT`` receives a JSON list
of what each load got: ``"fill 1.0"`` for one save's values whole, ``"a mix"``, or the error raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from conformance.adapters.base import load_adapter
    from conformance.async_support import full_training_state
    from conformance.checkpoint_support import is_same_bits

    impl, path, world = argv[0], Path(argv[1]), int(argv[2])
    ready, stop, out = Path(argv[3]), Path(argv[4]), Path(argv[5])
    ops = load_adapter(impl).checkpoint()
    candidates = {fill: full_training_state(world, fill) for fill in (1.0, 2.0)}
    seen: list[str] = []
    ready.touch()
    while not stop.exists() and len(seen) < 200:
        target = full_training_state(world, -7.0)
        try:
            ops.load(target, path)
        except BaseException as exc:  # noqa: B036 - what the load raised is the finding
            seen.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        seen.append(next((f"fill {fill}" for fill, state in candidates.items() if is_same_bits(target, state)), "a mix"))
    out.write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
