"""For every suite: in CI (REMOTE_ACCEL_CI=1, set by .ci/run) a test that needs root,
tcpdump, network namespaces or a cross compiler must run: CI is a root Debian machine
where quickstart.sh installs all of them, so such a skip there means a broken setup
and fails. Elsewhere these tests skip, saying what they need."""

from __future__ import annotations

import os

import pytest

CI = os.environ.get("REMOTE_ACCEL_CI") == "1"
#: skip reasons that CI must never see (every such skip names one of these)
MUST_RUN_IN_CI = ("root", "tcpdump", "network namespaces", "aarch64")


@pytest.fixture
def require_in_ci():
    """need(reason): skip this test, or fail it in CI."""

    def need(reason: str):
        if CI:
            pytest.fail(f"CI must run this test, but: {reason}")
        pytest.skip(reason)

    return need


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    if any(word in reason for word in MUST_RUN_IN_CI):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where it must run (REMOTE_ACCEL_CI=1): {reason}"
