"""For every suite, in every venv CI runs: in CI (REMOTE_ACCEL_CI=1, set by .ci/run) a test
that needs root, tcpdump, network namespaces, a cross compiler, the DPDK transport, Ray,
two CPUs or the profiler built in must run: CI is a 2-core root Debian machine where
quickstart.sh installs all of them (Ray in the main venv, whose tests alone ask for it:
they are marked any_torch, which the models venv's run leaves out) and builds the
transport and the profiler, so such a skip there (of one test, or of a whole module)
means a broken setup and fails. Elsewhere these tests skip, saying what they need."""

from __future__ import annotations

import functools
import os

import pytest

CI = os.environ.get("REMOTE_ACCEL_CI") == "1"

# Every process a test starts (clients, servers, benchmarks) inherits this: one that dies
# of a signal (SIGSEGV, SIGABRT) then prints each thread's Python stack to stderr, where
# the test's failure message shows it, instead of a bare nonzero exit with nothing said.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
#: skip reasons that CI must never see (every such skip names one of these)
MUST_RUN_IN_CI = ("root", "tcpdump", "network namespaces", "aarch64", "DPDK transport unavailable",
                  "DPDK transport not built", "DPDK transport is not built", "DPDK drivers are not installed",
                  "dpdk_shim sources", "remote_accel.dataplane.dpdk", "remote_accel.ray needs Ray", "needs two CPUs")


@functools.cache
def dpdk_missing() -> str:
    """Why this machine cannot use the DPDK transport ("" when it can)."""
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError as exc:  # UnavailableError: no DPDK, or the shim is not built
        return f"DPDK transport unavailable: {exc}"
    return ""


@pytest.fixture(params=["tcp", pytest.param("dpdk", marks=[pytest.mark.dpdk, pytest.mark.any_torch])])
def transport(request, require_in_ci):
    """The transport a test runs over, each in turn: TCP, then DPDK (memif), which skips
    where the transport is missing (a failure in CI). The DPDK run differs from the TCP
    one only in the transport, which no torch changes: the models venv's rerun under a
    newer torch (marker any_torch) takes the TCP one."""
    if request.param == "dpdk" and dpdk_missing():
        require_in_ci(dpdk_missing())
    return request.param


@pytest.fixture
def needs_dpdk(require_in_ci):
    """For a test over DPDK alone: it skips where the transport is missing (a failure in CI)."""
    if dpdk_missing():
        require_in_ci(dpdk_missing())


@pytest.fixture
def require_in_ci():
    """need(reason): skip this test, or fail it in CI."""

    def need(reason: str):
        if CI:
            pytest.fail(f"CI must run this test, but: {reason}")
        pytest.skip(reason)

    return need


def _fail_if_must_run(report) -> None:
    if not (CI and report.skipped) or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    if any(word in reason for word in MUST_RUN_IN_CI):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where it must run (REMOTE_ACCEL_CI=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_must_run(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips itself (pytest.skip(..., allow_module_level=True))."""
    outcome = yield
    _fail_if_must_run(outcome.get_result())
