"""Constant folding of string expressions: the value a name or module string built at run time
will have, where the source decides it alone (`"unit" + "test"`, `"tset"[::-1]`,
`"".join(["py", "test"])`, `bytes.fromhex(...).decode()`, `base64.b64decode(...)`, `"%s" % x`,
f-strings of constants, module-level constants). Anything else folds to None: the caller treats
an unfoldable name as computed."""

from __future__ import annotations

import ast
import base64
import binascii
import codecs
import re
from collections.abc import Callable, Mapping

Value = str | bytes | int | tuple
MAX_LENGTH = 100_000
"""A folded value longer than this is not folded (no memory blow-up from `"x" * 10**9`)."""

_SAFE_CODECS = frozenset(
    {"utf-8", "utf8", "ascii", "latin-1", "latin1", "iso-8859-1", "rot13", "rot_13", "unicode_escape", "hex", "base64"}
)
_BYTE_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "base64.b64decode": base64.b64decode,
    "base64.b32decode": base64.b32decode,
    "base64.b16decode": base64.b16decode,
    "base64.b85decode": base64.b85decode,
    "base64.a85decode": base64.a85decode,
    "base64.urlsafe_b64decode": base64.urlsafe_b64decode,
    "base64.decodebytes": base64.decodebytes,
    "binascii.unhexlify": binascii.unhexlify,
    "binascii.a2b_base64": binascii.a2b_base64,
    "bytes.fromhex": lambda data: bytes.fromhex(data.decode() if isinstance(data, bytes) else data),
}
_PERCENT_FIELD = re.compile(r"%[^sr%]")
_FORMAT_FIELD = re.compile(r"\{[^}]*[^}\d][^}]*\}")
"""Only plain `%s`/`%r` and `{}`/`{0}` fields are folded: no widths (no memory blow-up) or attributes."""
_STRING_METHODS = frozenset(
    {"lower", "upper", "strip", "lstrip", "rstrip", "replace", "title", "capitalize", "swapcase", "casefold"}
)


