"""Unit tests of the static tamper checks: decoding, folding, name resolution, pytest config,
layout, and Harbor's protected paths by real path."""

from __future__ import annotations

import ast
import codecs

import pytest

from patchgym.core.tamper import names, tamper_findings
from patchgym.core.tamper.folding import Folder
from patchgym.core.tamper.runner_config import filterwarnings_findings, option_changes, pytest_options
from patchgym.core.tree_diff import FileChange
from patchgym.plugins.harbor_paths import EXISTING_ONLY, PROTECTED_PATHS, protected_changes, spellings


def found(path: str, new: str | bytes, old: str | bytes | None = None, pristine: set[str] | None = None) -> list[str]:
    encode = lambda text: text.encode() if isinstance(text, str) else text  # noqa: E731
    change = FileChange(path, None if old is None else encode(old), encode(new))
    return [f.what for f in tamper_findings([change], pristine=pristine)]


def fold(expression: str) -> str | None:
    return Folder({}, lambda node: None).text(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ('"unit" + "test"', "unittest"),
        ('"tsettinu"[::-1]', "unittest"),
        ('"".join(["py", "test"])', "pytest"),
        ('"%s%s" % ("unit", "test")', "unittest"),
        ("f'{\"unit\"}test'", "unittest"),
        ('"UNITTEST".lower()', "unittest"),
        ('"x" * 10**9', None),
        ('"%999999999s" % "a"', None),
        ("name + 'test'", None),
    ],
)
def test_folding(expression: str, value: str | None) -> None:
    assert fold(expression) == value


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("import unittest.mock", names.IMPORTS_FRAMEWORK),
        ("def f():\n    from _pytest import runner", names.IMPORTS_FRAMEWORK),
        ("import importlib\nimportlib.import_module(name)", names.COMPUTED_IMPORT),
        ("import runpy\nrunpy.run_path(p)", names.COMPUTED_IMPORT),
        ("import pkgutil\npkgutil.resolve_name('unit' + 'test:TestCase')", names.IMPORTS_FRAMEWORK),
        ("exec(code)", names.DYNAMIC_CODE),
        ("eval('__import__(\"pytest\")')", names.IMPORTS_FRAMEWORK),
        ("import codecs\nexec(codecs.decode('vzcbeg havggrfg', 'rot13'))", names.IMPORTS_FRAMEWORK),
        ("import sys as s\nm = getattr(s, 'mod' + 'ules')", names.INTERPRETER),
        ("import sys\nalias = sys\nalias.modules.clear()", names.INTERPRETER),
        ("import sys\nsys.addaudithook(hook)", names.HOOKS),
        ("from atexit import register", names.HOOKS),
        ("import os\nos._exit(0)", names.EXITS),
        ("import sys\nf = sys._getframe(1)", names.FRAMES),
        ("x = e.__traceback__.tb_frame", names.FRAMES),
        ("x = f.__globals__", names.INTERPRETER),
        ("import subprocess\nsubprocess.Popen(c, start_new_session=True)", names.DAEMONS),
        ("path = 'report.xml'", names.REPORT),
        ("import os\nos.environ['PYTEST_' + 'ADDOPTS'] = '-p x'", names.RUNNER_ENV),
        ("def f(:\n", names.UNPARSEABLE),
    ],
)
def test_python_constructs(source: str, what: str) -> None:
    assert what in found("pkg/mod.py", source)


def test_declared_encodings_are_honoured() -> None:
    hidden = "# -*- coding: utf-16 -*-\nimport unittest\n"
    assert names.UNPARSEABLE in found("pkg/a.py", codecs.BOM_UTF16_LE + hidden.encode("utf-16-le"))
    latin = "# -*- coding: latin-1 -*-\nname = 'caf\xe9'\nimport pytest\n".encode("latin-1")
    assert names.IMPORTS_FRAMEWORK in found("pkg/a.py", latin)
    assert names.IMPORTS_FRAMEWORK in found("pkg/a.py", codecs.BOM_UTF8 + b"import pytest\n")


def test_only_what_the_agent_added_counts() -> None:
    old = "import sys\n\ndef names():\n    return list(sys.modules)\n"
    assert found("pkg/a.py", old + "\nX = 1\n", old) == []
    assert names.INTERPRETER in found("pkg/a.py", old + "\nY = sys.modules.copy()\n", old)
    # a file Python could not parse before is not a finding when it still does not parse
    assert found("pkg/a.py", "print 'x'\n", "print 'y'\n") == []


def test_honest_code_is_not_flagged() -> None:
    honest = (
        "import sys, os, inspect, importlib\n"
        "from typing import Any\n"
        "def run(argv=None):\n"
        "    mod = sys.modules[__name__]\n"
        "    json = importlib.import_module('json')\n"
        "    sig = inspect.signature(run)\n"
        "    return os.path.join('a', 'b'), sys.exit, json, sig, mod\n"
    )
    assert found("pkg/a.py", honest) == []


