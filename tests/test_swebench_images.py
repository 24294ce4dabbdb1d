"""`tasks build-images swebench` without Docker: recipes from the specs, repository sources,
wheel selection, image keys and the command's errors (the builds themselves:
tests/test_swebench_images_docker.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.backends.sandbox.docker import DEFAULT_IMAGE
from patchgym.cli import app
from patchgym.core.errors import BuildError, ConfigError
from patchgym.plugins.swebench_images.bases import Base
from patchgym.plugins.swebench_images.build import image_key
from patchgym.plugins.swebench_images.recipe import (
    PROJECT,
    Recipe,
    make_recipe,
    pip_requirements,
    project_requirement,
    requirements_text,
)
from patchgym.plugins.swebench_images.sources import RepoSources, checkout
from patchgym.plugins.swebench_images.wheels import Lock, Target, files_for, lock_key, sdist_build_requirements
from tests.conftest import require_docker
from tests.swebench_lite import FLASK, PYLINT, ROWS, extract_sources, lite_rows


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> RepoSources:
    return RepoSources({}, extract_sources(tmp_path_factory.mktemp("sources")))


def recipe_of(instance_id: str, sources: RepoSources, **changes: object) -> Recipe:
    row = lite_rows()[instance_id]
    return make_recipe({**row, **changes}, sources.reader(row["repo"]))


# -- recipes ---------------------------------------------------------------------------------


def test_the_repository_script_is_the_harnesss_own_but_the_clone(sources: RepoSources) -> None:
    from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.test_spec.python import make_repo_script_list_py

    row = lite_rows()[FLASK]
    harness = make_repo_script_list_py(
        MAP_REPO_VERSION_TO_SPECS[row["repo"]][row["version"]], row["repo"], "/testbed", row["base_commit"], "testbed"
    )
    recipe = recipe_of(FLASK, sources)
    assert harness[0].startswith("git clone ") and not recipe.repo_script[0].startswith("git")
    assert list(recipe.repo_script[1:]) == harness[1:]
    assert "python -m pip install -e ." in recipe.repo_script
    assert recipe.script(recipe.repo_script).startswith("#!/bin/bash\nset -euxo pipefail\n")


def test_requirements_come_from_the_environment_commit_as_the_harness_reads_them(sources: RepoSources) -> None:
    """flask 2.0: requirements/dev.txt at environment_setup_commit (not at base_commit)."""
    row = lite_rows()[FLASK]
    recipe = recipe_of(FLASK, sources)
    text = recipe.files["requirements.txt"]
    assert "pytest==6.2.5" in text and "blinker==1.4" in text
    read = sources.reader(row["repo"])
    at_env = read(row["environment_setup_commit"], "requirements/dev.txt")
    assert at_env is not None
    requirements = {line for line in at_env.split("\n") if line and not line.strip().startswith("#")}
    assert set(text.split("\n")) - {""} == requirements
    assert read(row["base_commit"], "requirements/dev.txt") != at_env  # so the commit matters
    assert recipe.env_script == (
        "python3.9 -m venv /opt/miniconda3/envs/testbed",
        "source /opt/miniconda3/bin/activate",
        "conda activate testbed",
        "python -m pip install --upgrade pip setuptools wheel",
        "python -m pip install -r /root/requirements.txt",
        "rm /root/requirements.txt",
        "python -m pip install setuptools==70.0.0 Werkzeug==2.3.7 Jinja2==3.0.1 itsdangerous==2.1.2 click==8.0.1 "
        "MarkupSafe==2.1.3",
    )
    assert [step.name for step in recipe.steps] == ["environment", "requirements", "pip_packages", "install"]
    install = recipe.steps[-1].requirements
    assert install[0] == f"-e {PROJECT}" and "setuptools>=40.8.0" in install  # flask 2.0 has no pyproject.toml


def test_included_requirement_files_are_inlined_and_cleaned_as_the_harness_does(sources: RepoSources) -> None:
    """pylint 2.13: requirements_test.txt includes two files with -r; `-e .` lines go;
    swebench's clean_requirements swaps the yanked types-pkg_resources for types-setuptools."""
    row = lite_rows()[PYLINT]
    text = requirements_text(row["repo"], row["environment_setup_commit"], sources.reader(row["repo"]))
    lines = text.splitlines()
    assert "black==22.3.0" in lines and "astroid==2.11.3  # Pinned to a specific version for tests" in lines
    assert not any(line.startswith(("-r", "-e .")) for line in lines)
    assert "types-setuptools" in lines and not any("types-pkg_resources" in line for line in lines)


