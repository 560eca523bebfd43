"""Self-tests of :mod:`tests.forked`: the inner pytest sessions of the self-tests are forked from one
torch-preloaded server for the whole run, whatever ``pytester`` does between tests."""

from __future__ import annotations

import pytest

#: Two tests, each running an inner session (as ``run_suite`` does) that prints its server's pid.
TWO_TESTS_WITH_INNER_SESSIONS = '''
import os
import re

from tests.forked import run_forked_pytest


def server_of_an_inner_session(pytester):
    pytester.makepyfile(test_inner="import os\\n\\ndef test_server():\\n    print('SERVER', os.getppid())\\n")
    result = run_forked_pytest(pytester, ["-s", "-p", "no:cacheprovider"], timeout=120)
    assert result.ret == 0, result.outlines
    (pid,) = [int(m.group(1)) for line in result.outlines for m in [re.search(r"SERVER (\\d+)", line)] if m]
    return pid


def test_first(pytester):
    print("FIRST", server_of_an_inner_session(pytester), os.getpid())


def test_second(pytester):
    print("SECOND", server_of_an_inner_session(pytester), os.getpid())
'''


def test_inner_sessions_of_different_tests_share_one_server(suite: pytest.Pytester) -> None:
    """``pytester`` drops the modules a test imported when it ends. Had the first test imported
    multiprocessing's forkserver client, the second would start a server of its own: a fresh interpreter
    importing torch for every test with an inner session, each left running to the end of the run."""
    suite.makepyfile(test_two=TWO_TESTS_WITH_INNER_SESSIONS)
    # A fresh interpreter, as make test's parts are: nothing imported before the run starts.
    result = suite.runpytest_subprocess("-p", "pytester", "-s", "-p", "no:cacheprovider", "test_two.py", timeout=240)
    assert result.ret == 0, result.outlines
    servers = {}
    for line in result.outlines:
        words = line.split()
        for i, word in enumerate(words[:-2]):
            if word in ("FIRST", "SECOND"):
                servers[word] = (int(words[i + 1]), int(words[i + 2]))
    assert set(servers) == {"FIRST", "SECOND"}, result.outlines
    (first, session), (second, _) = servers["FIRST"], servers["SECOND"]
    assert first != session, "the inner session was not forked from a server"
    assert first == second, f"the second test's inner session came from another server ({second}, not {first})"
