"""`patchgym run` fails fast and never writes into an earlier run by accident; options are
discoverable; output fits a log file or a terminal. (Whole runs: tests/test_pipeline.py.)"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner, Result

from patchgym.cli import _claim_run_dir, app
from patchgym.core.errors import ConfigError
from patchgym.core.plugins import reset_registry
from patchgym.pipeline.progress import LineProgress
from tests.pipeline_support import merged, run_config

runner = CliRunner()
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    reset_registry()
    yield
    reset_registry()


def text(result: Result) -> str:
    return " ".join(ANSI.sub("", result.output).split())


def write(tmp_path: Path, changes: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(merged(run_config(tmp_path, steps=1), changes)))
    return path


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"tasks": {"train": {"name": "esay"}}}, "unknown task set 'esay'; known: "),
    (
        {"tasks": {"eval": {"options": {"cont": 2}}}},
        "invalid options for task set 'easy': cont: unknown option; valid options: count=64, seed=0",
    ),
    ({"tasks": {"train": {"options": {"split": "test"}}}}, "split: Input should be 'train' or 'eval'"),
    ({"sandbox": {"name": "local", "options": {"isolaton": "none"}}}, "isolaton: unknown option; valid options: "),
    ({"sandbox": {"name": "dokcer"}}, "unknown sandbox backend 'dokcer'"),
    ({"inference": {"options": {"max_batch": 8}}}, "invalid options for inference backend 'embedded': max_batch"),
    ({"trainer": {"options": {"lr": "fast"}}}, "invalid options for trainer backend 'embedded': lr: "),
    ({"model": {"path": "/nonexistent/model"}}, "model.path '/nonexistent/model' is not a folder"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CONFIGS)
def test_config_mistakes_are_found_before_anything_is_written(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    result = runner.invoke(app, ["run", str(write(tmp_path, changes))])
    assert result.exit_code == 2 and message in text(result), text(result)
    assert not (tmp_path / "run").exists()  # no run dir, config.yaml, events.jsonl or model


def test_a_second_run_into_a_used_run_dir_asks_for_resume_or_overwrite(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text('{"kind": "run"}\n')
    result = runner.invoke(app, ["run", str(write(tmp_path, {}))])
    assert result.exit_code == 2, result.output
    assert "is not empty" in text(result) and f"--resume {run}" in text(result) and "--overwrite" in text(result)
    assert (run / "events.jsonl").read_text() == '{"kind": "run"}\n'  # untouched


def test_overwrite_empties_an_earlier_run_but_never_a_folder_that_is_not_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "state.json").write_text("{}")
    _claim_run_dir(run, overwrite=True)
    assert not run.exists()
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no patchgym run"):
        _claim_run_dir(other, overwrite=True)
    assert (other / "notes.txt").exists()
    _claim_run_dir(tmp_path / "new", overwrite=False)  # absent or empty: fine


def test_plugins_options_lists_a_parts_options() -> None:
    result = runner.invoke(app, ["plugins", "--options", "easy"])
    assert result.exit_code == 0, result.output
    assert all(word in text(result) for word in ("count", "split", "cache_dir", "tasks to generate"))
    listing = json.loads(runner.invoke(app, ["plugins", "--options", "local", "--json"]).stdout)
    options = {row["option"]: row for row in listing[0]["options"]}
    assert listing[0]["kind"] == "sandbox" and options["isolation"]["default"] == "auto"
    missing = runner.invoke(app, ["plugins", "--options", "nothing-by-this-name"])
    assert missing.exit_code == 2 and "nothing is registered" in text(missing)


def test_a_bad_task_set_option_lists_the_valid_ones() -> None:
    result = runner.invoke(app, ["tasks", "list", "easy", "-o", "cont=3"])
    assert result.exit_code == 2
    assert "unexpected keyword argument 'cont'" in text(result) and "valid options: count=64" in text(result)


def test_env_play_never_splits_a_long_line() -> None:
    long = "x" * 300
    result = runner.invoke(app, ["env", "play", "tiny", "roman-subtractive"], input=f"echo {long}\nquit\n")
    assert result.exit_code == 0, result.output
    assert long in result.output  # one line, however narrow the console


def test_the_result_table_names_k(tmp_path: Path) -> None:
    from patchgym.pipeline.config import RunConfig
    from patchgym.pipeline.run import Pipeline

    config = RunConfig.model_validate(merged(run_config(tmp_path, steps=1), {"eval": {"attempts": 4}}))
    out = io.StringIO()
    pipeline = Pipeline(config, console=Console(file=out, width=200))
    pipeline.results = {"base": {"pass_at_1": 0.25, "pass_at_k": 0.5, "k": 4, "tasks": 2}}
    pipeline._print_results()
    assert "pass@4" in out.getvalue() and "pass@k" not in out.getvalue()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 120  # a bound for a loaded machine, not a timing assumption
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_without_a_terminal_progress_is_a_plain_line_at_a_steady_interval() -> None:
    stream = io.StringIO()
    with LineProgress(0.05, stream=stream) as progress:
        bar = progress.add_task("grpo", total=10, completed=2, initial=2, unit="step")
        progress.update(bar, advance=3, reward=0.5, pass_rate=0.25)
        wait_for(lambda: stream.getvalue().count("\n") >= 2)  # written by the interval, not by the bar's end
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3
    line = lines[-1]
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d grpo: step 5/10, [\d.e+]+ step/min, ETA \d+s, reward 0\.500, pass 25%", line
    ), line


STUCK_WORKER = """
import sys
import threading
from patchgym import cli
from patchgym.core.errors import InfraError

@cli.app.command("fail-stuck")
@cli.friendly_errors
def fail_stuck():
    # a worker blocked for good, as a trainer thread in a rendezvous with a killed engine is
    threading.Thread(target=threading.Event().wait, name="blocked-worker").start()
    raise InfraError("sglang-engine-1 exited")

sys.argv = ["patchgym", "fail-stuck"]
cli.main()
"""


def test_a_failed_command_exits_even_when_a_worker_thread_is_stuck() -> None:
    """Without the exit, the interpreter would join the blocked thread forever (a hung run)."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", STUCK_WORKER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=300)  # generous: a hang never ends
    finally:
        process.kill()
    assert process.returncode == 2 and "error: sglang-engine-1 exited" in output, output
