"""The grader's recorder: a pytest plugin and a unittest runner that report each test's outcome
over a channel the supervisor opened before any repository code was imported.

Copied into a grading sandbox under a random module name and loaded first (pytest: `-p NAME`
through the supervisor's environment; unittest: run as the test script). Standard library only
(Python >= 3.6; pytest >= 3.6 for the plugin). `_CHANNEL` is set by the grader when the file is
written: (the descriptor holding this run's key, the descriptor of the record pipe).

Every record is one JSON line `{"seq", "kind", "id", "phase", "outcome", "mac"}` written to the
record pipe as soon as the outcome is known; `mac` is an HMAC-SHA256 under a key read from the
key descriptor (which is then closed) before repository code runs, chained by the sequence
number, so a line written to the pipe by other code does not verify. Outcomes come from the
test's own exception (pytest: the call information, read before any other report hook runs),
never from a report other code may rewrite; a report that contradicts it, a test framework
function replaced at run time, or a report hook registered by code that is neither a conftest
nor an installed plugin is recorded as a problem, which the grader scores 0.
"""

import hashlib
import hmac
import json
import os
import sys

_CHANNEL = None  # set by the grader: (key fd, record fd)
_HIDE = ("PYTEST_ADDOPTS", "PYTHONPATH")
_SAVED = ("PATCHGYM_VERDICT_ADDOPTS", "PATCHGYM_VERDICT_PYTHONPATH")


