"""Real SWE-bench Lite rows and their repositories, shipped as test fixtures.

`tests/fixtures/swebench/lite_rows.jsonl` holds two rows of SWE-bench Lite's test split,
unchanged: `pallets__flask-4045` (log parser `parse_log_pytest`, Python 3.9, a requirements
file) and `pylint-dev__pylint-5859` (`parse_log_pytest_options`, Python 3.9, requirements with
`-r` includes). Each `OWNER__NAME.git.tar.gz` is a bare repository holding only the rows'
`base_commit` and `environment_setup_commit` (a shallow fetch of each), so the harness's
commit ids are real and the archives stay small.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "swebench"
ROWS = FIXTURES / "lite_rows.jsonl"
FLASK, PYLINT = "pallets__flask-4045", "pylint-dev__pylint-5859"


def lite_rows() -> dict[str, dict[str, Any]]:
    """The fixture rows by instance id."""
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    return {row["instance_id"]: row for row in rows}


def extract_sources(folder: Path) -> Path:
    """The repositories unpacked under `folder` as `OWNER__NAME.git` (a `--repos-dir`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for archive in sorted(FIXTURES.glob("*.git.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    return folder
