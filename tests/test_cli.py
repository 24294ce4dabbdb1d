"""The `patchgym` command (patchgym.cli), driven with typer's CliRunner on the built-in tasks."""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from patchgym.cli import app
from patchgym.core.plugins import BUILTIN_PLUGINS, reset_registry
from patchgym.plugins.folder import TINY_TASKS

TINY_IDS = sorted(p.name for p in TINY_TASKS.iterdir() if (p / "task.json").is_file())
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
runner = CliRunner()


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("PATCHGYM_PLUGINS", raising=False)
    monkeypatch.delenv("PATCHGYM_DISABLE_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()


def invoke(*args: str, input: str | None = None) -> Result:
    return runner.invoke(app, list(args), input=input)


def text(result: Result) -> str:
    """The output without colour codes, with rich's line wrapping undone."""
    return " ".join(ANSI.sub("", result.output).split())


def copy_task(task_id: str, dest: Path, new_id: str | None = None) -> Path:
    folder = dest / (new_id or task_id)
    shutil.copytree(TINY_TASKS / task_id, folder)
    if new_id:
        spec = json.loads((folder / "task.json").read_text())
        spec["id"] = new_id
        (folder / "task.json").write_text(json.dumps(spec))
    return folder


# -- plugins -------------------------------------------------------------------------------------


def test_plugins_json_lists_builtins() -> None:
    result = invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    records = {r["name"]: r for r in report["plugins"]}
    assert set(BUILTIN_PLUGINS) <= set(records)
    assert records["builtin-tasks"]["status"] == "loaded"
    task_sets = {"tiny", "folder", "easy", "locate", "mix"}
    assert set(records["builtin-tasks"]["registered"]) == {f"task set:{name}" for name in task_sets}
    assert records["builtin-sandboxes"]["registered"] == [
        "sandbox backend:local",
        "sandbox backend:docker",
        "sandbox backend:e2b",
        "sandbox backend:harbor",
    ]
    assert report["conflicts"] == []


def test_plugins_table_lists_names_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHGYM_PLUGINS", "")  # built-ins only: CI also installs examples/acme-patchgym
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    out = text(result)
    task_sets = re.search(r"task sets: ([\w, -]+?) sandbox backends", out)
    assert task_sets and {"easy", "folder", "synthetic", "tiny"} <= set(task_sets.group(1).split(", "))
    assert "sandbox backends: docker, e2b, harbor, local" in out
    assert "builtin-tasks" in out and "loaded" in out


# -- tasks list ----------------------------------------------------------------------------------


def test_tasks_list_tiny_json() -> None:
    result = invoke("tasks", "list", "tiny", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["id"] for row in rows] == TINY_IDS
    assert len(rows) == 6
    assert all(row["title"] for row in rows)


def test_tasks_list_table() -> None:
    result = invoke("tasks", "list", "tiny")
    assert result.exit_code == 0, result.output
    out = text(result)
    assert "6 tasks" in out
    assert all(task_id in out for task_id in TINY_IDS)


def test_tasks_list_folder_path(tmp_path: Path) -> None:
    copy_task("roman-subtractive", tmp_path / "myset")
    result = invoke("tasks", "list", str(tmp_path / "myset"), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["id"] for row in rows] == ["roman-subtractive"]
    issue = (TINY_TASKS / "roman-subtractive" / "issue.md").read_text().strip().splitlines()[0]
    assert rows[0]["title"] == issue.lstrip("# ")


def test_tasks_list_empty_folder_is_a_friendly_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = invoke("tasks", "list", str(tmp_path / "empty"))
    assert result.exit_code == 2
    assert "no task folders" in text(result)


def test_tasks_list_folder_without_a_path_is_a_friendly_error() -> None:
    result = invoke("tasks", "list", "folder")
    assert result.exit_code == 2, result.output
    out = text(result)
    assert "error:" in out and "path" in out
    assert "Traceback" not in result.output


def test_unknown_task_set_exits_2_listing_known_names() -> None:
    result = invoke("tasks", "list", "nosuchset")
    assert result.exit_code == 2
    out = text(result)
    assert "error:" in out and "nosuchset" in out
    assert "folder" in out and "tiny" in out
    assert "Traceback" not in result.output


# -- tasks validate ------------------------------------------------------------------------------


def test_validate_tiny_all_valid() -> None:
    result = invoke("tasks", "validate", "tiny", "--sandbox", "local", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["valid"] is True
    assert sorted(t["task_id"] for t in report["tasks"]) == TINY_IDS
    for task in report["tasks"]:
        assert task["valid"] is True, task
        assert task["gold_reward"] == 1.0 and task["empty_reward"] == 0.0, task
        assert task["problems"] == []


def test_validate_limit() -> None:
    result = invoke("tasks", "validate", "tiny", "--limit", "2", "--json")
    assert result.exit_code == 0, result.output
    tasks = json.loads(result.stdout)["tasks"]
    assert [t["task_id"] for t in tasks] == TINY_IDS[:2]


def test_validate_folder_with_broken_tasks_exits_1_and_names_the_problems(tmp_path: Path) -> None:
    tasks = tmp_path / "broken"
    # A gold patch that applies but no longer fixes the bug (the + line equals the - line).
    no_fix = copy_task("roman-subtractive", tasks, "roman-nofix")
    gold = (no_fix / "gold.patch").read_text()
    fixed_line = "+        if index < last and value < _SYMBOLS.get(text[index + 1], 0):"
    assert fixed_line in gold
    (no_fix / "gold.patch").write_text(
        gold.replace(fixed_line, "+" + fixed_line[1:].replace("last and", "last - 1 and"))
    )
    # A FAIL_TO_PASS test that does not exist.
    wrong_id = copy_task("roman-subtractive", tasks, "roman-wrongid")
    spec = json.loads((wrong_id / "task.json").read_text())
    spec["fail_to_pass"].append("tests.test_roman.FromRomanTests.test_no_such_test")
    (wrong_id / "task.json").write_text(json.dumps(spec))
    # And one intact task.
    copy_task("stats-percentile", tasks)

    result = invoke("tasks", "validate", str(tasks), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["valid"] is False
    by_id = {t["task_id"]: t for t in report["tasks"]}
    assert set(by_id) == {"roman-nofix", "roman-wrongid", "stats-percentile"}

    nofix = by_id["roman-nofix"]
    assert nofix["valid"] is False and nofix["gold_reward"] == 0.0 and nofix["empty_reward"] == 0.0
    assert any("gold patch got reward 0.0, expected 1.0" in p for p in nofix["problems"]), nofix

    wrong = by_id["roman-wrongid"]
    assert wrong["valid"] is False and wrong["gold_reward"] == 0.0
    assert any("gold patch" in p for p in wrong["problems"]), wrong

    assert by_id["stats-percentile"]["valid"] is True


def test_validate_table_output_on_failure(tmp_path: Path) -> None:
    folder = copy_task("roman-subtractive", tmp_path / "nogold")
    (folder / "gold.patch").unlink()
    result = invoke("tasks", "validate", str(tmp_path / "nogold"))
    assert result.exit_code == 1, result.output
    out = text(result)
    assert "0/1 tasks valid" in out
    assert "NO" in out


def test_validate_rejects_a_negative_limit() -> None:
    result = invoke("tasks", "validate", "tiny", "--limit", "-1", "--json")
    assert result.exit_code == 2, result.output
    assert "task_id" not in result.output


def test_errors_are_not_read_as_rich_markup(tmp_path: Path) -> None:
    folder = tmp_path / "badset" / "t1"
    (folder / "repo").mkdir(parents=True)
    (folder / "task.json").write_text(json.dumps({"id": "t1", "fail_to_pass": "[bold]not-a-list[/bold]"}))
    result = invoke("tasks", "list", str(tmp_path / "badset"))
    assert result.exit_code == 2, result.output
    # pydantic's "[type=list_type, ...]" and the input value's brackets are shown, not swallowed as markup.
    assert "[type=list_type" in result.output
    assert "[bold]not-a-list[/bold]" in result.output


def test_validate_unknown_sandbox_exits_2_listing_known_names() -> None:
    result = invoke("tasks", "validate", "tiny", "--sandbox", "nosuchbox")
    assert result.exit_code == 2
    out = text(result)
    assert "nosuchbox" in out and "sandbox backend" in out and "local" in out
    assert "Traceback" not in result.output


def test_validate_unknown_task_set_exits_2() -> None:
    result = invoke("tasks", "validate", "nosuchset")
    assert result.exit_code == 2
    assert "nosuchset" in text(result) and "tiny" in text(result)


# -- env play ------------------------------------------------------------------------------------


def _reward(result: Result) -> str:
    found = re.findall(r"episode ended: (\S+); reward (\S+)", ANSI.sub("", result.output))
    assert len(found) == 1, result.output
    return found[0]


def test_env_play_gold_patch_then_submit_earns_reward_1() -> None:
    patch = (TINY_TASKS / "roman-subtractive" / "gold.patch").read_text()
    # The prompt reads one line per command, so the patch travels base64-encoded on one line.
    encoded = base64.b64encode(patch.encode()).decode()
    apply = f"echo {encoded} | base64 -d | git apply && echo APPLIED-OK"
    result = invoke("env", "play", "tiny", "roman-subtractive", input=f"{apply}\n\nsubmit\n")
    assert result.exit_code == 0, result.output
    assert "APPLIED-OK" in result.output
    assert "<returncode>0</returncode>" in result.output
    assert _reward(result) == ("submitted", "1.0")
    assert "fail_to_pass: 2/2 passing" in result.output


def test_env_play_submit_without_fix_earns_reward_0() -> None:
    result = invoke("env", "play", "tiny", "roman-subtractive", input="submit\n")
    assert result.exit_code == 0, result.output
    assert _reward(result) == ("submitted", "0.0")
    assert "fail_to_pass: 0/2 passing" in result.output


def test_env_play_eof_ends_the_episode_gracefully() -> None:
    result = invoke("env", "play", "tiny", "roman-subtractive", input="")
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert _reward(result) == ("quit", "0.0")


def test_env_play_shows_the_issue_and_command_output() -> None:
    issue = (TINY_TASKS / "roman-subtractive" / "issue.md").read_text().strip().splitlines()[0]
    result = invoke("env", "play", "tiny", "roman-subtractive", input="echo hi-from-$((40+2))\nquit\n")
    assert result.exit_code == 0, result.output
    assert issue in result.output
    assert "hi-from-42" in result.output
    assert _reward(result) == ("quit", "0.0")


def test_env_play_shows_command_output_verbatim() -> None:
    """Brackets in what the agent sees (code, test output) are printed as they are, not read as markup."""
    commands = 'grep -n "index + 1" roman/__init__.py\necho "a[/]b [bold]c"\nquit\n'
    result = invoke("env", "play", "tiny", "roman-subtractive", input=commands)
    assert result.exit_code == 0, result.output
    assert "_SYMBOLS.get(text[index + 1], 0)" in result.output
    assert "a[/]b [bold]c" in result.output
    assert _reward(result) == ("quit", "0.0")


def test_env_play_unknown_task_exits_2() -> None:
    result = invoke("env", "play", "tiny", "no-such-task", input="")
    assert result.exit_code == 2, result.output
    out = text(result)
    assert "no-such-task" in out and "roman-subtractive" in out


def test_env_play_unknown_sandbox_exits_2() -> None:
    result = invoke("env", "play", "tiny", "roman-subtractive", "--sandbox", "nosuchbox", input="")
    assert result.exit_code == 2, result.output
    assert "nosuchbox" in text(result) and "local" in text(result)


def test_sandbox_options_are_parsed_and_checked(tmp_path: Path) -> None:
    from patchgym.cli import parse_options

    assert parse_options(["isolation=none", "io_workers=3", "flag=true", "name="]) == {
        "isolation": "none",
        "io_workers": 3,
        "flag": True,
        "name": "",
    }
    result = runner.invoke(app, ["tasks", "validate", "tiny", "--limit", "1", "--sandbox-option", "isolation=none"])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(app, ["tasks", "validate", "tiny", "--sandbox-option", "isolaton=none"])
    assert bad.exit_code == 2 and "isolaton" in bad.output
    malformed = runner.invoke(app, ["tasks", "validate", "tiny", "--sandbox-option", "novalue"])
    assert malformed.exit_code == 2 and "expected KEY=VALUE" in malformed.output
