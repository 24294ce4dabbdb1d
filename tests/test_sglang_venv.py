"""The CPU SGLang venv is cached by recipe key: reused while the key holds, rebuilt when it changes or forced."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchgym.backends.inference import sglang_venv


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records builds instead of running pip; a "build" leaves a ready venv as the real one does."""
    done: list[Path] = []

    def fake_build(venv: Path, progress: object) -> None:
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").touch()
        (venv / sglang_venv.READY_MARKER).write_text(f"{sglang_venv.recipe_key()} 0.5 2.13\n")
        done.append(venv)

    monkeypatch.setattr(sglang_venv, "_build", fake_build)
    return done


def test_the_key_covers_versions_exclusions_stubs_and_build_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    key = sglang_venv.recipe_key()
    assert sglang_venv.default_venv_path().name == f"sglang-{sglang_venv.SGLANG_VERSION}-venv-{key}"
    for name, value in [
        ("SGLANG_VERSION", "0.0.1"),
        ("TORCH_VERSION", "0.0.1"),
        ("EXCLUDED_PREFIXES", ("cuda-",)),
        ("STUB_SOURCE", "# other stubs"),
        ("BUILD_STEPS", sglang_venv.BUILD_STEPS + "# another step"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(sglang_venv, name, value)
            assert sglang_venv.recipe_key() != key, name
    assert sglang_venv.recipe_key() == key
    assert "_pip(python" in sglang_venv.BUILD_STEPS  # the steps' source, not just their names


def test_reused_while_the_key_holds_rebuilt_when_it_changes_or_forced(
    tmp_path: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "venv"
    assert sglang_venv.build_sglang_venv(venv) == venv and builds == [venv]
    sglang_venv.build_sglang_venv(venv)
    assert len(builds) == 1  # cached
    sglang_venv.build_sglang_venv(venv, fresh=True)
    assert len(builds) == 2  # forced
    monkeypatch.setattr(sglang_venv, "SGLANG_VERSION", "0.0.1")
    assert not sglang_venv.is_ready(venv)  # built by another recipe
    sglang_venv.build_sglang_venv(venv)
    assert len(builds) == 3
