"""Red-team suites: attacks on the grader that must each earn 0 (issue 27)."""
