"""A pytest plugin (`-p live_report`, with tests/ on the path) that reports each test as it ends, with the time of
day and its duration, and prints a failure's report at once rather than in the session's summary.

`tests/gpu/run_suite.py` loads it in every process: a GPU suite cut short (a machine taken back, a lane stopped)
still says which test failed, why, and how long each finished test took.
"""

from __future__ import annotations

import time

import pytest

FAILURE_LINES = 80  # of a failure's report, the last ones (where the assertion and its message are)


_config = None  # the session's, set at configure: a TestReport does not carry it


def pytest_configure(config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.failed or report.skipped):
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if terminal is None:
        return
    outcome = report.outcome.upper() + ("" if report.when == "call" else f" in {report.when}")
    terminal.write_line(f"\n[{time.strftime('%H:%M:%S')}] {outcome} {report.nodeid} ({report.duration:.1f} s)")
    if report.failed:
        terminal.write_line("\n".join(report.longreprtext.splitlines()[-FAILURE_LINES:]))
