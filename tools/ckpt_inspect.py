"""``python -m tools.ckpt_inspect`` in a checkout: the installed ``statedict-ckpt-inspect`` (:mod:`conformance.cli.ckpt_inspect`)."""

import sys

from conformance.cli.ckpt_inspect import main

if __name__ == "__main__":
    sys.exit(main())
