"""Names the static checks know: the test framework, the modules the runner imports, and the
parts of the interpreter that code under test has no honest reason to reach."""

from __future__ import annotations

import sys

FRAMEWORK_MODULES = frozenset(
    {"unittest", "doctest", "pytest", "_pytest", "pluggy", "nose", "nose2", "xdist", "_hypothesis_pytestplugin"}
)
"""Top-level modules of the test frameworks: importing one from non-test code reaches the runner."""

TEST_DEPENDENCIES = FRAMEWORK_MODULES | {
    "py",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
    "colorama",
    "attr",
    "attrs",
    "more_itertools",
    "atomicwrites",
    "wcwidth",
    "six",
    "hypothesis",
    "coverage",
    "pytest_cov",
    "pytest_asyncio",
    "pytest_mock",
    "pytest_timeout",
    "execnet",
    "mock",
    "pygments",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "pip",
    "typing_extensions",
    "sitecustomize",
    "usercustomize",
}
"""Modules the runner (pytest and its plugins, unittest) imports besides the standard library."""

SHADOWABLE = frozenset(sys.stdlib_module_names) | TEST_DEPENDENCIES
"""A new top-level module of one of these names would stand in for the one the runner imports."""

# What a finding says; tests and the docs match on these strings.
IMPORTS_FRAMEWORK = "imports the test framework"
COMPUTED_IMPORT = "imports a module by a computed name"
DYNAMIC_CODE = "runs dynamically built code"
HOOKS = "installs an exit or signal hook"
EXITS = "exits or kills the process"
FRAMES = "inspects the caller's frames"
INTERPRETER = "patches the interpreter"
DAEMONS = "starts processes that outlive the test"
REPORT = "touches the test report"
RUNNER_ENV = "sets the runner's environment"
PLUGIN = "registers a pytest plugin"
UNPARSEABLE = "is not valid Python"
RUNNER_CONFIG = "changes how the tests run"
STARTUP = "loads code at interpreter start-up"
SHADOWS = "shadows the test framework"
SHADOWS_MODULE = "shadows a module the runner imports"

REACHES: dict[str, str] = {
    # the interpreter's own tables
    "sys.modules": INTERPRETER,
    "sys.settrace": INTERPRETER,
    "sys.setprofile": INTERPRETER,
    "sys.meta_path": INTERPRETER,
    "sys.path_hooks": INTERPRETER,
    "sys.path_importer_cache": INTERPRETER,
    "sys.monitoring": INTERPRETER,
    "sys.__dict__": INTERPRETER,
    "threading.settrace": INTERPRETER,
    "threading.setprofile": INTERPRETER,
    "builtins": INTERPRETER,
    "ctypes": INTERPRETER,
    "_ctypes": INTERPRETER,
    "gc.get_objects": FRAMES,
    "gc.get_referrers": FRAMES,
    "gc.get_referents": FRAMES,
    # hooks that run at exit, on a signal or on an event
    "atexit": HOOKS,
    "sys.exitfunc": HOOKS,
    "sys.excepthook": HOOKS,
    "sys.unraisablehook": HOOKS,
    "sys.displayhook": HOOKS,
    "sys.breakpointhook": HOOKS,
    "sys.addaudithook": HOOKS,
    "threading.excepthook": HOOKS,
    "os.register_at_fork": HOOKS,
    "signal.signal": HOOKS,
    "signal.setitimer": HOOKS,
    "signal.alarm": HOOKS,
    "faulthandler": HOOKS,
    # ending the process from inside
    "os._exit": EXITS,
    "os.abort": EXITS,
    "os.kill": EXITS,
    "os.killpg": EXITS,
    "signal.raise_signal": EXITS,
    "signal.pthread_kill": EXITS,
    # frames
    "sys._getframe": FRAMES,
    "sys._current_frames": FRAMES,
    "sys._getframemodulename": FRAMES,
    "inspect.currentframe": FRAMES,
    "inspect.stack": FRAMES,
    "inspect.trace": FRAMES,
    "inspect.getouterframes": FRAMES,
    "inspect.getinnerframes": FRAMES,
    "traceback.walk_stack": FRAMES,
    "traceback.walk_tb": FRAMES,
    # processes of their own
    "os.fork": DAEMONS,
    "os.forkpty": DAEMONS,
    "os.setsid": DAEMONS,
    "os.setpgrp": DAEMONS,
    "os.setpgid": DAEMONS,
    "os.daemon": DAEMONS,
    # code from data
    "marshal.loads": DYNAMIC_CODE,
    "types.CodeType": DYNAMIC_CODE,
    "types.FunctionType": DYNAMIC_CODE,
}
"""Qualified names (and prefixes: `ctypes` covers `ctypes.CDLL`) and what reaching one means."""

ATTRIBUTES: dict[str, str] = {
    "f_back": FRAMES,
    "f_globals": FRAMES,
    "f_locals": FRAMES,
    "f_builtins": FRAMES,
    "tb_frame": FRAMES,
    "gi_frame": FRAMES,
    "cr_frame": FRAMES,
    "ag_frame": FRAMES,
    "__subclasses__": INTERPRETER,
    "__globals__": INTERPRETER,
    "__builtins__": INTERPRETER,
    "__import__": COMPUTED_IMPORT,
}
"""Attribute names that reach frames or the interpreter whatever object they are read from."""

IMPORTERS = frozenset(
    {
        "builtins.__import__",
        "importlib.import_module",
        "importlib.__import__",
        "importlib.reload",
        "importlib.util.find_spec",
        "importlib.util.spec_from_file_location",
        "importlib.util.spec_from_loader",
        "importlib.util.module_from_spec",
        "importlib.machinery.SourceFileLoader",
        "importlib.machinery.SourcelessFileLoader",
        "importlib.machinery.ExtensionFileLoader",
        "importlib.machinery.PathFinder",
        "runpy.run_module",
        "runpy.run_path",
        "pkgutil.resolve_name",
        "pkgutil.get_loader",
        "pkgutil.find_loader",
        "pkgutil.get_importer",
        "pkgutil.walk_packages",
        "imp.load_source",
        "imp.load_module",
        "imp.load_compiled",
        "imp.find_module",
        "imp.reload",
        "zipimport.zipimporter",
    }
)
"""Calls that import a module named by their first argument (a name or a path)."""

EXECUTORS = frozenset({"builtins.exec", "builtins.eval", "builtins.compile"})
"""Calls that run (or compile) the code in their first argument."""

RUNNER_ENV_NAMES = (
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    "PYTEST_CURRENT_TEST",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "PYTHONSAFEPATH",
    "PYTHONWARNINGS",
    "PYTHONUSERBASE",
    "PYTHONNOUSERSITE",
    "PYTHONINSPECT",
    "PYTHONPLATLIBDIR",
)
"""Environment variables that change what the runner loads or how it runs."""

REPORT_WORDS = ("junit", "report.xml", "testsuite")
"""Words that a string naming the test report holds."""