def test_conda_packages_become_pip_requirements() -> None:
    assert pip_requirements("'numpy==1.19.2' scipy=1.5 pytest 'pandas<2.0.0'") == [
        "numpy==1.19.2",
        "scipy==1.5.*",
        "pytest",
        "pandas<2.0.0",
    ]
    assert project_requirement("python -m pip install -e '.[dev]'") == f"-e {PROJECT}[dev]"
    assert project_requirement("python -m pip install -v --no-build-isolation .") == PROJECT


@pytest.mark.parametrize(
    ("repo", "version", "message"),
    [
        ("pydata/xarray", "0.12", "conda"),  # environment.yml
        ("pylint-dev/pylint", "2.8", "apt-get"),  # pre_install installs Debian packages
        ("django/django", "1.4", "not `python -m pip install"),  # python setup.py install
        ("pallets/flask", "0.1", "no specs"),
    ],
)
def test_rows_the_offline_build_cannot_translate_say_why(
    sources: RepoSources, repo: str, version: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        recipe_of(FLASK, sources, repo=repo, version=version)


# -- repository sources ----------------------------------------------------------------------


def test_repository_sources_name_what_is_missing(sources: RepoSources, tmp_path: Path) -> None:
    row = lite_rows()[FLASK]
    with pytest.raises(ConfigError, match=r"--repo-source psf/requests=PATH"):
        sources.path("psf/requests")
    with pytest.raises(ConfigError, match="does not hold commit 0{40}"):
        sources.require_commit(row["repo"], "0" * 40)
    with pytest.raises(ConfigError, match="does not exist"):
        RepoSources({"pallets/flask": tmp_path / "nowhere"}).path("pallets/flask")
    assert RepoSources({"pallets/flask": sources.path("pallets/flask")}).path("pallets/flask").name.endswith(".git")


def test_the_checkout_holds_the_base_commit_only(sources: RepoSources, tmp_path: Path) -> None:
    import subprocess

    row = lite_rows()[FLASK]
    checkout(sources.path(row["repo"]), row["repo"], row["base_commit"], tmp_path / "testbed")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path / "testbed"), *args], capture_output=True, text=True).stdout

    assert git("rev-parse", "HEAD").strip() == row["base_commit"]
    assert git("rev-list", "--all").split() == [row["base_commit"]]  # no later history
    assert git("remote", "get-url", "origin").strip() == "https://github.com/pallets/flask"
    assert (tmp_path / "testbed" / "src" / "flask" / "blueprints.py").is_file()


# -- wheels and keys -------------------------------------------------------------------------


def test_platforms_and_wheel_choice_follow_the_targets_glibc_and_python(tmp_path: Path) -> None:
    target = Target(python="3.9", glibc=(2, 31))
    platforms = target.platforms()
    assert platforms[0] == "manylinux_2_31_x86_64" and "manylinux2014_x86_64" in platforms
    names = [
        "wrapt-1.13.3-cp39-cp39-manylinux_2_5_x86_64.manylinux1_x86_64.whl",
        "wrapt-1.13.3-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "newglibc-1.0-cp39-cp39-manylinux_2_34_x86_64.whl",
        "newglibc-1.0.tar.gz",
        "pure-2.0-py3-none-any.whl",
    ]
    for name in names:
        (tmp_path / name).write_text("x")
    chosen = [path.name for path in files_for(["wrapt==1.13.3", "newglibc==1.0", "pure==2.0"], target, tmp_path)]
    assert chosen == sorted([names[0], "newglibc-1.0.tar.gz", "pure-2.0-py3-none-any.whl"])
    with pytest.raises(BuildError, match="absent==1"):
        files_for(["absent==1"], target, tmp_path)


