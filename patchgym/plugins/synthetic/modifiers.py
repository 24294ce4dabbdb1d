"""AST-level bug modifiers: each turns one site of one function into a plausible bug.

A modifier finds its candidate sites in a function (`sites`) and rewrites one of them
(`rewrite`). Edits are spliced into the original text at the site's exact position, so the
rest of the file keeps its formatting and the bug patch stays small. Every mutation is
checked to parse and to change the module's AST.
"""

from __future__ import annotations

import ast
import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass

FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPE_TYPES = (*FUNCTION_TYPES, ast.ClassDef, ast.Lambda)
BLOCK_FIELDS = ("body", "orelse", "finalbody")

OPERATOR_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.And: ast.Or,
    ast.Or: ast.And,
}
"""Each operator's replacement, chosen within its precedence level so the text stays faithful."""


@dataclass(frozen=True)
class Site:
    """A place to mutate: an expression, one statement, or a run of statements in one block."""

    nodes: tuple[ast.AST, ...]
    block: tuple[ast.stmt, ...] = ()

    @property
    def is_statement(self) -> bool:
        return isinstance(self.nodes[0], ast.stmt)


@dataclass(frozen=True)
class Mutation:
    """One candidate bug: the mutated text of a file and where it came from."""

    modifier: str
    path: str
    function: str
    line: int
    original: str
    mutated: str


class Modifier:
    """Base class: `sites` lists candidate places in a function, `rewrite` mutates one.

    `rewrite` returns the replacement nodes (an empty list deletes statements) or None when
    this site cannot be mutated.
    """

    name: str = ""

    def sites(self, function: ast.AST) -> list[Site]:
        raise NotImplementedError

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        raise NotImplementedError


