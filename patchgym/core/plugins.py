"""The plugin registry: task sets, sandbox, inference and trainer backends by name.

Plugins are pluggy plugins with registrar hooks (`register_task_sets(register)`, ...). The
built-ins are loaded by module name and third-party plugins from the entry-point group
`patchgym`; both register through the same hooks. Each plugin is loaded and called in
isolation: one that fails is reported (`patchgym plugins`) and the rest keep working. Two
plugins registering the same name make that name an error that names both. Environment:
`PATCHGYM_DISABLE_PLUGINS=a,b` blocks plugins; `PATCHGYM_PLUGINS=a,b` loads only those
third-party plugins. A name of the form "module:attr" resolves without any registration.

Each registration has an options model (pydantic): the one given as `register(..., options=Model)`,
else one read from the factory's signature (names, types, defaults). `Registry.check` validates a
part's options against it without building anything, and errors list the valid options
(`patchgym plugins --options NAME` shows them).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

import pluggy
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from patchgym.core.errors import ConfigError, PluginError
from patchgym.core.option_docs import option_descriptions

PROJECT = "patchgym"
ENTRY_POINT_GROUP = "patchgym"
PLUGIN_API_VERSION = 1
"""The plugin API this patchgym speaks (see docs/plugins.md for what it covers). A plugin module
declares the one it was written for with `PATCHGYM_PLUGIN_API = 1`; another value is refused."""

BUILTIN_PLUGINS = {
    "builtin-sandboxes": "patchgym.backends.sandbox.plugin",
    "builtin-inference": "patchgym.backends.inference.plugin",
    "builtin-tasks": "patchgym.plugins.folder",
    "builtin-trainers": "patchgym.backends.trainer.plugin",
    "builtin-swebench": "patchgym.plugins.swebench",
    "builtin-swesmith": "patchgym.plugins.swesmith",
    "builtin-harbor": "patchgym.plugins.harbor",
    "builtin-synthetic": "patchgym.plugins.synthetic.taskset",
}

Kind = Literal["task_set", "sandbox", "inference", "trainer"]
KIND_LABELS: dict[Kind, str] = {
    "task_set": "task set",
    "sandbox": "sandbox backend",
    "inference": "inference backend",
    "trainer": "trainer backend",
}
HOOKS: dict[str, Kind] = {
    "register_task_sets": "task_set",
    "register_sandbox_backends": "sandbox",
    "register_inference_backends": "inference",
    "register_trainer_backends": "trainer",
}

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
Register = Callable[..., None]


class HookSpecs:
    """Registrar hooks. Each receives `register(name, factory, description="", options=None)`; `options`
    is a pydantic model of the factory's keyword options (default: read from its signature)."""

    @hookspec
    def register_task_sets(self, register: Register) -> None:
        """Register task sets: `factory(**options) -> TaskSet`."""

    @hookspec
    def register_sandbox_backends(self, register: Register) -> None:
        """Register sandbox backends: `factory(**settings) -> SandboxBackend`."""

    @hookspec
    def register_inference_backends(self, register: Register) -> None:
        """Register inference backends: `factory(**settings) -> InferenceEngine`."""

    @hookspec
    def register_trainer_backends(self, register: Register) -> None:
        """Register trainer backends: `factory(**settings) -> Trainer`."""


@dataclass(frozen=True)
class Registration:
    kind: Kind
    name: str
    factory: Callable[..., Any]
    plugin: str
    description: str = ""
    options: type[BaseModel] | None = None

    def options_model(self) -> type[BaseModel]:
        """The declared options model, else one derived from the factory's signature."""
        return self.options or options_model_of(self.factory, f"{self.name}-options")


@dataclass
class PluginRecord:
    """What happened to one plugin: `status` is loaded, failed or disabled."""

    name: str
    source: str
    status: str = "loaded"
    error: str | None = None
    registered: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "source", "status", "error", "registered")}


