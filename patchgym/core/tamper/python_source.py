"""Python source as the interpreter reads it: decoded by its own declared encoding (a PEP 263
coding cookie, a BOM: `compile` on the bytes does exactly what an import does), parsed with
`ast`, and walked for what non-test code has no honest reason to do: reach the test framework
(an import anywhere, `__import__`/`importlib`/`runpy`/`pkgutil` with a name folded from
constants), run code built at run time, or reach `sys.modules`, builtins, frames, audit and exit
hooks. Names are resolved through imports and aliases (`import sys as s; s.modules`,
`getattr(sys, "mod" + "ules")`, `vars(sys)["modules"]`)."""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from patchgym.core.tamper import names
from patchgym.core.tamper.folding import Folder

_BUILTIN_NAMES = frozenset(dir(builtins))
_PYTHON_SHEBANG = re.compile(rb"^#![^\n]*python")


@dataclass(frozen=True)
class Construct:
    """One thing a source does: what it means, a line, and a key (its text without position)."""

    what: str
    line: int
    key: str


def is_python(path: str, data: bytes | None) -> bool:
    """Whether `path` holds Python the runner may run: a `.py` file or a script with a python shebang."""
    if path.endswith((".py", ".pyw")):
        return True
    return "." not in path.rsplit("/", 1)[-1] and data is not None and bool(_PYTHON_SHEBANG.match(data))


