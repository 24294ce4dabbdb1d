"""The synthetic generator's bug modifiers, diffs and issue texts on small hand-written code."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from patchgym.plugins.synthetic.issues import error_text, failing_test_source, scrub, write_issue
from patchgym.plugins.synthetic.modifiers import MODIFIERS, functions, mutations
from patchgym.plugins.synthetic.patches import reverse_patch, unified_diff

CODE = '''\
"""A module."""

LIMIT = 100  # module level: never mutated


def score(xs, n):
    """Docstring stays."""
    total = 0
    for x in xs:  # a comment kept outside the edited site
        if x > n:
            total += x
        else:
            total -= 7
    if n < 0:
        return None
    while n >= 10:
        n //= 3
    return total * 5


class Box:
    def size(self, width):
        return width - 4
'''


def variants(code: str, old: str, new: str) -> set[str]:
    """`code` with each single occurrence of `old` replaced by `new`."""
    found, start = set(), code.find(old)
    while start != -1:
        found.add(code[:start] + new + code[start + len(old) :])
        start = code.find(old, start + 1)
    return found


def one(name: str, function: str = "score", code: str = CODE, seed: int = 0) -> str:
    result = [
        m for m in mutations("m.py", code, seed=seed, modifiers={name: MODIFIERS[name]}) if m.function == function
    ]
    assert len(result) == 1, result
    assert result[0].modifier == name and result[0].original == code
    return result[0].mutated


EXPECTED = {
    "ctrl_invert_if": {
        CODE.replace(
            "        if x > n:\n            total += x\n        else:\n            total -= 7\n",
            "        if x > n:\n            total -= 7\n        else:\n            total += x\n",
        )
    },
    "op_change": variants(CODE, "x > n", "x >= n")
    | variants(CODE, "n < 0", "n <= 0")
    | variants(CODE, "n >= 10", "n > 10")
    | variants(CODE, "total * 5", "total // 5"),
    "op_swap": variants(CODE, "x > n", "n > x")
    | variants(CODE, "n < 0", "0 < n")
    | variants(CODE, "n >= 10", "10 >= n")
    | variants(CODE, "total * 5", "5 * total"),
    "op_change_const": variants(CODE, "total = 0", "total = 1")
    | variants(CODE, "total -= 7", "total -= 6")
    | variants(CODE, "total -= 7", "total -= 8")
    | variants(CODE, "n < 0", "n < 1")
    | variants(CODE, "n >= 10", "n >= 9")
    | variants(CODE, "n >= 10", "n >= 11")
    | variants(CODE, "n //= 3", "n //= 2")
    | variants(CODE, "n //= 3", "n //= 4")
    | variants(CODE, "total * 5", "total * 4")
    | variants(CODE, "total * 5", "total * 6"),
    "remove_assign": variants(CODE, "    total = 0\n", "")
    | variants(CODE, "            total += x\n", "            pass\n")
    | variants(CODE, "            total -= 7\n", "            pass\n")
    | variants(CODE, "        n //= 3\n", "        pass\n"),
    "remove_cond": variants(CODE, "    if n < 0:\n        return None\n", ""),
    "remove_loop": variants(CODE, "    while n >= 10:\n        n //= 3\n", "")
    | {CODE.replace(CODE[CODE.index("    for x") : CODE.index("    if n < 0")], "")},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_modifier_makes_its_intended_change(name: str) -> None:
    mutated = one(name)
    assert mutated in EXPECTED[name], mutated
    assert '"""Docstring stays."""' in mutated and "LIMIT = 100" in mutated


def test_every_modifier_is_covered() -> None:
    assert set(MODIFIERS) == set(EXPECTED) | {"ctrl_shuffle"}


def simple_statements(code: str) -> list[str]:
    return sorted(ast.dump(n) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.stmt) and not hasattr(n, "body"))


def test_shuffle_reorders_one_block_and_keeps_its_statements() -> None:
    mutated = one("ctrl_shuffle")
    assert mutated != CODE and simple_statements(mutated) == simple_statements(CODE)
    assert ast.dump(ast.parse(mutated).body[3]) == ast.dump(ast.parse(CODE).body[3])  # class Box untouched


def test_methods_are_mutated_with_their_qualified_name() -> None:
    assert [name for name, _ in functions(ast.parse(CODE))] == ["score", "Box.size"]
    assert one("op_change", "Box.size") == CODE.replace("width - 4", "width + 4")
    assert one("op_swap", "Box.size") == CODE.replace("width - 4", "4 - width")


def test_mutations_are_deterministic_given_the_seed() -> None:
    first = [m.mutated for m in mutations("m.py", CODE, seed=3)]
    assert first == [m.mutated for m in mutations("m.py", CODE, seed=3)]
    others = {tuple(m.mutated for m in mutations("m.py", CODE, seed=seed)) for seed in range(8)}
    assert len(others) > 1  # the seed picks among several sites


def test_statements_sharing_a_line_are_not_cut_apart() -> None:
    code = "def f(a):\n    b = a; c = b\n    return c\n"
    assert [m for m in mutations("m.py", code, seed=0, modifiers={"remove_assign": MODIFIERS["remove_assign"]})] == []


def test_non_ascii_text_before_a_site_keeps_offsets_right() -> None:
    code = "def f(a):\n    s = 'ééé'; return a + len(s) - 1\n"
    mutated = one("op_change", "f", code)
    assert mutated in variants(code, "len(s) - 1", "len(s) + 1") | variants(code, "a + len(s)", "a - len(s)")
    ast.parse(mutated)


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_bug_patch_and_its_reverse_apply_with_git(tmp_path: Path, trailing_newline: bool) -> None:
    old = CODE if trailing_newline else CODE.rstrip("\n")
    new = one("op_change", "Box.size", code=old)
    patch = unified_diff("pkg/m.py", old, new)
    (tmp_path / "pkg").mkdir()
    target = tmp_path / "pkg" / "m.py"
    target.write_text(old)
    for diff, expected in ((patch, new), (reverse_patch(patch), old)):
        (tmp_path / "p.diff").write_text(diff)
        subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True, capture_output=True)
        assert target.read_text() == expected
    assert unified_diff("pkg/m.py", old, old) == ""


FAILURE = """Traceback (most recent call last):
  File "/w/tests/test_calc.py", line 9, in test_clamp_high
    self.assertEqual(clamp(5, 0, 3), 3)
    ^^^^^^^^^^^^^^^^
