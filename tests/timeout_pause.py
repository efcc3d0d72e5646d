"""A pytest plugin: pytest-timeout's alarm is paused while pytest builds a test's report.

pytest-timeout (signal method) ends a test by raising ``pytest.fail`` from SIGALRM wherever
the main thread is. When the alarm rings while pytest formats a failure (a slow ``repr``, or a
loaded machine), the ``Failed`` lands inside the formatting: the report shows "<exception str()
failed>" instead of the error, or pytest stops with an INTERNALERROR that hides every later
test. So the remaining time is taken off the timer for the duration of
``pytest_runtest_makereport`` and given back after it: setup, call and teardown keep their
whole budget, and a failure is always reported as itself.

Loaded by ``tests/conftest.py`` (which imports the hook) and, in a test of it, with
``-p timeout_pause``.
"""

from __future__ import annotations

import signal
import threading

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    paused = 0.0
    if threading.current_thread() is threading.main_thread():
        paused, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if paused > 0:
            signal.setitimer(signal.ITIMER_REAL, paused)