def parse(data: bytes) -> ast.Module | None:
    """The module as the interpreter parses it (its declared encoding applied), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(data)
    except (SyntaxError, ValueError, UnicodeError, LookupError, MemoryError, RecursionError):
        return None


SUSPICIOUS_TOKENS = (
    names.FRAMEWORK_MODULES
    | {name.rsplit(".", 1)[-1] for name in names.REACHES}
    | {name.split(".")[0] for name in names.REACHES}
    | set(names.ATTRIBUTES)
    | {name.rsplit(".", 1)[-1] for name in names.IMPORTERS | names.EXECUTORS}
    | {"importlib", "runpy", "pkgutil", "getattr", "vars", "globals", "setattr"}
) - {"sys", "os", "types", "signal", "inspect"}
"""Names whose presence in a file that does not parse here leaves the file suspect."""


def unparsed_names(data: bytes) -> set[str] | None:
    """For a file `ast` cannot parse on this interpreter (newer syntax, a deliberate error): the
    suspicious names its tokens hold (in strings too), or None if it cannot even be tokenized
    under its declared encoding."""
    found: set[str] = set()
    try:
        for token in tokenize.tokenize(io.BytesIO(data).readline):
            if token.type == tokenize.NAME and token.string in SUSPICIOUS_TOKENS:
                found.add(token.string)
            elif token.type == tokenize.STRING:
                found |= {
                    word
                    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", token.string)
                    if word in names.FRAMEWORK_MODULES
                }
    except (tokenize.TokenError, SyntaxError, UnicodeError, LookupError, ValueError):
        return None
    return found


def constructs(tree: ast.Module) -> list[Construct]:
    """Every suspicious construct of a parsed module."""
    return list(_Visitor(tree).run())


def _text(node: ast.AST) -> str:
    try:
        return ast.unparse(node)[:200]
    except (ValueError, RecursionError):  # pragma: no cover - unparse handles what parse produced
        return type(node).__name__


class _Visitor(ast.NodeVisitor):
    def __init__(self, tree: ast.Module, depth: int = 0) -> None:
        self.tree = tree
        self.depth = depth
        self.aliases: dict[str, str] = {}
        self.shadowed: set[str] = set()
        self.found: list[Construct] = []
        self.folding = False
        nodes = list(ast.walk(tree))  # one walk, read by every table below
        self.parents = {child: node for node in nodes for child in ast.iter_child_nodes(node)}
        self.imported = {
            alias.asname or alias.name.split(".")[0]
            for node in nodes
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        constants: dict[str, ast.expr] = {}
        assigned: dict[str, int] = {}
        for node in nodes:
            for target, value in _assignments(node):
                if isinstance(target, ast.Name):
                    assigned[target.id] = assigned.get(target.id, 0) + 1
                    constants[target.id] = value
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.shadowed.add(node.name)
        self.folder = Folder({k: v for k, v in constants.items() if assigned[k] == 1}, self.qualname)
        self.shadowed |= {name for name in assigned if name in _BUILTIN_NAMES}
        self.bound = (
            set(assigned)
            | self.shadowed
            | {
                arg.arg
                for node in nodes
                if isinstance(node, ast.arguments)
                for arg in (*node.posonlyargs, *node.args, *node.kwonlyargs)
            }
        )
        # module aliases: every import binds a name, and `m = sys` binds one more
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in nodes:
            for target, value in _assignments(node):
                if isinstance(target, ast.Name) and target.id not in self.aliases:
                    resolved = self.qualname(value)
                    if resolved is not None:
                        self.aliases[target.id] = resolved

    def run(self) -> Iterator[Construct]:
        self.visit(self.tree)
        return iter(self.found)

    def add(self, what: str, node: ast.AST, key: str | None = None) -> None:
        self.found.append(Construct(what, getattr(node, "lineno", 0), key or _text(node)))

    # -- names ---------------------------------------------------------------------------

    def qualname(self, node: ast.expr, depth: int = 0) -> str | None:
        """The dotted name `node` refers to, where imports and constants decide it."""
        if depth > 30:
            return None
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            if node.id in _BUILTIN_NAMES and node.id not in self.shadowed:
                return f"builtins.{node.id}"
            if node.id == "__builtins__":
                return "builtins"
            if node.id in _INTERPRETER_MODULES and node.id not in self.bound:
                return node.id  # unbound here: a star import or injected global of that module
            return None
        if isinstance(node, ast.Attribute):
            owner = self.qualname(node.value, depth + 1)
            return f"{owner}.{node.attr}" if owner else None
        if isinstance(node, ast.Call):
            callee = self.qualname(node.func, depth + 1)
            if callee in ("builtins.getattr",) and len(node.args) >= 2:
                owner, attribute = self.qualname(node.args[0], depth + 1), self.folder.text(node.args[1])
                return f"{owner}.{attribute}" if owner and attribute else None
            if callee in ("builtins.__import__", "importlib.import_module", "importlib.__import__") and node.args:
                module = self.folder.text(node.args[0])
                if module and callee == "builtins.__import__" and not _fromlist(node):
                    module = module.split(".")[0]
                return module
            if callee == "builtins.vars" and len(node.args) == 1:
                owner = self.qualname(node.args[0], depth + 1)
                return f"{owner}.__dict__" if owner else None
            return None
        if isinstance(node, ast.Subscript):
            owner = self.qualname(node.value, depth + 1)
            key = self.folder.text(node.slice)
            if owner and key and owner.endswith(".__dict__"):
                return f"{owner.removesuffix('.__dict__')}.{key}"
            if owner == "sys.modules" and key:
                return key
            if owner == "builtins" and key:
                return f"builtins.{key}"
            return None
        return None

    def _reaches(self, name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            what = names.REACHES.get(".".join(parts[:end]))
            if what:
                return what
        if parts[0] in names.FRAMEWORK_MODULES:
            return names.IMPORTS_FRAMEWORK
        return None

    def _check_name(self, node: ast.expr, name: str | None, inner: ast.expr | None) -> bool:
        """Record what `name` reaches, once: not again where the inner expression already did."""
        if not name:
            return False
        what = self._reaches(name)
        if what is None or name.startswith("builtins.") and name.split(".")[1] in _SAFE_BUILTINS:
            return False
        reported_inside = not isinstance(inner, ast.Name) or (
            inner.id in self.aliases and inner.id not in self.imported
        )
        if inner is not None and reported_inside:
            inner_name = self.qualname(inner)
            if inner_name and self._reaches(inner_name) == what:
                return False
        self.add(what, node, f"{what}: {name}")
        return True

    # -- visits --------------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._imported(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        if node.module.split(".")[0] in names.FRAMEWORK_MODULES:
            self._imported(node, node.module)
            return
        for alias in node.names:
            self._imported(node, f"{node.module}.{alias.name}")

    def _imported(self, node: ast.AST, module: str) -> None:
        what = self._reaches(module)
        if what:
            self.add(what, node, f"{what}: {module}")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "__builtins__" and node.id not in self.aliases:
            self.add(names.INTERPRETER, node, "__builtins__")
        elif node.id in self.aliases and node.id not in self.imported and isinstance(node.ctx, ast.Load):
            # an alias bound by assignment (an import was recorded where it stands)
            self._check_name(node, self.aliases[node.id], None)

    def _reads_one_module(self, node: ast.Attribute) -> bool:
        """`sys.modules[__name__]`, `sys.modules["json"]`, `sys.modules.get("json")`: a read of
        one module named by a constant (not the framework) reaches nothing new."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Load):
            key = parent.slice
        elif isinstance(parent, ast.Attribute) and parent.attr == "get":
            call = self.parents.get(parent)
            key = call.args[0] if isinstance(call, ast.Call) and call.func is parent and call.args else None
        else:
            return False
        if isinstance(key, ast.Name) and key.id == "__name__":
            return True
        module = self.folder.text(key) if key is not None else None
        return module is not None and module.split(".")[0] not in names.FRAMEWORK_MODULES

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.qualname(node) == "sys.modules" and self._reads_one_module(node):
            self.generic_visit(node)
        elif node.attr in names.ATTRIBUTES:
            self.add(names.ATTRIBUTES[node.attr], node, f"attribute {node.attr}")
        else:
            self._check_name(node, self.qualname(node), node.value)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._check_name(node, self.qualname(node), node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        callee = self.qualname(node.func)
        if (
            callee in ("builtins.getattr", "builtins.setattr", "builtins.delattr", "builtins.hasattr")
            and len(node.args) >= 2
        ):
            self._attribute_call(node, callee)
        elif callee in names.IMPORTERS:
            self._import_call(node, callee)
        elif callee in names.EXECUTORS:
            self._exec_call(node, callee)
        elif any(keyword.arg == "start_new_session" for keyword in node.keywords):
            self.add(names.DAEMONS, node)
        elif callee == "builtins.vars" and len(node.args) == 1:
            self._check_name(node, self.qualname(node), None)
        self.generic_visit(node)

    def _attribute_call(self, node: ast.Call, callee: str) -> None:
        attribute = self.folder.text(node.args[1])
        owner = self.qualname(node.args[0])
        if attribute is None:
            if owner and (owner.split(".")[0] in _INTERPRETER_MODULES or self._reaches(owner)):
                self.add(names.INTERPRETER, node, f"computed attribute of {owner}")
            return
        if attribute in names.ATTRIBUTES:
            self.add(names.ATTRIBUTES[attribute], node, f"attribute {attribute}")
        elif owner:
            self._check_name(node, f"{owner}.{attribute}", node.args[0])

    def _import_call(self, node: ast.Call, callee: str) -> None:
        target = self.folder.text(node.args[0]) if node.args else None
        if target is None:
            self.add(names.COMPUTED_IMPORT, node)
            return
        module = (
            target.replace("/", ".").removesuffix(".py")
            if callee.endswith(("_path", "FileLoader", "file_location"))
            else target
        )
        if any(part in names.FRAMEWORK_MODULES for part in re.split(r"[./\\:]", module)):
            self.add(names.IMPORTS_FRAMEWORK, node, f"{names.IMPORTS_FRAMEWORK}: {target}")
        elif callee.endswith(("_path", "FileLoader", "file_location", "zipimporter")):
            self.add(names.COMPUTED_IMPORT, node)  # a module from a file: whatever the file holds
        else:
            self._check_name(node, module, None)

    def _exec_call(self, node: ast.Call, callee: str) -> None:
        code = self.folder.text(node.args[0]) if node.args else None
        if code is None or self.depth > 3:
            self.add(names.DYNAMIC_CODE, node)
            return
        inner = parse(code.encode("utf-8", "surrogatepass")) if callee != "builtins.eval" else _parse_eval(code)
        if inner is None:
            return  # the call raises SyntaxError: it runs nothing
        for construct in _Visitor(inner, self.depth + 1).run():
            self.found.append(Construct(construct.what, node.lineno, f"{construct.key} (in {callee})"))

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str | bytes) and not self.folding:
            self._string(node, node.value if isinstance(node.value, str) else node.value.decode("latin-1"))

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, _FOLDABLE) and not self.folding:
            text = self.folder.text(node)  # type: ignore[arg-type]
            if text is not None:
                self._string(node, text)
                self.folding = True  # its parts hold less than the whole: not read again
                try:
                    super().visit(node)
                finally:
                    self.folding = False
                return
        super().visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant):
            return  # a docstring or a bare string: nothing reads it
        self.generic_visit(node)

    def _string(self, node: ast.AST, text: str) -> None:
        lowered = text.lower()
        if any(word in lowered for word in names.REPORT_WORDS):
            self.add(names.REPORT, node, f"{names.REPORT}: {text[:100]}")
        for variable in names.RUNNER_ENV_NAMES:
            # in Python only pytest's own variables: honest code reads PYTHONPATH and the like
            if variable.startswith("PYTEST_") and variable in text:
                self.add(names.RUNNER_ENV, node, f"{names.RUNNER_ENV}: {variable}")
        if "pytest11" in text:
            self.add(names.PLUGIN, node, "pytest11")