def test_the_framework_repository_may_edit_itself() -> None:
    pristine = {"src/_pytest/__init__.py", "src/_pytest/python.py", "src/pytest/__init__.py", "doc/conf.py"}
    code = "import sys\nfrom _pytest.config import Config\nframe = sys._getframe(1)\nexec(compile(src, fn, 'exec'))\n"
    assert found("src/_pytest/python.py", code, "x = 1\n", pristine) == []
    assert found("doc/conf.py", "import pytest\n", "x = 1\n", pristine) == []
    assert names.FRAMES in found("doc/conf.py", "import sys\nf = sys._getframe()\n", "x = 1\n", pristine)
    # elsewhere the same package is new and shadows the framework
    assert names.SHADOWS in found("src/_pytest/__init__.py", "x = 1\n", None, {"src/calc/__init__.py"})


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("json.py", names.SHADOWS_MODULE),
        ("src/fnmatch.py", names.SHADOWS_MODULE),
        ("pluggy/__init__.py", names.SHADOWS),
        ("iniconfig.py", names.SHADOWS_MODULE),
        ("tokenize.cpython-311-x86_64-linux-gnu.so", names.SHADOWS_MODULE),
        ("lib/sitecustomize.py", names.STARTUP),
        ("pkg/x.pth", names.STARTUP),
    ],
)
def test_new_modules_that_stand_in_for_the_runners(path: str, expected: str) -> None:
    assert expected in found(path, "x = 1\n", None, {"pkg/__init__.py"})


def test_a_module_inside_a_package_does_not_shadow() -> None:
    assert found("pkg/json.py", "x = 1\n", None, {"pkg/__init__.py"}) == []


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("pyproject.toml", '[tool."pytest".ini_options]\n"add\\u006fpts" = "-p x"\n', "addopts"),
        ("pyproject.toml", "[tool.pytest]\naddopts = ['-p', 'x']\n", "addopts"),
        ("setup.cfg", "[tool:pytest]\npythonpath = src\n", "pythonpath"),
        ("tox.ini", "[pytest]\nxfail_strict = false\n", "xfail_strict"),
        ("pytest.ini", "[pytest]\nusefixtures = forge\n", "usefixtures"),
    ],
)
def test_pytest_options_parsed_as_pytest_reads_them(name: str, text: str, key: str) -> None:
    options = pytest_options(name, text.encode())
    assert options is not None and key in options
    assert any(key in change for change in option_changes({}, options))


def test_runner_configuration_findings() -> None:
    old = "[tool.pytest.ini_options]\nmarkers = ['slow']\nfilterwarnings = ['error']\n"
    assert found("pyproject.toml", old.replace("slow", "fast"), old) == []  # markers only print
    flipped = old.replace("['error']", "['error', 'ignore']")
    assert names.RUNNER_CONFIG in found("pyproject.toml", flipped, old)
    assert names.RUNNER_CONFIG in found("sub/pytest.ini", "", None)  # an empty pytest.ini moves the rootdir
    assert names.RUNNER_CONFIG in found("setup.cfg", "[tool:pytest\n", "[metadata]\nname = x\n")
    assert names.PLUGIN in found("setup.cfg", "[options.entry_points]\npytest11 =\n  forge = pkg.forge\n", "")
    assert names.RUNNER_ENV in found("ci/.env", "PYTEST_ADDOPTS=-p forge\n", "")
    assert names.RUNNER_CONFIG in found("pkg/conftest.py", "x = 1\n")
    assert filterwarnings_findings(["error"], ["ignore::DeprecationWarning"]) == ["removes filterwarnings 'error'"]
    assert filterwarnings_findings(["error"], ["error", "ignore:old api:DeprecationWarning"]) == []


@pytest.mark.parametrize(
    ("path", "kind", "refused"),
    [
        ("/usr/bin/sh", 0, True),  # /bin/* through the merged-usr link
        ("/bin/newtool", 1, False),  # apt-get install may add a tool
        ("/usr/lib/python3.11/site.py", 0, True),
        ("/usr/lib/python3.11/pytest.py", 1, True),  # would shadow site-packages
        ("/usr/local/lib/python3.11/dist-packages/numpy/core.py", 1, False),
        ("/usr/local/lib/python3.11/site-packages/_pytest/runner.py", 0, True),
        ("/app/.venv/bin/python", 1, False),
        ("/app/.venv/bin/python", 0, True),
        ("/etc/profile.d", 0, True),  # the folder replaced by a link
        ("/pytest.ini", 1, True),
        ("/app/main.py", 1, False),
    ],
)
def test_harbor_protected_paths_by_real_path(path: str, kind: int, refused: bool) -> None:
    assert bool(protected_changes([(path, kind)], PROTECTED_PATHS, EXISTING_ONLY, [])) == refused


def test_harbor_parent_entries_and_spellings() -> None:
    parents = [("/usr", 0), ("/usr/local", 0), ("/usr/local/lib", 0), ("/usr/local/lib/tool.so", 1)]
    assert protected_changes(parents, PROTECTED_PATHS, EXISTING_ONLY, []) == []
    assert spellings("/usr/lib/../bin//sh") == {"/usr/bin/sh", "/bin/sh"}
    assert protected_changes([("/usr/bin/sh", 0)], PROTECTED_PATHS, EXISTING_ONLY, ["/bin/sh"]) == []
