"""Self-tests of ``tools/shard_costs.py``: the durations pytest prints become the table the parts of a
run are dealt by (HX-35), in the form the harness reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.shards import load_costs
from tools.shard_costs import durations_of, main

DURATIONS = """\
============================= slowest durations ==============================
12.50s call     conformance/test_a.py::test_slow[ws2-torch]
0.50s setup    conformance/test_a.py::test_slow[ws2-torch]
0.01s teardown conformance/test_a.py::test_slow[ws2-torch]
0.10s call     conformance/test_a.py::test_slow[ws1-torch]
0.10s call     conformance/test_a.py::test_slow[ws1-reference]
0.00s call     tests/test_b.py::test_plain
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
1 passed in 3.00s
"""


@pytest.mark.req("HX-35")
def test_durations_become_the_costs_the_harness_reads(tmp_path: Path) -> None:
    assert durations_of(DURATIONS.splitlines()) == pytest.approx(
        {"conformance/test_a.py::test_slow[ws2-torch]": 13.01, "conformance/test_a.py::test_slow[ws1-torch]": 0.1,
         "conformance/test_a.py::test_slow[ws1-reference]": 0.1, "tests/test_b.py::test_plain": 0.0}
    )
    log = tmp_path / "run.log"
    log.write_text(DURATIONS)
    out = tmp_path / "costs.json"
    assert main([str(log), "--out", str(out)]) == 0
    table = load_costs(out)
    assert table.cost("conformance/test_a.py::test_slow[ws2-torch]") == 13.01
    assert table.cost("conformance/test_a.py::test_slow[ws1-torch]") == 0.1
    assert table.cost("conformance/test_a.py::test_slow[ws1-fork]") == 0.1  # its function's usual cost
    assert table.cost("tests/test_b.py::test_plain") == 0.001  # never free
    assert table.default_s == 0.1  # the median: a new function is priced like most tests

    other = tmp_path / "other.log"
    other.write_text("4.00s call     tests/test_c.py::test_new\n")
    assert main([str(other), "--out", str(out), "--update"]) == 0  # keeps what other.log does not measure
    table = load_costs(out)
    assert table.cost("tests/test_c.py::test_new") == 4.0
    assert table.cost("conformance/test_a.py::test_slow[ws2-torch]") == 13.01
    with pytest.raises(SystemExit, match="no --durations lines"):
        main([str(tmp_path / "costs.json"), "--out", str(tmp_path / "x.json")])