_FOLDABLE = (ast.BinOp, ast.JoinedStr, ast.Call, ast.Subscript)
_SAFE_BUILTINS = frozenset(_BUILTIN_NAMES - {"__import__", "exec", "eval", "compile", "__builtins__"})
"""Builtins that reach nothing by themselves (`builtins.open` is `open`)."""
_INTERPRETER_MODULES = frozenset(
    {
        "sys",
        "builtins",
        "importlib",
        "inspect",
        "gc",
        "os",
        "atexit",
        "signal",
        "ctypes",
        "runpy",
        "pkgutil",
        "types",
        "marshal",
        "threading",
        "faulthandler",
        "traceback",
    }
)
"""Modules whose attributes may not be read by a computed name."""


def _assignments(node: ast.AST) -> Iterator[tuple[ast.expr, ast.expr]]:
    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield target, node.value
    elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
        yield node.target, node.value


def _fromlist(node: ast.Call) -> bool:
    fromlist = (
        node.args[3] if len(node.args) > 3 else next((k.value for k in node.keywords if k.arg == "fromlist"), None)
    )
    return fromlist is not None and not (isinstance(fromlist, ast.Constant) and not fromlist.value)


def _parse_eval(code: str) -> ast.Module | None:
    try:
        expression = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    return ast.Module(body=[ast.Expr(expression.body)], type_ignores=[])