def _env_names(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    return None if value is None else {name.strip() for name in value.split(",") if name.strip()}


def _short_error(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _check_api_version(plugin: Any) -> None:
    """Refuse a plugin written for another plugin API, saying which side to upgrade."""
    version = getattr(plugin, "PATCHGYM_PLUGIN_API", PLUGIN_API_VERSION)
    if version == PLUGIN_API_VERSION:
        return
    newer = isinstance(version, int) and version > PLUGIN_API_VERSION
    fix = "upgrade patchgym" if newer else "upgrade the plugin, or use a patchgym that speaks its API"
    raise PluginError(
        f"plugin API {version!r} is not supported: this patchgym speaks plugin API {PLUGIN_API_VERSION}; {fix}"
    )


class Registry:
    """Loads plugins once, lazily, and resolves names to factories."""

    def __init__(
        self,
        builtins: dict[str, str] | None = None,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> None:
        self._builtins = BUILTIN_PLUGINS if builtins is None else builtins
        self._group = entry_point_group
        self._loaded = False
        self._records: dict[str, PluginRecord] = {}
        self._entries: dict[tuple[Kind, str], list[Registration]] = {}
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(HookSpecs)

    # -- loading -----------------------------------------------------------------------
    def _candidates(self) -> Iterable[tuple[str, str, Callable[[], Any]]]:
        for name, module in self._builtins.items():
            yield name, f"builtin module {module}", lambda module=module: importlib.import_module(module)
        if self._group is None:
            return
        allowed = _env_names("PATCHGYM_PLUGINS")
        for ep in importlib.metadata.entry_points(group=self._group):
            if allowed is not None and ep.name not in allowed:
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            yield ep.name, f"entry point {ep.value} from {dist}", ep.load

    def load(self) -> None:
        """Import every plugin and call its registrar hooks, each in isolation."""
        if self._loaded:
            return
        self._loaded = True
        disabled = _env_names("PATCHGYM_DISABLE_PLUGINS") or set()
        for name, source, loader in self._candidates():
            if name in self._records:
                self._records[f"{name} ({source})"] = PluginRecord(
                    name, source, "failed", f"another plugin is already named {name!r} ({self._records[name].source})"
                )
                continue
            record = self._records[name] = PluginRecord(name, source)
            if name in disabled:
                record.status = "disabled"
                continue
            try:
                plugin = loader()
                _check_api_version(plugin)
                self.manager.register(plugin, name=name)
                self.manager.check_pending()
            except (Exception, SystemExit) as exc:  # a broken plugin must not break the others
                if self.manager.has_plugin(name):
                    self.manager.unregister(name=name)
                record.status, record.error = "failed", _short_error(exc)
        for hook_name, kind in HOOKS.items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                self._call_registrar(impl, kind)

    def _call_registrar(self, impl: pluggy.HookImpl, kind: Kind) -> None:
        record = self._records[impl.plugin_name]
        if record.status != "loaded":  # failed in an earlier registrar: it contributes nothing
            return
        staged: list[Registration] = []

        def register(
            name: str, factory: Callable[..., Any], description: str = "", options: type[BaseModel] | None = None
        ) -> None:
            if not isinstance(name, str) or not name or ":" in name:
                raise PluginError(f"invalid {KIND_LABELS[kind]} name {name!r}: use a non-empty name without ':'")
            staged.append(Registration(kind, name, factory, impl.plugin_name, description, options))

        try:
            impl.function(register=register)
        except Exception as exc:
            record.status, record.error = "failed", _short_error(exc)
            self._forget(impl.plugin_name)
            return
        for registration in staged:
            self._entries.setdefault((kind, registration.name), []).append(registration)
            record.registered.append(f"{KIND_LABELS[kind]}:{registration.name}")

    def _forget(self, plugin: str) -> None:
        """Drop what `plugin` registered in its earlier registrar hooks."""
        for key, regs in list(self._entries.items()):
            kept = [r for r in regs if r.plugin != plugin]
            if kept:
                self._entries[key] = kept
            else:
                del self._entries[key]
        self._records[plugin].registered.clear()

    def register(self, kind: Kind, name: str, factory: Callable[..., Any], *, plugin: str = "<runtime>") -> None:
        """Register a factory directly (for programs and tests that build their own parts)."""
        self.load()
        self._entries.setdefault((kind, name), []).append(Registration(kind, name, factory, plugin))

    # -- lookup ------------------------------------------------------------------------
    def plugins(self) -> list[PluginRecord]:
        self.load()
        return list(self._records.values())

    def registrations(self, kind: Kind) -> list[Registration]:
        self.load()
        return [regs[0] for (k, _), regs in sorted(self._entries.items()) if k == kind]

    def names(self, kind: Kind) -> list[str]:
        return [registration.name for registration in self.registrations(kind)]

    def conflicts(self) -> list[str]:
        """A message for every name claimed by more than one plugin."""
        self.load()
        return [self._conflict_message(regs) for regs in self._entries.values() if len(regs) > 1]

    def _conflict_message(self, regs: list[Registration]) -> str:
        sources = " and ".join(
            f"plugin {r.plugin!r} ({self._records[r.plugin].source})" if r.plugin in self._records else f"{r.plugin!r}"
            for r in regs
        )
        return (
            f"{KIND_LABELS[regs[0].kind]} {regs[0].name!r} is registered by {sources}; "
            f"disable one with PATCHGYM_DISABLE_PLUGINS=<plugin name>"
        )

    def factory(self, kind: Kind, name: str) -> Callable[..., Any]:
        """The factory for `name`; "module:attr" is imported directly."""
        return self.registration(kind, name).factory

    def registration(self, kind: Kind, name: str) -> Registration:
        """The registration of `name` (one made on the fly for "module:attr")."""
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                return Registration(kind, name, getattr(importlib.import_module(module), attr), module)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"cannot load {KIND_LABELS[kind]} {name!r}: {exc}") from exc
        self.load()
        regs = self._entries.get((kind, name))
        if not regs:
            known = ", ".join(self.names(kind)) or "(none)"
            failed = [r.name for r in self._records.values() if r.status == "failed"]
            hint = f"; plugins that failed to load: {', '.join(failed)} (see `patchgym plugins`)" if failed else ""
            raise ConfigError(f"unknown {KIND_LABELS[kind]} {name!r}; known: {known}{hint}")
        if len(regs) > 1:
            raise PluginError(self._conflict_message(regs))
        return regs[0]

    def check(self, kind: Kind, name: str, options: dict[str, Any]) -> None:
        """Check that `name` exists and takes `options` (names, required ones, types), building nothing."""
        registration = self.registration(kind, name)
        model = registration.options_model()
        try:
            model.model_validate(options)
        except ValidationError as exc:
            raise ConfigError(_options_error(kind, name, model, exc)) from None

    def create(self, kind: Kind, name: str, **options: Any) -> Any:
        """Build the named part with `options`; options its factory does not take are a `ConfigError`."""
        registration = self.registration(kind, name)
        try:
            signature = inspect.signature(registration.factory)
        except (TypeError, ValueError):  # not introspectable: let the call decide
            signature = None
        if signature is not None:
            try:
                signature.bind(**options)
            except TypeError as exc:
                valid = describe_options(registration.options_model())
                raise ConfigError(f"invalid options for {KIND_LABELS[kind]} {name!r}: {exc}; {valid}") from exc
        return registration.factory(**options)


def _target(factory: Callable[..., Any]) -> Callable[..., Any]:
    """What to read type hints from: the class's `__init__`, a lazy factory's target, or the factory."""
    if isinstance(factory, LazyFactory):
        factory = factory.load()
    return factory.__init__ if inspect.isclass(factory) else factory  # type: ignore[misc]


def options_model_of(factory: Callable[..., Any], model_name: str) -> type[BaseModel]:
    """A pydantic model of a factory's keyword options, from its signature: unknown names are errors
    (unless it takes `**kwargs`), required ones must be given, and values must fit the annotations."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return create_model(model_name, __config__=ConfigDict(extra="allow"))
    try:
        hints = get_type_hints(_target(factory))
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    described = option_descriptions(factory.load() if isinstance(factory, LazyFactory) else factory)
    fields: dict[str, Any] = {}
    extra: Literal["allow", "forbid"] = "forbid"
    for p in parameters:
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hints.get(p.name, Any), Field(default, description=described.get(p.name) or None))
    config = ConfigDict(extra=extra, arbitrary_types_allowed=True, protected_namespaces=())
    try:
        return create_model(model_name, __config__=config, **fields)
    except Exception:  # an annotation pydantic cannot check: check names and required ones only
        untyped = {k: (Any, field) for k, (_, field) in fields.items()}
        return create_model(model_name, __config__=config, **untyped)


def describe_options(model: type[BaseModel]) -> str:
    """One line naming every option of `model`, with its default."""
    parts = []
    for name, info in model.model_fields.items():
        parts.append(name if info.is_required() else f"{name}={info.default!r}")
    more = " (and any other keyword)" if model.model_config.get("extra") == "allow" else ""
    return f"valid options: {', '.join(parts) or '(none)'}{more}"


def _options_error(kind: Kind, name: str, model: type[BaseModel], exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = {"extra_forbidden": "unknown option", "missing": "required option, not given"}.get(
            error["type"], error["msg"]
        )
        problems.append(f"{where}: {message}")
    return f"invalid options for {KIND_LABELS[kind]} {name!r}: {'; '.join(problems)}; {describe_options(model)}"


class LazyFactory:
    """A factory named "module:attr", imported on first use so optional dependencies stay optional.

    Its signature is the target's, so the registry checks options before anything is built; a
    missing dependency is a `ConfigError` carrying `install_hint`.
    """

    def __init__(self, target: str, install_hint: str = "") -> None:
        self.target = target
        self.install_hint = install_hint

    def load(self) -> Callable[..., Any]:
        module, _, attr = self.target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            hint = f": {self.install_hint}" if self.install_hint else ""
            raise ConfigError(f"{self.target} cannot be imported ({exc}){hint}") from exc

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.load())

    def __call__(self, **options: Any) -> Any:
        return self.load()(**options)


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry (created on first use)."""
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


def reset_registry() -> None:
    """Forget the process-wide registry, so the next use loads plugins afresh."""
    global _registry
    _registry = None
