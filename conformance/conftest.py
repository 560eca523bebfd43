"""pytest hooks of the conformance suite; everything lives in :mod:`conformance.harness.plugin`."""

from conformance.harness.plugin import (  # noqa: F401 - hooks are found by name
    pools,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_pyfunc_call,
    pytest_report_header,
    pytest_runtest_logreport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_unconfigure,
    reference_impl,
)
