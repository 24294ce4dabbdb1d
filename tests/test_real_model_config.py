"""configs/real-small.yaml (a small real chat model on one GPU, real SWE tasks) validates and dry-runs
without downloading anything; `model.path` takes a Hub id or a folder the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchgym.core.errors import ConfigError
from patchgym.launch.memory import ModelDims
from patchgym.pipeline.checks import check_config, check_files
from patchgym.pipeline.config import RunConfig, load_run_config
from patchgym.pipeline.model_source import cached_model, fetch_model, is_hub_id, split_revision

REAL_SMALL = Path(__file__).resolve().parent.parent / "configs" / "real-small.yaml"
QWEN25_05B_PARAMETERS = 494_032_768
"""Qwen/Qwen2.5-0.5B-Instruct's parameter count on the Hub (its safetensors metadata; not downloaded here)."""


def test_hub_ids_and_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/model@v1.0")
    assert split_revision("org/model@v1.0") == ("org/model", "v1.0")
    for not_hub in ("/models/qwen", "./qwen/x", "qwen", "a/b/c", "../a/b"):
        assert not is_hub_id(not_hub), not_hub
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model")  # a folder here wins over a Hub id spelt the same
    assert fetch_model("org/model") == Path("org/model") and cached_model("org/model") == Path("org/model")


def test_a_model_path_that_is_neither_is_refused(tmp_path: Path) -> None:
    base = {"tasks": {"train": {"name": "easy"}, "eval": {"name": "easy"}}}
    check_files(RunConfig.model_validate({**base, "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}}))
    with pytest.raises(ConfigError, match="is not a folder .a Hugging Face model. nor a Hub id"):
        check_files(RunConfig.model_validate({**base, "model": {"path": str(tmp_path / "missing")}}))


def test_fetching_an_unknown_hub_id_offline_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="is a Hub id, but it could not be fetched"):
        fetch_model("patchgym-test/no-such-model")
    assert cached_model("patchgym-test/no-such-model") is None


def test_real_small_validates_and_checks_every_part() -> None:
    config = load_run_config(REAL_SMALL)
    assert is_hub_id(config.model.path or "")
    assert (config.trainer.name, config.inference.name) == ("embedded", "embedded")
    assert config.trainer.options["device"] == config.inference.options["device"] == "auto"
    check_config(config)  # every name and option against the factories; the Hub id needs no folder here


def test_real_small_hf_config_is_the_hub_models_shape() -> None:
    config = load_run_config(REAL_SMALL)
    dims = ModelDims.from_hf(config.model.hf_config or {})
    layers, head_dim = dims.shape.layers, dims.head_dim
    biases = layers * (dims.hidden + 2 * dims.shape.kv_heads * head_dim)  # Qwen2 has q, k, v biases ...
    qk_norms = layers * 2 * head_dim  # ... and no q/k norms (Qwen3's, which the estimate counts)
    assert dims.total_params() + biases - qk_norms == QWEN25_05B_PARAMETERS


def test_real_small_dry_run_downloads_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from patchgym.pipeline.dry_run import plan_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = load_run_config(REAL_SMALL)
    plan = plan_run(config, ["patchgym", "run", str(REAL_SMALL)])
    assert [p.name for p in plan.processes] == ["driver"]  # engine and trainer run in the driver, on its GPU
    notes = " ".join(plan.notes)
    assert "is a Hub id: the run downloads it" in notes
    assert "would stop" not in notes  # nothing the run checks first fails
    assert not (tmp_path / "hf").exists()


def test_a_hub_id_is_fetched_once_and_every_part_gets_the_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> None:
    pytest.importorskip("torch")
    import huggingface_hub

    from patchgym.pipeline.run import Pipeline

    calls = []

    def snapshot_download(repo_id: str, *, revision: str | None, allow_patterns: list[str]) -> str:
        calls.append((repo_id, revision, allow_patterns))
        return str(tiny_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    base = {"run_dir": str(tmp_path / "run"), "tasks": {"train": {"name": "easy"}, "eval": {"name": "easy"}}}
    config = RunConfig.model_validate({**base, "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct@main"}})
    pipeline = Pipeline(config)
    assert pipeline._model_path() == tiny_model_dir  # the folder the engine, trainer and ranks load
    assert calls == [("Qwen/Qwen2.5-0.5B-Instruct", "main", ["*.json", "*.safetensors", "*.model", "*.txt",
                                                              "*.tiktoken", "*.jinja"])]  # fmt: skip
    local = RunConfig.model_validate({**base, "model": {"path": str(tiny_model_dir)}})
    assert Pipeline(local)._model_path() == tiny_model_dir and len(calls) == 1  # a folder is used as it is
