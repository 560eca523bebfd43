"""The command-line tools a fork's CI needs, installed with the suite (``[project.scripts]``):

``statedict-report``          (:mod:`conformance.cli.report`): run the suite and print the requirement x
                              implementation table, show a saved ``--report-json`` result, diff two runs
                              (a CI gate: exit 1 when anything newly fails or fails differently);
``statedict-pin-deviations``  (:mod:`conformance.cli.pin_deviations`): pins for an expected-failures file;
``statedict-ckpt-inspect``    (:mod:`conformance.cli.ckpt_inspect`): what a DCP checkpoint holds.

Each is also ``python -m conformance.cli.<module>``; in a checkout, ``python -m tools.<module>`` too.
"""