def own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """Every node in `function`'s body, not descending into nested functions, classes or f-strings."""
    stack = list(reversed(getattr(function, "body", [])))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (*SCOPE_TYPES, ast.JoinedStr)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def own_blocks(function: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every statement list in `function`: its body and the blocks of its compound statements."""
    yield function.body  # type: ignore[attr-defined]
    for node in own_nodes(function):
        if isinstance(node, SCOPE_TYPES):
            continue
        for name in BLOCK_FIELDS:
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for handler in getattr(node, "handlers", []):
            yield handler.body


def _statement_sites(function: ast.AST, kinds: tuple[type, ...]) -> list[Site]:
    return [
        Site((stmt,), tuple(block))
        for block in own_blocks(function)
        for stmt in block
        if isinstance(stmt, kinds) and not _is_docstring(stmt, block)
    ]


def _is_docstring(stmt: ast.stmt, block: list[ast.stmt]) -> bool:
    return stmt is block[0] and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


class InvertIfElse(Modifier):
    """Swap the bodies of an if/else, keeping the condition."""

    name = "ctrl_invert_if"

    def sites(self, function: ast.AST) -> list[Site]:
        return [site for site in _statement_sites(function, (ast.If,)) if site.nodes[0].orelse]  # type: ignore[attr-defined]

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        node = copy.deepcopy(site.nodes[0])
        assert isinstance(node, ast.If)
        node.body, node.orelse = node.orelse, node.body
        return [node]


class ShuffleLines(Modifier):
    """Reorder the statements of one block."""

    name = "ctrl_shuffle"

    def sites(self, function: ast.AST) -> list[Site]:
        sites = []
        for block in own_blocks(function):
            stmts = [s for s in block if not _is_docstring(s, block)]
            if len(stmts) >= 2 and len({ast.dump(s) for s in stmts}) > 1:
                sites.append(Site(tuple(stmts), tuple(block)))
        return sites

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        order = list(site.nodes)
        while [ast.dump(n) for n in order] == [ast.dump(n) for n in site.nodes]:
            rng.shuffle(order)
        return order


class _RemoveStatement(Modifier):
    kinds: tuple[type, ...] = ()

    def sites(self, function: ast.AST) -> list[Site]:
        return _statement_sites(function, self.kinds)

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        return []


class RemoveAssign(_RemoveStatement):
    """Delete one assignment."""

    name = "remove_assign"
    kinds = (ast.Assign, ast.AugAssign, ast.AnnAssign)


class RemoveConditional(_RemoveStatement):
    """Delete one `if` statement that has no `else`."""

    name = "remove_cond"

    def sites(self, function: ast.AST) -> list[Site]:
        return [site for site in _statement_sites(function, (ast.If,)) if not site.nodes[0].orelse]  # type: ignore[attr-defined]


class RemoveLoop(_RemoveStatement):
    """Delete one `for` or `while` loop."""

    name = "remove_loop"
    kinds = (ast.For, ast.AsyncFor, ast.While)


def _operator(node: ast.AST) -> ast.AST | None:
    """The operator of a binary or boolean operation or of a single comparison, else None."""
    if isinstance(node, (ast.BinOp, ast.BoolOp)):
        return node.op
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return node.ops[0]
    return None


def _swappable(node: ast.AST) -> bool:
    """A binary operation or single comparison whose two sides differ."""
    if isinstance(node, ast.BinOp):
        return ast.dump(node.left) != ast.dump(node.right)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return ast.dump(node.left) != ast.dump(node.comparators[0])
    return False


class ChangeOperator(Modifier):
    """Replace a binary, comparison or boolean operator by its neighbour (`<` → `<=`, `+` → `-`)."""

    name = "op_change"

    def sites(self, function: ast.AST) -> list[Site]:
        return [Site((node,)) for node in own_nodes(function) if type(_operator(node)) in OPERATOR_SWAPS]

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        node = copy.deepcopy(site.nodes[0])
        if isinstance(node, ast.Compare):
            node.ops = [OPERATOR_SWAPS[type(node.ops[0])]()]
        else:
            node.op = OPERATOR_SWAPS[type(node.op)]()  # type: ignore[attr-defined]
        return [node]


class SwapOperands(Modifier):
    """Swap the two sides of a binary operation or a comparison."""

    name = "op_swap"

    def sites(self, function: ast.AST) -> list[Site]:
        return [Site((node,)) for node in own_nodes(function) if _swappable(node)]

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        node = copy.deepcopy(site.nodes[0])
        if isinstance(node, ast.Compare):
            node.left, node.comparators = node.comparators[0], [node.left]
        else:
            assert isinstance(node, ast.BinOp)
            node.left, node.right = node.right, node.left
        return [node]


class ChangeConstant(Modifier):
    """Move an integer constant by one (off-by-one)."""

    name = "op_change_const"

    def sites(self, function: ast.AST) -> list[Site]:
        return [
            Site((node,)) for node in own_nodes(function) if isinstance(node, ast.Constant) and type(node.value) is int
        ]

    def rewrite(self, site: Site, rng: random.Random) -> list[ast.AST] | None:
        node = site.nodes[0]
        assert isinstance(node, ast.Constant)
        step = rng.choice((-1, 1)) if node.value > 0 else 1
        return [ast.Constant(node.value + step)]


MODIFIERS: dict[str, Modifier] = {
    m.name: m
    for m in (
        InvertIfElse(),
        ShuffleLines(),
        RemoveAssign(),
        RemoveConditional(),
        RemoveLoop(),
        ChangeOperator(),
        SwapOperands(),
        ChangeConstant(),
    )
}
"""The built-in modifiers by name (the name is the instance-id suffix after `func_pm_`)."""


def functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every function and method in `tree` with its qualified name, in source order."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCTION_TYPES):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif not isinstance(child, ast.Lambda):
                yield from walk(child, prefix)

    yield from walk(tree, "")


class _Text:
    """Source text addressed by the AST's (line, UTF-8 byte column) positions."""

    def __init__(self, source: str) -> None:
        self.data = source.encode()
        self.line_starts = [0]
        for index, byte in enumerate(self.data):
            if byte == 0x0A:
                self.line_starts.append(index + 1)

    def offset(self, line: int, column: int) -> int:
        return self.line_starts[line - 1] + column

    def line_span(self, first: int, last: int) -> tuple[int, int]:
        end = self.line_starts[last] if last < len(self.line_starts) else len(self.data)
        return self.line_starts[first - 1], end

    def line(self, number: int) -> bytes:
        return self.data[slice(*self.line_span(number, number))]


def _owns_lines(text: _Text, first: ast.stmt, last: ast.stmt) -> bool:
    """True when the statements fill whole lines (nothing else shares their first and last lines)."""
    head = text.line(first.lineno)[: first.col_offset]
    tail = text.line(last.end_lineno or last.lineno)[last.end_col_offset :]
    return not head.strip() and (not tail.strip() or tail.strip().startswith(b"#"))


def _splice(text: _Text, site: Site, replacement: list[ast.AST]) -> str | None:
    if not site.is_statement:
        node = site.nodes[0]
        start = text.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = text.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        new = ast.unparse(replacement[0]).encode()
        return (text.data[:start] + new + text.data[end:]).decode()
    first, last = site.nodes[0], site.nodes[-1]
    assert isinstance(first, ast.stmt) and isinstance(last, ast.stmt)
    if not _owns_lines(text, first, last):
        return None
    indent = text.line(first.lineno)[: first.col_offset].decode()
    if not replacement and len(site.nodes) == len(site.block):
        replacement = [ast.Pass()]
    body = "".join(
        "".join(f"{indent}{line}\n" if line else "\n" for line in ast.unparse(node).split("\n")) for node in replacement
    )
    start, end = text.line_span(first.lineno, last.end_lineno or last.lineno)
    return (text.data[:start] + body.encode() + text.data[end:]).decode()


def mutations(path: str, source: str, *, seed: int, modifiers: dict[str, Modifier] | None = None) -> Iterator[Mutation]:
    """One mutation per (function, modifier) that has a site, the site picked by `seed`.

    Deterministic: the same source, path and seed give the same mutations in the same order.
    Mutations that do not parse or do not change the AST are skipped.
    """
    tree = ast.parse(source)
    reference = ast.dump(tree)
    text = _Text(source)
    for qualname, function in functions(tree):
        for name, modifier in (modifiers or MODIFIERS).items():
            sites = modifier.sites(function)
            if not sites:
                continue
            rng = random.Random(f"{seed}:{path}:{qualname}:{name}")
            site = rng.choice(sites)
            replacement = modifier.rewrite(site, rng)
            mutated = None if replacement is None else _splice(text, site, replacement)
            if mutated is None or not _changes_ast(mutated, reference):
                continue
            line = site.nodes[0].lineno  # type: ignore[attr-defined]
            yield Mutation(name, path, qualname, line, source, mutated)


def _changes_ast(mutated: str, reference: str) -> bool:
    try:
        return ast.dump(ast.parse(mutated)) != reference
    except SyntaxError:
        return False
