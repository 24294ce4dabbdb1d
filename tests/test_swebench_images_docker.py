"""Real SWE-bench Lite rows (tests/swebench_lite.py) built by `tasks build-images` and graded on
Docker: gold 1, empty 0, and the verdicts and statuses swebench's own grading functions give on
the same test logs.

Needs Docker and, the first time, PyPI (wheels) and a Debian mirror (the Python 3.9 base). The
wheels and locks go to the default cache and the images are labelled with their content key,
so a later run (CI's next one) builds nothing: it finds both images up to date, offline.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from patchgym.cli import app
from patchgym.core.sandbox import SandboxBackend
from patchgym.core.validation import validate_task
from patchgym.plugins.swe_grading import SWELogGrader, _test_spec
from patchgym.plugins.swebench import SWEBenchTaskSet
from tests.conftest import require_docker
from tests.swebench_lite import FLASK, PYLINT, ROWS, extract_sources, lite_rows

pytestmark = pytest.mark.timeout(3600)  # the first run fetches wheels, builds a base and two images


@dataclass(frozen=True)
class RecordingGrader(SWELogGrader):
    """The grader, keeping the whole log it judged in the grade's details (`judged_log`)."""

    def _verdict(self, log: str, exit_code: int | None, *, timed_out: bool, details: dict[str, Any]) -> Any:
        details["judged_log"] = log
        return super()._verdict(log, exit_code, timed_out=timed_out, details=details)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The command's JSON reports: a first run (builds what is not up to date), then an offline rerun."""
    require_docker()
    import docker

    from patchgym.plugins.swebench_images.bases import base_tag

    client = docker.from_env()
    try:
        client.images.get(base_tag("3.9"))
    except docker.errors.ImageNotFound:
        if os.geteuid() != 0 and os.environ.get("CI") != "true":
            pytest.skip(f"building {base_tag('3.9')} with debootstrap needs root")
    finally:
        client.close()
    sources = extract_sources(tmp_path_factory.mktemp("sources"))
    command = ["tasks", "build-images", "swebench", "-o", f"path={ROWS}", "--repos-dir", str(sources), "--json"]
    first = CliRunner().invoke(app, command)
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, [*command, "--offline"])
    assert again.exit_code == 0, again.output
    return json.loads(first.output)["images"], json.loads(again.output)["images"]


@pytest.fixture
async def backend() -> AsyncIterator[SandboxBackend]:
    from patchgym.backends.sandbox.docker import DockerSandboxBackend

    made = DockerSandboxBackend(concurrency=4)
    yield made
    await made.aclose()


def test_images_are_named_as_the_harness_names_them_and_rebuilt_only_when_changed(
    builds: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    first, again = builds
    rows = lite_rows()
    for report in first:
        spec = _test_spec(report["instance_id"], rows[report["instance_id"]]["repo"], "", [], [])
        assert report["image"] == spec.instance_image_key  # sweb.eval.x86_64.<id>:latest
        assert report["status"] in ("built", "cached"), report
    assert [(r["instance_id"], r["status"]) for r in again] == [(r["instance_id"], "cached") for r in first]


@pytest.mark.parametrize("instance_id", [FLASK, PYLINT])
def test_the_image_holds_the_base_commit_and_an_offline_environment(
    builds: tuple[list[dict[str, Any]], list[dict[str, Any]]], instance_id: str
) -> None:
    import docker

    (report,) = [r for r in builds[0] if r["instance_id"] == instance_id]
    script = (
        "git rev-parse HEAD~1; git log -1 --format=%s; git status --porcelain; git rev-list --all | wc -l; "
        "python --version; source /opt/miniconda3/bin/activate && conda activate testbed && echo $VIRTUAL_ENV; "
        "python -m pip config list; python -m pip install -q -e . >/dev/null 2>&1 && echo reinstalled"
    )
    client = docker.from_env()
    try:
        out = client.containers.run(report["image"], ["bash", "-c", script], network_mode="none", remove=True)
    finally:
        client.close()
    lines = out.decode().splitlines()
    assert lines[0] == lite_rows()[instance_id]["base_commit"]  # the harness commits its set-up on top
    assert lines[1:3] == ["SWE-bench", "2"], lines  # a clean tree; no history after the base commit
    assert lines[3].startswith("Python 3.9") and lines[4] == "/opt/miniconda3/envs/testbed"
    assert "global.no-index='true'" in lines and "global.find-links='/opt/patchgym/wheels'" in lines
    assert lines[-1] == "reinstalled"  # the specs' install step again, offline (the task set's reinstall)


@pytest.mark.parametrize("instance_id", [FLASK, PYLINT])
async def test_real_rows_validate_and_agree_with_swebenchs_grading(
    builds: tuple[list[dict[str, Any]], list[dict[str, Any]]], backend: SandboxBackend, instance_id: str, tmp_path: Path
) -> None:
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
    from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status

    (task,) = SWEBenchTaskSet(str(ROWS), namespace="", ids=instance_id)
    assert task.sandbox.image == next(r["image"] for r in builds[0] if r["instance_id"] == instance_id)
    grader = RecordingGrader(**{f.name: getattr(task.grader, f.name) for f in fields(SWELogGrader)})
    report = await validate_task(backend, replace(task, grader=grader))
    assert report.valid, report.problems
    assert report.gold and report.empty
    row = lite_rows()[instance_id]
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    for grade, expected in ((report.gold, "RESOLVED_FULL"), (report.empty, "RESOLVED_NO")):
        assert grade.details["resolution"] == expected
        log_file = tmp_path / f"{expected}.txt"
        log = grade.details["judged_log"]
        log_file.write_text(f"+ git apply -v -\n+ : '{START_TEST_OUTPUT}'\n{log}\n+ : '{END_TEST_OUTPUT}'\n")
        spec = _test_spec(instance_id, row["repo"], row["version"], f2p, p2p)
        status_map, found = get_logs_eval(spec, str(log_file))
        assert found and status_map == {name: str(status) for name, status in grade.tests.items()}
        harness = get_resolution_status(get_eval_tests_report(status_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}))
        assert harness == grade.details["resolution"]
