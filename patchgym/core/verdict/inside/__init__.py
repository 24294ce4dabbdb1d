"""Scripts the grader copies into a sandbox (standard library only, Python >= 3.6)."""