AssertionError: 5 != 3 : test_clamp_high in CalcTest
"""


def test_error_text_keeps_the_exception_not_the_frames() -> None:
    assert error_text(FAILURE) == "AssertionError: 5 != 3 : test_clamp_high in CalcTest"


def test_hard_issue_leaks_no_test_names(tmp_path: Path) -> None:
    test_id = "tests.test_calc.CalcTest.test_clamp_high"
    assert "test_clamp_high" not in scrub(FAILURE, [test_id]) and "CalcTest" not in scrub(FAILURE, [test_id])
    common = dict(file="calc/core.py", function="clamp", fail_to_pass=[test_id], messages={test_id: FAILURE})
    hard = write_issue(**common, snapshot=tmp_path, hard=True)  # type: ignore[arg-type]
    normal = write_issue(**common, snapshot=tmp_path, hard=False)  # type: ignore[arg-type]
    for leaked in ("test_clamp_high", "CalcTest", "test_calc", "clamp("):
        assert leaked not in hard
    assert "calc/core.py" in hard and "5 != 3" in hard
    assert test_id in normal and "`clamp`" in normal and "5 != 3" in normal


def test_normal_issue_shows_the_failing_test_as_reproduction(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_calc.py").write_text(
        "import unittest\n\n\nclass CalcTest(unittest.TestCase):\n"
        "    def test_clamp_high(self):\n        text = '''\\\nat column zero'''\n        self.assertEqual(text, 3)\n"
    )
    test_id = "tests.test_calc.CalcTest.test_clamp_high"
    assert failing_test_source(tmp_path, test_id) == (
        "def test_clamp_high(self):\n    text = '''\\\nat column zero'''\n    self.assertEqual(text, 3)"
    )
    assert failing_test_source(tmp_path, "tests.test_calc.CalcTest.test_missing") is None
    issue = write_issue(
        file="calc.py", function="clamp", fail_to_pass=[test_id], messages={}, snapshot=tmp_path, hard=False
    )
    assert "def test_clamp_high(self):" in issue
