"""The plugin registry (patchgym.core.plugins): built-ins, entry-point plugins, isolation of
broken plugins, name conflicts, the enable/disable environment variables and "module:attr" names.

In-process tests write `.dist-info` directories by hand into a tmp dir put on sys.path, and build
a fresh `Registry()` each time. One test installs a real distribution with pip and runs the
`patchgym` command in a subprocess.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.core.errors import ConfigError, PluginError
from patchgym.core.plugins import BUILTIN_PLUGINS, Registry, registry, reset_registry
from patchgym.plugins.folder import TINY_TASKS, FolderTaskSet, tiny_task_set

TINY_IDS = sorted(p.name for p in TINY_TASKS.iterdir() if (p / "task.json").is_file())
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# -- helpers -------------------------------------------------------------------------------------


def good_plugin(*task_sets: str) -> str:
    """Source of a plugin module registering each name as the tiny task set."""
    lines = "\n".join(f"    register({name!r}, tiny_task_set, 'test task set {name}')" for name in task_sets)
    return (
        "from patchgym.core.plugins import hookimpl\n"
        "from patchgym.plugins.folder import tiny_task_set\n\n"
        "@hookimpl\n"
        "def register_task_sets(register):\n"
        f"{lines}\n"
    )


class Sites:
    """Hand-written distributions, each in its own directory on sys.path, in creation order."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.prefix = f"pgtest_{uuid.uuid4().hex[:8]}_"
        self.dirs: list[Path] = []

    def module(self, stem: str) -> str:
        return self.prefix + stem

    def add(self, dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "0.1") -> None:
        """A distribution `dist` with entry points (name -> module stem) and modules (stem -> source)."""
        site = self.root / f"site{len(self.dirs)}"
        site.mkdir(parents=True)
        for stem, source in modules.items():
            (site / f"{self.module(stem)}.py").write_text(source)
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "".join(f"{name} = {self.module(stem)}\n" for name, stem in entry_points.items())
        (info / "entry_points.txt").write_text(f"[patchgym]\n{eps}")
        self.dirs.append(site)

    def activate(self) -> None:
        """Put every site on sys.path, the first added first."""
        for site in reversed(self.dirs):
            self.monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()

    def cleanup(self) -> None:
        for name in [m for m in sys.modules if m.startswith(self.prefix)]:
            del sys.modules[name]
        importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("PATCHGYM_PLUGINS", raising=False)
    monkeypatch.delenv("PATCHGYM_DISABLE_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sites]:
    s = Sites(tmp_path / "sites", monkeypatch)
    yield s
    s.cleanup()


def records(reg: Registry) -> dict[str, dict]:
    return {r.name: r.as_dict() for r in reg.plugins()}


def assert_builtins_work(reg: Registry) -> None:
    assert {"tiny", "folder"} <= set(reg.names("task_set"))
    assert "local" in reg.names("sandbox")
    assert len(reg.create("task_set", "tiny")) == 6


# -- 1. built-ins --------------------------------------------------------------------------------


def test_builtins_register_task_sets_and_sandbox() -> None:
    reg = Registry(entry_point_group=None)
    assert reg.names("task_set") == ["folder", "tiny"]
    assert reg.names("sandbox") == ["docker", "local"]
    recs = records(reg)
    assert set(recs) == set(BUILTIN_PLUGINS)
    assert all(r["status"] == "loaded" and r["error"] is None for r in recs.values())
    assert "task set:tiny" in recs["builtin-tasks"]["registered"]
    assert "sandbox backend:local" in recs["builtin-sandboxes"]["registered"]
    tiny = reg.create("task_set", "tiny")
    assert len(tiny) == 6
    assert sorted(tiny.ids()) == TINY_IDS
    folder = reg.create("task_set", "folder", path=TINY_TASKS)
    assert isinstance(folder, FolderTaskSet) and len(folder) == 6
    assert reg.factory("sandbox", "local") is not None
    assert reg.conflicts() == []


def test_global_registry_is_shared_and_resettable() -> None:
    first = registry()
    assert registry() is first
    assert len(first.create("task_set", "tiny")) == 6
    reset_registry()
    assert registry() is not first


# -- 2. a real installed distribution, seen by the `patchgym` command ----------------------------


def _setuptools_builds_wheels() -> bool:
    """setuptools < 70.1 needs the `wheel` package to build a wheel (pip's only PEP 517 path)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    from importlib.metadata import version

    major, minor = (int(x) for x in re.findall(r"\d+", version("setuptools"))[:2])
    return (major, minor) >= (70, 1)


def _hand_built_wheel(project: Path, out: Path, dist: str, version: str, package: str) -> Path:
    """A wheel of `project` written with zipfile (when setuptools cannot build one here)."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {f"{package}/{p.name}": p.read_bytes() for p in sorted((project / package).iterdir()) if p.is_file()}
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: patchgym-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{info}/entry_points.txt"] = f"[patchgym]\nacme = {package}\n".encode()

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = out / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def _patchgym_command() -> list[str]:
    script = Path(sys.executable).with_name("patchgym")
    return [str(script)] if script.exists() else [sys.executable, "-m", "patchgym.cli"]


def test_installed_distribution_plugin_is_found_by_the_cli(tmp_path: Path) -> None:
    dist, version, package = "acme-patchgym", "1.2.3", f"acme_pg_{uuid.uuid4().hex[:6]}"
    tasks = tmp_path / "acme-tasks"
    tasks.mkdir()
    shutil.copytree(TINY_TASKS / "roman-subtractive", tasks / "roman-subtractive")
    project = tmp_path / "project"
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text(
        textwrap.dedent(
            f"""\
            from patchgym.core.plugins import hookimpl
            from patchgym.plugins.folder import FolderTaskSet

            PATCHGYM_PLUGIN_API = 1

            def acme(**options):
                return FolderTaskSet({str(tasks)!r}, name="acme")

            @hookimpl
            def register_task_sets(register):
                register("acme", acme, "ACME's tasks")
            """
        )
    )
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "{version}"

            [project.entry-points.patchgym]
            acme = "{package}"

            [tool.setuptools]
            packages = ["{package}"]
            """
        )
    )
    target = tmp_path / "site"
    source = (
        str(project)
        if _setuptools_builds_wheels()
        else str(_hand_built_wheel(project, tmp_path, dist, version, package))
    )
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    installed = subprocess.run([*pip, "--target", str(target), source], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert list(target.glob("*.dist-info/entry_points.txt")), "pip installed no distribution metadata"

    env = {k: v for k, v in os.environ.items() if k not in ("PATCHGYM_PLUGINS", "PATCHGYM_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = str(target)
    run = lambda *args: subprocess.run(  # noqa: E731
        [*_patchgym_command(), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )

    listed = run("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    acme = {r["name"]: r for r in report["plugins"]}["acme"]
    assert acme["status"] == "loaded", acme
    assert acme["registered"] == ["task set:acme"]
    assert re.search(r"acme[-_]patchgym 1\.2\.3", acme["source"]), acme["source"]
    assert package in acme["source"]
    assert report["conflicts"] == []
    assert {r["name"] for r in report["plugins"]} >= set(BUILTIN_PLUGINS)

    tasks_listed = run("tasks", "list", "acme", "--json")
    assert tasks_listed.returncode == 0, tasks_listed.stderr
    assert [row["id"] for row in json.loads(tasks_listed.stdout)] == ["roman-subtractive"]

    # Without the install on the path, the name is unknown.
    env.pop("PYTHONPATH")
    missing = run("tasks", "list", "acme", "--json")
    assert missing.returncode == 2
    assert "acme" in missing.stdout + missing.stderr


# -- 3. in-process: isolation, conflicts, environment, API version, names -------------------------


def test_plugin_that_fails_to_import_is_reported_and_others_work(sites: Sites) -> None:
    sites.add("broken-dist", {"brokenpg": "broken"}, {"broken": "raise RuntimeError('boom on import')\n"})
    sites.add("good-dist", {"goodpg": "good"}, {"good": good_plugin("goodset")})
    sites.activate()
    reg = Registry()
    recs = records(reg)
    assert recs["brokenpg"]["status"] == "failed"
    assert "RuntimeError" in recs["brokenpg"]["error"] and "boom on import" in recs["brokenpg"]["error"]
    assert recs["brokenpg"]["registered"] == []
    assert "broken-dist 0.1" in recs["brokenpg"]["source"]
    assert recs["goodpg"]["status"] == "loaded"
    assert recs["goodpg"]["registered"] == ["task set:goodset"]
    assert len(reg.create("task_set", "goodset")) == 6
    assert_builtins_work(reg)
    # An unknown name points at the plugin that failed.
    with pytest.raises(ConfigError, match="brokenpg"):
        reg.factory("task_set", "brokenset")


def test_plugin_whose_registrar_raises_is_reported_and_others_work(sites: Sites) -> None:
    raising = (
        "from patchgym.core.plugins import hookimpl\n"
        "@hookimpl\n"
        "def register_task_sets(register):\n"
        "    register('halfway', object)\n"
        "    raise ValueError('registrar exploded')\n"
    )
    sites.add("raising-dist", {"raisingpg": "raising"}, {"raising": raising})
    sites.add("good-dist", {"goodpg": "good"}, {"good": good_plugin("goodset")})
    sites.activate()
    reg = Registry()
    recs = records(reg)
    assert recs["raisingpg"]["status"] == "failed"
    assert "registrar exploded" in recs["raisingpg"]["error"]
    # What it registered before raising is discarded.
    assert recs["raisingpg"]["registered"] == []
    assert "halfway" not in reg.names("task_set")
    assert recs["goodpg"]["status"] == "loaded"
    assert len(reg.create("task_set", "goodset")) == 6
    assert_builtins_work(reg)


@pytest.mark.parametrize("failing_hook", ["register_task_sets", "register_sandbox_backends"])
def test_plugin_failing_in_one_registrar_contributes_nothing(sites: Sites, failing_hook: str) -> None:
    """Whichever of its registrars raises (the first called or a later one), a failed plugin registers no names."""
    source = (
        "from patchgym.core.plugins import hookimpl\n"
        "from patchgym.plugins.folder import tiny_task_set\n"
        "@hookimpl\n"
        "def register_task_sets(register):\n"
        "    register('mixedset', tiny_task_set)\n"
        f"    if {failing_hook == 'register_task_sets'!r}: raise ValueError('task sets exploded')\n"
        "@hookimpl\n"
        "def register_sandbox_backends(register):\n"
        "    register('mixedbox', object)\n"
        f"    if {failing_hook == 'register_sandbox_backends'!r}: raise ValueError('sandboxes exploded')\n"
    )
    sites.add("mixed-dist", {"mixedpg": "mixed"}, {"mixed": source})
    sites.activate()
    reg = Registry()
    rec = records(reg)["mixedpg"]
    assert rec["status"] == "failed" and "exploded" in rec["error"]
    assert rec["registered"] == []
    assert "mixedset" not in reg.names("task_set")
    assert "mixedbox" not in reg.names("sandbox")
    with pytest.raises(ConfigError, match="mixedpg"):
        reg.factory("sandbox", "mixedbox")
    assert_builtins_work(reg)


def test_invalid_registered_name_fails_the_plugin(sites: Sites) -> None:
    bad_name = (
        "from patchgym.core.plugins import hookimpl\n"
        "@hookimpl\n"
        "def register_task_sets(register):\n"
        "    register('has:colon', object)\n"
    )
    sites.add("badname-dist", {"badnamepg": "badname"}, {"badname": bad_name})
    sites.activate()
    reg = Registry()
    rec = records(reg)["badnamepg"]
    assert rec["status"] == "failed" and "has:colon" in rec["error"]
    assert_builtins_work(reg)


def test_two_plugins_claiming_one_name_conflict(sites: Sites) -> None:
    sites.add("alpha-dist", {"alphapg": "alpha"}, {"alpha": good_plugin("shared", "alphaonly")})
    sites.add("beta-dist", {"betapg": "beta"}, {"beta": good_plugin("shared", "betaonly")})
    sites.activate()
    reg = Registry()
    recs = records(reg)
    assert recs["alphapg"]["status"] == recs["betapg"]["status"] == "loaded"
    with pytest.raises(PluginError) as caught:
        reg.factory("task_set", "shared")
    message = str(caught.value)
    assert "'shared'" in message and "alphapg" in message and "betapg" in message
    assert "PATCHGYM_DISABLE_PLUGINS" in message
    with pytest.raises(PluginError):
        reg.create("task_set", "shared")
    conflicts = reg.conflicts()
    assert len(conflicts) == 1
    assert "shared" in conflicts[0] and "alphapg" in conflicts[0] and "betapg" in conflicts[0]
    assert len(reg.create("task_set", "alphaonly")) == 6
    assert len(reg.create("task_set", "betaonly")) == 6
    assert_builtins_work(reg)


def test_disabling_one_of_two_conflicting_plugins_resolves_the_conflict(
    sites: Sites, monkeypatch: pytest.MonkeyPatch
) -> None:
    sites.add("alpha-dist", {"alphapg": "alpha"}, {"alpha": good_plugin("shared")})
    sites.add("beta-dist", {"betapg": "beta"}, {"beta": good_plugin("shared")})
    sites.activate()
    monkeypatch.setenv("PATCHGYM_DISABLE_PLUGINS", "betapg")
    reg = Registry()
    assert reg.conflicts() == []
    assert len(reg.create("task_set", "shared")) == 6


def test_disable_plugins_env_blocks_a_plugin(sites: Sites, monkeypatch: pytest.MonkeyPatch) -> None:
    sites.add("alpha-dist", {"alphapg": "alpha"}, {"alpha": good_plugin("alphaset")})
    sites.add("beta-dist", {"betapg": "beta"}, {"beta": good_plugin("betaset")})
    sites.activate()
    monkeypatch.setenv("PATCHGYM_DISABLE_PLUGINS", " betapg , nosuchplugin")
    reg = Registry()
    recs = records(reg)
    assert recs["betapg"]["status"] == "disabled"
    assert recs["betapg"]["registered"] == []
    assert "betaset" not in reg.names("task_set")
    assert sites.module("beta") not in sys.modules, "a disabled plugin must not even be imported"
    assert recs["alphapg"]["status"] == "loaded"
    assert "alphaset" in reg.names("task_set")
    with pytest.raises(ConfigError):
        reg.factory("task_set", "betaset")
    assert_builtins_work(reg)


def test_disable_plugins_env_can_block_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHGYM_DISABLE_PLUGINS", "builtin-tasks")
    reg = Registry(entry_point_group=None)
    assert records(reg)["builtin-tasks"]["status"] == "disabled"
    assert reg.names("task_set") == []
    assert reg.names("sandbox") == ["docker", "local"]


def test_plugins_env_allowlist_loads_only_listed_third_party_plugins(
    sites: Sites, monkeypatch: pytest.MonkeyPatch
) -> None:
    sites.add("alpha-dist", {"alphapg": "alpha"}, {"alpha": good_plugin("alphaset")})
    sites.add("beta-dist", {"betapg": "beta"}, {"beta": good_plugin("betaset")})
    sites.activate()
    # Without the allowlist both load (so the assertions below are not vacuous).
    assert {"alphaset", "betaset"} <= set(Registry().names("task_set"))

    monkeypatch.setenv("PATCHGYM_PLUGINS", "alphapg")
    reg = Registry()
    recs = records(reg)
    assert recs["alphapg"]["status"] == "loaded"
    assert recs.get("betapg", {}).get("status") != "loaded"
    assert "alphaset" in reg.names("task_set")
    assert "betaset" not in reg.names("task_set")
    assert_builtins_work(reg)  # built-ins are not subject to the allowlist


def test_unsupported_plugin_api_version_is_refused(sites: Sites) -> None:
    future = "PATCHGYM_PLUGIN_API = 99\n" + good_plugin("futureset")
    sites.add("future-dist", {"futurepg": "future"}, {"future": future})
    sites.add("good-dist", {"goodpg": "good"}, {"good": good_plugin("goodset")})
    sites.activate()
    reg = Registry()
    recs = records(reg)
    assert recs["futurepg"]["status"] == "failed"
    assert "99" in recs["futurepg"]["error"] and "not supported" in recs["futurepg"]["error"]
    assert "futureset" not in reg.names("task_set")
    assert not reg.manager.has_plugin("futurepg")
    assert "goodset" in reg.names("task_set")
    assert_builtins_work(reg)


def test_misspelled_hook_implementation_fails_the_plugin(sites: Sites) -> None:
    typo = (
        "from patchgym.core.plugins import hookimpl\n"
        "from patchgym.plugins.folder import tiny_task_set\n"
        "@hookimpl\n"
        "def register_task_set(register):\n"
        "    register('typoset', tiny_task_set)\n"
    )
    # The misspelled plugin comes first, so the good one is checked after it.
    sites.add("typo-dist", {"typopg": "typo"}, {"typo": typo})
    sites.add("good-dist", {"goodpg": "good"}, {"good": good_plugin("goodset")})
    sites.activate()
    reg = Registry()
    recs = records(reg)
    assert recs["typopg"]["status"] == "failed"
    assert "register_task_set" in recs["typopg"]["error"]
    assert "typoset" not in reg.names("task_set")
    assert not reg.manager.has_plugin("typopg")
    assert recs["goodpg"]["status"] == "loaded", recs["goodpg"]
    assert "goodset" in reg.names("task_set")
    assert_builtins_work(reg)


def test_bad_hook_signature_fails_the_plugin(sites: Sites) -> None:
    wrong_args = (
        "from patchgym.core.plugins import hookimpl\n"
        "@hookimpl\n"
        "def register_task_sets(register, extra):\n"
        "    register('wrongset', object)\n"
    )
    sites.add("wrong-dist", {"wrongpg": "wrong"}, {"wrong": wrong_args})
    sites.activate()
    reg = Registry()
    assert records(reg)["wrongpg"]["status"] == "failed"
    assert "wrongset" not in reg.names("task_set")
    assert_builtins_work(reg)


def test_third_party_plugin_named_like_a_builtin_is_refused(sites: Sites) -> None:
    sites.add("imposter-dist", {"builtin-tasks": "imposter"}, {"imposter": good_plugin("imposterset")})
    sites.activate()
    reg = Registry()
    plugins = reg.plugins()
    imposter = [p for p in plugins if "imposter-dist" in p.source]
    assert len(imposter) == 1 and imposter[0].status == "failed"
    assert "already named" in imposter[0].error
    assert "imposterset" not in reg.names("task_set")
    assert_builtins_work(reg)


def test_module_attr_names_resolve_without_registration(sites: Sites) -> None:
    sites.add("unused-dist", {}, {"direct": "def make(**options):\n    return ('made', options)\n"})
    sites.activate()
    reg = Registry(builtins={}, entry_point_group=None)
    assert reg.names("task_set") == []
    assert reg.factory("task_set", "patchgym.plugins.folder:tiny_task_set") is tiny_task_set
    assert len(reg.create("task_set", "patchgym.plugins.folder:tiny_task_set")) == 6
    assert reg.create("trainer", f"{sites.module('direct')}:make", lr=0.1) == ("made", {"lr": 0.1})
    with pytest.raises(ConfigError, match="no_such_attr"):
        reg.factory("task_set", "patchgym.plugins.folder:no_such_attr")
    with pytest.raises(ConfigError, match="pgtest_no_such_module"):
        reg.factory("sandbox", "pgtest_no_such_module:thing")


def test_unknown_name_raises_config_error_listing_known_names() -> None:
    reg = Registry(entry_point_group=None)
    with pytest.raises(ConfigError) as caught:
        reg.create("task_set", "nosuchset")
    message = str(caught.value)
    assert "nosuchset" in message and "task set" in message
    assert "folder" in message and "tiny" in message
    with pytest.raises(ConfigError, match="local"):
        reg.factory("sandbox", "nosuchbox")
    with pytest.raises(ConfigError, match=r"unknown inference backend 'nosuchengine'; known: "):
        reg.factory("inference", "nosuchengine")


def test_create_with_wrong_options_is_a_config_error() -> None:
    reg = Registry(entry_point_group=None)
    with pytest.raises(ConfigError, match=r"task set 'folder'.*path"):
        reg.create("task_set", "folder")
    with pytest.raises(ConfigError, match=r"task set 'tiny'.*bogus"):
        reg.create("task_set", "tiny", bogus=1)
    assert len(reg.create("task_set", "folder", path=TINY_TASKS)) == 6

    def factory(**options: object) -> object:
        raise TypeError("raised inside the factory")

    # A TypeError from inside a factory is the factory's bug, not bad options: it is not rewritten.
    reg.register("trainer", "typeerror", factory)
    with pytest.raises(TypeError, match="raised inside the factory"):
        reg.create("trainer", "typeerror", anything=1)


def test_runtime_register_adds_a_name() -> None:
    reg = Registry(entry_point_group=None)
    reg.register("inference", "fake", lambda **kw: ("fake", kw))
    assert "fake" in reg.names("inference")
    assert reg.create("inference", "fake", x=1) == ("fake", {"x": 1})
    reg.register("task_set", "tiny", tiny_task_set)
    with pytest.raises(PluginError, match="<runtime>"):
        reg.factory("task_set", "tiny")


# -- 4. the CLI shows a failed plugin ------------------------------------------------------------


def test_cli_plugins_command_shows_a_failed_plugin(sites: Sites) -> None:
    from patchgym.cli import app

    sites.add("broken-dist", {"brokenpg": "broken"}, {"broken": "raise RuntimeError('boom on import')\n"})
    sites.add("good-dist", {"goodpg": "good"}, {"good": good_plugin("goodset")})
    sites.activate()
    runner = CliRunner()
    reset_registry()
    try:
        table = runner.invoke(app, ["plugins"])
        assert table.exit_code == 0, table.output
        lines = ANSI.sub("", table.output).splitlines()
        broken_rows = [line for line in lines if "brokenpg" in line]
        assert broken_rows and "failed" in broken_rows[0], table.output
        good_rows = [line for line in lines if "goodpg" in line]
        assert good_rows and "loaded" in good_rows[0], table.output
        assert "goodset" in table.output

        reset_registry()
        as_json = runner.invoke(app, ["plugins", "--json"])
        assert as_json.exit_code == 0, as_json.output
        recs = {r["name"]: r for r in json.loads(as_json.stdout)["plugins"]}
        assert recs["brokenpg"]["status"] == "failed"
        assert "boom on import" in recs["brokenpg"]["error"]
        assert recs["goodpg"]["status"] == "loaded"
    finally:
        reset_registry()
