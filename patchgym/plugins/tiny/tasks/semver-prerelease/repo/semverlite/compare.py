"""Precedence rules from section 11 of the Semantic Versioning 2.0.0 spec.

All functions return a negative number, zero or a positive number, like the
``cmp`` function of old.
"""


def _cmp(a, b):
    return (a > b) - (a < b)


def compare_identifiers(a, b):
    """Compare two dot-separated pre-release identifiers.

    Numeric identifiers are compared as integers and always have lower
    precedence than alphanumeric ones; alphanumeric identifiers are compared
    in ASCII order.
    """
    a_numeric, b_numeric = a.isdigit(), b.isdigit()
    if a_numeric and b_numeric:
        return _cmp(int(a), int(b))
    if a_numeric:
        return -1
    if b_numeric:
        return 1
    return _cmp(a, b)


def compare_prerelease(a, b):
    """Compare two pre-release tuples such as ``("rc", "1")``.

    The empty tuple means "no pre-release": a normal release has *higher*
    precedence than any of its pre-releases (``1.0.0-rc.1 < 1.0.0``).
    Otherwise identifiers are compared left to right and, when one tuple is
    a prefix of the other, the longer one wins.
    """
    if a == b:
        return 0
    if not a:
        return -1
    if not b:
        return 1
    for left, right in zip(a, b):
        result = compare_identifiers(left, right)
        if result:
            return result
    return _cmp(len(a), len(b))


def compare(first, second):
    """Compare two :class:`~semverlite.Version` objects by precedence.

    Build metadata is ignored, as the specification requires.
    """
    core = _cmp(
        (first.major, first.minor, first.patch),
        (second.major, second.minor, second.patch),
    )
    if core:
        return core
    return compare_prerelease(first.prerelease, second.prerelease)
