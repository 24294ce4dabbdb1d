"""A quiet console: library warnings and logging, and children's stderr, go to RUN_DIR/library.log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from patchgym.logs import LIBRARY_LOG, library_output_to
from tests.pipeline_support import run_config


def test_warnings_logging_and_child_stderr_reach_the_log_not_the_console(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with library_output_to(tmp_path) as log:
        warnings.warn("a library FutureWarning", FutureWarning, stacklevel=1)
        logging.getLogger("megatron.core.fake").warning("a library log record")
        os.write(2, b"a C-level message\n")
        subprocess.run([sys.executable, "-c", "import sys; print('a rank process stderr line', file=sys.stderr)"])
        logging.getLogger("patchgym.test").warning("a patchgym warning")
    with pytest.raises(RuntimeError), library_output_to(tmp_path):
        raise RuntimeError("the run failed")  # the error that ends a run reaches the console afterwards
    print("after", file=sys.stderr)
    console = capfd.readouterr()
    text = log.read_text()
    for line in ("a library FutureWarning", "a library log record", "a C-level message", "a rank process stderr line"):
        assert line in text and line not in console.err + console.out
    assert "FutureWarning" in text and "megatron.core.fake WARNING" in text
    assert "a patchgym warning" in console.err  # patchgym's own warnings stay on the console
    assert console.err.endswith("after\n")  # stderr is the console again after the block


def test_progress_lines_reach_the_console_not_the_log(tmp_path: Path) -> None:
    """Run without a terminal, the progress lines went to library.log with the rest of stderr."""
    code = (
        "import sys; from pathlib import Path; from patchgym.logs import library_output_to\n"
        "from patchgym.pipeline.progress import LineProgress\n"
        "with library_output_to(Path(sys.argv[1])), LineProgress(3600) as progress:\n"
        "    progress.add_task('grpo', total=4, unit='step')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "grpo: step 0/4" in done.stderr and "grpo" not in (tmp_path / LIBRARY_LOG).read_text()


def test_a_megatron_run_prints_no_library_warnings(tmp_path: Path) -> None:
    """`patchgym run` with the Megatron trainer: progress and results on the console, library noise in the log."""
    pytest.importorskip("megatron.core")
    config = run_config(tmp_path, steps=1, sft=False, changes={"trainer": {"name": "megatron", "options": {}}})
    config["metrics"] = {"tensorboard": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    cwd = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "patchgym.cli", "run", str(path)], capture_output=True, text=True, cwd=cwd
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "grpo: step 1/1" in done.stderr  # the progress lines of a run without a terminal
    assert "grpo" in done.stdout and "Warning" not in console and "warnings.warn" not in console, console
    library = (Path(config["run_dir"]) / LIBRARY_LOG).read_text()
    assert "UserWarning" in library and "megatron" in library