def _restore_environment():
    """Put back the variables the supervisor used to load this plugin (as the agent had them)."""
    for name, saved in zip(_HIDE, _SAVED):  # noqa: B905 - Python 3.6 has no strict
        value = os.environ.pop(saved, None)
        if value is None:
            continue
        if value == "\x01":  # it was unset
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _open_channel():
    """A `send(kind, test_id, phase, outcome)` bound to this run's key and pipe (a closure)."""
    key_fd, record_fd = _CHANNEL
    chunks = []
    while True:
        chunk = os.read(key_fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(key_fd)
    key = b"".join(chunks)
    write, new, sha256, dumps = os.write, hmac.new, hashlib.sha256, json.dumps
    state = [0]

    def send(kind, test_id="", phase="", outcome=""):
        state[0] += 1
        seq = state[0]
        body = "\x1f".join((str(seq), kind, test_id, phase, outcome)).encode("utf-8", "replace")
        mac = new(key, body, sha256).hexdigest()
        line = dumps({"seq": seq, "kind": kind, "id": test_id, "phase": phase, "outcome": outcome, "mac": mac})
        data = (line + "\n").encode("utf-8", "replace")
        while data:
            try:
                data = data[write(record_fd, data) :]
            except OSError:
                return

    return send


class _Guard:
    """Functions of the test framework as they were when the recorder loaded; `changed()` names
    those replaced since (or whose code was swapped)."""

    def __init__(self, targets):
        self._watched = []
        for owner, name in targets:
            value = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if value is not None:
                self._watched.append((owner, name, value, getattr(value, "__code__", None)))

    def changed(self):
        found = []
        for owner, name, value, code in self._watched:
            now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if now is not value or getattr(now, "__code__", None) is not code:
                found.append("{}.{}".format(getattr(owner, "__name__", owner), name))
        return found


def _unittest_targets():
    import unittest
    import unittest.case
    import unittest.result
    import unittest.suite

    names = {
        unittest.TestCase: ("run", "__call__", "_callTestMethod", "_callSetUp", "_callTearDown", "id"),
        unittest.TestResult: ("addSuccess", "addFailure", "addError", "addSkip", "startTest", "stopTest"),
        unittest.suite.TestSuite: ("run", "__call__"),
        unittest.case: ("_Outcome",),
    }
    return [(owner, name) for owner, members in names.items() for name in members]


_send = None
_guard = None


def _start():
    global _send
    _restore_environment()
    _send = _open_channel()
    _send("begin", phase=str(os.getpid()))


def _problem(what):
    _send("problem", outcome=what)


def _check_guard(test_id):
    for name in _guard.changed() if _guard else ():
        _problem(f"the test framework's {name} was replaced at run time (seen after {test_id})")


# -- pytest -----------------------------------------------------------------------------------

_CANARY = None  # set by the grader: a test file to collect beside the command's, or None
_SENSITIVE_HOOKS = (
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_report_teststatus",
    "pytest_runtest_protocol",
    "pytest_runtest_call",
    "pytest_runtest_setup",
    "pytest_runtest_teardown",
    "pytest_pyfunc_call",
    "pytest_itemcollected",
    "pytest_collection_modifyitems",
    "pytest_make_collect_report",
    "pytest_collectreport",
    "pytest_deselected",
)
_OWN = sys.modules.get(__name__)
_collected = {}

if _CHANNEL is not None and __name__ != "__main__":
    import pytest

    _start()

    def _pytest_targets():
        import _pytest.runner as runner

        targets = [(runner, name) for name in ("call_and_report", "call_runtest_hook", "runtestprotocol")]
        targets += [(runner.CallInfo, "from_call")]
        import _pytest.reports as reports

        targets += [(reports.TestReport, "from_item_and_call"), (reports.BaseReport, "passed")]
        targets += [(reports.BaseReport, "failed"), (reports.BaseReport, "skipped")]
        import _pytest.python as python

        targets += [(python.Function, "runtest"), (python, "pytest_pyfunc_call")]
        return targets + _unittest_targets()

    _guard = _Guard(_pytest_targets())

    def _allowed(plugin, manager):
        """pytest's own plugins, conftest modules, installed plugins and modules pytest imported
        as plugins (`-p`, `pytest_plugins`: registered under their own name)."""
        if plugin is _OWN or plugin in getattr(manager, "_conftest_plugins", ()):
            return True
        if isinstance(plugin, type(sys)):
            module = plugin.__name__
            if manager.get_name(plugin) == module:
                return True
        else:
            module = getattr(plugin, "__module__", None) or type(plugin).__module__
        if str(module).split(".")[0] in ("_pytest", "pytest", "pluggy", "__main__", "xdist"):
            return True
        return any(dist_plugin is plugin for dist_plugin, _ in manager.list_plugin_distinfo())

    def _check_hooks(manager, where):
        for name in _SENSITIVE_HOOKS:
            caller = getattr(manager.hook, name, None)
            for impl in caller.get_hookimpls() if caller is not None else ():
                if not _allowed(impl.plugin, manager):
                    _problem(f"{name} is implemented by {impl.plugin!r}, registered at run time ({where})")

    def pytest_configure(config):
        if _CANARY and os.path.exists(_CANARY):
            config.args.append(_CANARY)

    @pytest.hookimpl(tryfirst=True)
    def pytest_itemcollected(item):
        _collected[id(item)] = item.nodeid

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(session):
        _check_hooks(session.config.pluginmanager, "after collection")

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(item, call):
        raised = call.excinfo is not None
        outcome = yield
        test_id = _collected.get(id(item), item.nodeid)
        if test_id != item.nodeid:
            _problem(f"test {test_id} was renamed {item.nodeid} at run time")
        try:
            report = outcome.get_result()
        except BaseException:  # a report hook failed: the test did not pass
            _send("outcome", test_id, call.when, "error")
            return
        if report.passed:
            state = "xpass" if hasattr(report, "wasxfail") else "passed"
            if raised:
                _problem(f"the {call.when} report of {test_id} says passed, but the test raised")
                state = "failed"
        elif report.failed:
            state = "failed" if call.when == "call" else "error"
        else:
            state = "xfail" if hasattr(report, "wasxfail") else "skipped"
        if call.when == "teardown":
            _check_guard(test_id)
            _check_hooks(item.config.pluginmanager, "after " + test_id)
        _send("outcome", test_id, call.when, state)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(session, exitstatus):
        _check_guard("the session")
        _send("end", outcome=str(len(_collected)))


# -- unittest ---------------------------------------------------------------------------------


def _unittest_result_class():
    import unittest

    class Result(unittest.TextTestResult):
        """Records each test's worst outcome (its subtests' included) when it stops."""

        def startTest(self, test):
            self._worst = "passed"
            super().startTest(test)

        def _mark(self, state):
            order = ("passed", "xfail", "skipped", "failed", "error")
            current = getattr(self, "_worst", "passed")
            self._worst = state if order.index(state) > order.index(current) else current

        def addSuccess(self, test):
            super().addSuccess(test)

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._mark("failed")

        def addError(self, test, err):
            super().addError(test, err)
            self._mark("error")
            if not isinstance(test, unittest.TestCase):  # a class or module fixture failed
                _send("outcome", test.id(), "setup", "error")

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._mark("skipped")

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._mark("xfail")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._mark("failed")

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:
                self._mark("failed" if issubclass(err[0], test.failureException) else "error")

        def stopTest(self, test):
            super().stopTest(test)
            test_id = f"{type(test).__module__}.{type(test).__qualname__}.{test._testMethodName}"
            _send("outcome", test_id, "call", getattr(self, "_worst", "error"))
            self._worst = "error"
            _check_guard(test_id)

    return Result


def main(argv=None):
    """Discover and run a unittest suite with the recording result; exit 0 iff all passed."""
    import argparse
    import unittest

    global _guard
    parser = argparse.ArgumentParser(description="run a unittest suite, recording each outcome")
    parser.add_argument("--report", help="ignored (the outcomes go over the grader's channel)")
    parser.add_argument("--start", default="tests")
    parser.add_argument("--top", default=".")
    parser.add_argument("--pattern", default="test*.py")
    args = parser.parse_args(argv)
    _start()
    _guard = _Guard(_unittest_targets())
    top = os.path.abspath(args.top)
    sys.path.insert(0, top)
    suite = unittest.defaultTestLoader.discover(args.start, pattern=args.pattern, top_level_dir=top)
    runner = unittest.TextTestRunner(resultclass=_unittest_result_class(), verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    _check_guard("the suite")
    _send("end", outcome=str(result.testsRun))
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