def test_an_sdists_build_requirements_are_read_from_its_pyproject(tmp_path: Path) -> None:
    import io
    import tarfile

    def sdist(name: str, pyproject: str | None) -> Path:
        path = tmp_path / f"{name}-1.0.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            files = {"setup.py": "", **({"pyproject.toml": pyproject} if pyproject is not None else {})}
            for file, text in files.items():
                info = tarfile.TarInfo(f"{name}-1.0/{file}")
                info.size = len(text.encode())
                archive.addfile(info, io.BytesIO(text.encode()))
        return path

    flit = '[build-system]\nrequires = ["flit_core >=3.2,<4"]\nbuild-backend = "flit_core.buildapi"\n'
    assert sdist_build_requirements(sdist("modern", flit)) == ("flit_core >=3.2,<4",)
    assert sdist_build_requirements(sdist("legacy", None)) == ("setuptools>=40.8.0", "wheel")
    assert sdist_build_requirements(sdist("tools_only", "[tool.black]\n")) == ("setuptools>=40.8.0", "wheel")


def test_image_keys_change_with_every_input(sources: RepoSources) -> None:
    recipe = recipe_of(FLASK, sources)
    base = Base("sha256:base", Target("3.9", (2, 31)))
    lock = Lock("k", {"environment": ["pip==1"]}, {"pip-1-py3-none-any.whl": "aa"})
    key = image_key(recipe, base, lock)
    assert key == image_key(recipe, base, lock)
    assert key != image_key(recipe, replace(base, image_id="sha256:other"), lock)
    assert key != image_key(recipe, base, replace(lock, files={"pip-1-py3-none-any.whl": "bb"}))
    assert key != image_key(replace(recipe, base_commit="0" * 40), base, lock)
    steps = recipe.steps
    assert lock_key(base.target, recipe.repo, recipe.base_commit, steps) != lock_key(
        Target("3.11", (2, 36)), recipe.repo, recipe.base_commit, steps
    )


# -- the command -----------------------------------------------------------------------------


def test_the_command_refuses_bad_input_with_the_reason(tmp_path: Path) -> None:
    runner = CliRunner()
    other = runner.invoke(app, ["tasks", "build-images", "tiny"])
    assert other.exit_code == 2 and "swebench task set" in other.output
    no_path = runner.invoke(app, ["tasks", "build-images", "swebench"])
    assert no_path.exit_code == 2 and "-o path=" in no_path.output
    bad_pair = runner.invoke(app, ["tasks", "build-images", "swebench", "-o", f"path={ROWS}", "--base", "3.9"])
    assert bad_pair.exit_code == 2 and "--base takes KEY=VALUE" in bad_pair.output
    incomplete = tmp_path / "rows.jsonl"
    incomplete.write_text(json.dumps({k: v for k, v in lite_rows()[FLASK].items() if k != "version"}) + "\n")
    no_version = runner.invoke(app, ["tasks", "build-images", "swebench", "-o", f"path={incomplete}"])
    assert no_version.exit_code == 2 and "pallets__flask-4045" in no_version.output and "version" in no_version.output


def test_a_row_without_a_source_fails_alone_with_its_error(tmp_path: Path) -> None:
    """Exit 1, and each row's reason in the report: no source for one, and for the other no lock
    in an empty cache with --offline (so nothing is built or fetched)."""
    require_docker()  # the base image is probed for its Python and glibc
    rows = lite_rows()
    flask_on_311 = {**rows[FLASK], "version": "2.2"}  # flask 2.2's specs ask for Python 3.11: the base image's
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(flask_on_311) + "\n" + json.dumps({**rows[PYLINT], "repo": "nobody/nothing"}) + "\n")
    result = CliRunner().invoke(
        app,
        ["tasks", "build-images", "swebench", "-o", f"path={data}", "--repos-dir", str(extract_sources(tmp_path / "s"))]
        + ["--cache-dir", str(tmp_path / "cache"), "--offline", "--base", f"3.11={DEFAULT_IMAGE}", "--json"],
    )
    assert result.exit_code == 1, result.output
    images = {i["instance_id"]: i for i in json.loads(result.output)["images"]}
    assert images[PYLINT]["status"] == "failed" and "--repo-source nobody/nothing=PATH" in images[PYLINT]["error"]
    assert images[FLASK]["status"] == "failed" and "resolve this image once with network" in images[FLASK]["error"]
    assert images[FLASK]["image"] == "sweb.eval.x86_64.pallets__flask-4045:latest"


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uv" else real(name, *a))
    result = CliRunner().invoke(app, ["tasks", "build-images", "swebench", "-o", f"path={ROWS}"])
    assert result.exit_code == 2 and "needs uv" in result.output and "patchgym[swebench,docker]" in result.output
