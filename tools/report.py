"""``python -m tools.report`` in a checkout: the installed ``statedict-report`` (:mod:`conformance.cli.report`)."""

import sys

from conformance.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
