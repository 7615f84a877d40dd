"""Shared test set-up.

With KVSTORE_TEST_STRICT=1 (set by scripts/test.sh, so in CI) a skipped test
fails instead, unless it is a GPU test on a machine without a GPU: a missing
redis-server or engine must not pass as "skipped". So does a module skipped
while it is collected (a module-level ``pytest.importorskip`` whose import
failed: on a fresh machine the SGLang tests once never ran that way).
"""
import os

import pytest

pytest_plugins = ["tests.redis_server"]

STRICT = os.environ.get("KVSTORE_TEST_STRICT") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"module skipped at collection under KVSTORE_TEST_STRICT=1: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and item.get_closest_marker("gpu") is None \
            and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under KVSTORE_TEST_STRICT=1: {report.longrepr}"