class Folder:
    """Folds expressions of one module; `qualname` resolves a callee to a dotted name."""

    def __init__(self, constants: Mapping[str, ast.expr], qualname: Callable[[ast.expr], str | None]) -> None:
        self.constants = constants
        self.qualname = qualname

    def text(self, node: ast.expr) -> str | None:
        """The string `node` evaluates to (bytes decoded as Latin-1), or None."""
        value = self.fold(node)
        if isinstance(value, bytes):
            return value.decode("latin-1")
        return value if isinstance(value, str) else None

    def fold(self, node: ast.expr, depth: int = 0) -> Value | None:
        if depth > 50:
            return None
        try:
            value = self._fold(node, depth + 1)
        except (ValueError, TypeError, LookupError, binascii.Error, OverflowError, UnicodeError):
            return None
        if isinstance(value, str | bytes) and len(value) > MAX_LENGTH:
            return None
        return value

    def _fold(self, node: ast.expr, depth: int) -> Value | None:
        fold = self.fold
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str | bytes | int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.constants:
            return fold(self.constants[node.id], depth)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            operand = fold(node.operand, depth)
            return (-operand if isinstance(node.op, ast.USub) else operand) if isinstance(operand, int) else None
        if isinstance(node, ast.Tuple | ast.List):
            items = [fold(item, depth) for item in node.elts]
            return None if any(item is None for item in items) else tuple(items)
        if isinstance(node, ast.BinOp):
            left, right = fold(node.left, depth), fold(node.right, depth)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Add) and type(left) is type(right) and not isinstance(left, tuple):
                return left + right  # type: ignore[operator]
            if isinstance(node.op, ast.Mult) and isinstance(left, str | bytes) and isinstance(right, int):
                return left * right if len(left) * right <= MAX_LENGTH else None
            if isinstance(node.op, ast.Mod) and isinstance(left, str) and not _PERCENT_FIELD.search(left):
                return left % right
            return None
        if isinstance(node, ast.JoinedStr):
            parts = []
            for part in node.values:
                if isinstance(part, ast.FormattedValue):
                    if part.format_spec is not None:
                        return None
                    inner = fold(part.value, depth)
                    if inner is None:
                        return None
                    parts.append(repr(inner) if part.conversion == ord("r") else str(inner))
                else:
                    inner = fold(part, depth)
                    if not isinstance(inner, str):
                        return None
                    parts.append(inner)
            return "".join(parts)
        if isinstance(node, ast.Subscript):
            value = fold(node.value, depth)
            if not isinstance(value, str | bytes | tuple):
                return None
            if isinstance(node.slice, ast.Slice):
                parts = (node.slice.lower, node.slice.upper, node.slice.step)
                bounds = [None if part is None else fold(part, depth) for part in parts]
                if any(bound is None and part is not None for bound, part in zip(bounds, parts, strict=True)):
                    return None
                return value[slice(*bounds)]
            index = fold(node.slice, depth)
            return value[index] if isinstance(index, int) else None
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        return None

    def _call(self, node: ast.Call, depth: int) -> Value | None:
        if node.keywords:
            return None
        if (
            len(node.args) == 2
            and self.qualname(node.func) == "builtins.map"
            and self.qualname(node.args[0]) == "builtins.chr"
        ):
            codes = self.fold(node.args[1], depth)
            return tuple(chr(code) for code in codes) if isinstance(codes, tuple) else None
        args = [self.fold(arg, depth) for arg in node.args]
        if any(arg is None for arg in args):
            return None
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = self.fold(func.value, depth)
            if isinstance(owner, str | bytes):
                return self._method(owner, func.attr, args)
        name = self.qualname(func)
        name = name.removeprefix("builtins.") if name and name.startswith("builtins.bytes.") else name
        if name in _BYTE_FUNCTIONS and len(args) == 1 and isinstance(args[0], str | bytes):
            data = args[0].encode("latin-1") if isinstance(args[0], str) else args[0]
            return _BYTE_FUNCTIONS[name](data)
        if name in ("codecs.decode", "codecs.encode") and len(args) in (1, 2) and isinstance(args[0], str | bytes):
            encoding = args[1] if len(args) == 2 else "utf-8"
            if isinstance(encoding, str) and encoding.lower() in _SAFE_CODECS:
                return codecs.decode(args[0], encoding) if name == "codecs.decode" else codecs.encode(args[0], encoding)
            return None
        if name in ("builtins.chr",) and len(args) == 1 and isinstance(args[0], int):
            return chr(args[0])
        if name in ("builtins.str",) and len(args) == 1 and isinstance(args[0], str):
            return args[0]
        if name in ("builtins.bytes", "builtins.bytearray") and len(args) == 1 and isinstance(args[0], tuple):
            return bytes(args[0])
        if name == "builtins.reversed" and len(args) == 1 and isinstance(args[0], str | tuple):
            return tuple(reversed(args[0]))
        return None

    @staticmethod
    def _method(owner: str | bytes, method: str, args: list[Value]) -> Value | None:
        if method == "join" and len(args) == 1 and isinstance(args[0], tuple | str | bytes):
            return owner.join(args[0])  # type: ignore[arg-type]
        growth = len(args) >= 2 and isinstance(args[0], str | bytes) and args[0] and owner.count(args[0]) + 1  # type: ignore[arg-type]
        if method == "replace" and growth and growth * len(args[1]) > MAX_LENGTH:  # type: ignore[arg-type]
            return None
        if method in _STRING_METHODS:
            return getattr(owner, method)(*args)
        if method == "format" and isinstance(owner, str) and not _FORMAT_FIELD.search(owner):
            return owner.format(*args)
        if method in ("decode", "encode"):
            encoding = args[0] if args else "utf-8"
            if isinstance(encoding, str) and encoding.lower() in _SAFE_CODECS:
                return codecs.decode(owner, encoding) if method == "decode" else codecs.encode(owner, encoding)
        return None
