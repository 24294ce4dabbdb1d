"""Run a unittest suite and write a JUnit XML report: `python3 unittest_junit.py --report R`.

A standalone script (standard library only, Python >= 3.8) that the grader copies into a
sandbox, so that tasks whose tests use plain unittest get a machine-readable report written
outside the agent's reach. Exit code: 0 if every test passed, 1 otherwise, 2 on bad usage.
"""

import argparse
import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET


class _JUnitResult(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cases = []  # (test id, outcome tag or None, message, seconds)
        self._started = 0.0

    def startTest(self, test):
        self._started = time.perf_counter()
        super().startTest(test)

    def _record(self, test, tag=None, message="", type_=""):
        self.cases.append((test.id(), tag, message, type_, time.perf_counter() - self._started))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "skipped", "expected failure", "xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failure", "unexpected success")


def _write_report(path, cases):
    suite = ET.Element("testsuite", name="unittest", tests=str(len(cases)))
    for test_id, tag, message, type_, seconds in cases:
        classname, _, name = test_id.rpartition(".")
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.6f}")
        if tag:
            child = ET.SubElement(case, tag, message=message[:2000], type=type_)
            child.text = message
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="where to write the JUnit XML")
    parser.add_argument("--start", default="tests", help="directory to discover tests in")
    parser.add_argument("--top", default=".", help="top-level directory of the project")
    parser.add_argument("--pattern", default="test*.py")
    args = parser.parse_args(argv)
    top = os.path.abspath(args.top)
    sys.path.insert(0, top)
    suite = unittest.defaultTestLoader.discover(args.start, pattern=args.pattern, top_level_dir=top)
    runner = unittest.TextTestRunner(resultclass=_JUnitResult, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    _write_report(args.report, result.cases)
    return 0 if result.wasSuccessful() and not result.unexpectedSuccesses else 1


if __name__ == "__main__":
    sys.exit(main())
