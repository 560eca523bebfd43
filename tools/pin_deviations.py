"""``python -m tools.pin_deviations`` in a checkout: the installed ``statedict-pin-deviations`` (:mod:`conformance.cli.pin_deviations`)."""

import sys

from conformance.cli.pin_deviations import main

if __name__ == "__main__":
    sys.exit(main())
