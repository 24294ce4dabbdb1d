"""The :class:`Version` value type."""

import re
from functools import total_ordering

from .compare import compare

_IDENT = r"[0-9A-Za-z-]+"
_PATTERN = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-(%s(?:\.%s)*))?"
    r"(?:\+(%s(?:\.%s)*))?$" % (_IDENT, _IDENT, _IDENT, _IDENT)
)


@total_ordering
class Version:
    """An immutable semantic version.

    ``prerelease`` and ``build`` are tuples of identifier strings; they are
    empty when the version has no pre-release or build part.
    """

    __slots__ = ("major", "minor", "patch", "prerelease", "build")

    def __init__(self, major, minor, patch, prerelease=(), build=()):
        self.major = major
        self.minor = minor
        self.patch = patch
        self.prerelease = tuple(prerelease)
        self.build = tuple(build)

    @classmethod
    def parse(cls, text):
        """Parse *text* (e.g. ``"2.0.1-beta.3+exp.sha.5114f85"``)."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError("invalid semantic version: %r" % text)
        major, minor, patch, pre, build = match.groups()
        prerelease = tuple(pre.split(".")) if pre else ()
        for ident in prerelease:
            if ident.isdigit() and len(ident) > 1 and ident.startswith("0"):
                raise ValueError("numeric identifier with leading zero: %r" % text)
        return cls(
            int(major), int(minor), int(patch),
            prerelease, tuple(build.split(".")) if build else (),
        )

    @property
    def is_prerelease(self):
        return bool(self.prerelease)

    def __str__(self):
        text = "%d.%d.%d" % (self.major, self.minor, self.patch)
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self):
        return "Version(%r)" % str(self)

    def __eq__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return compare(self, other) == 0

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return compare(self, other) < 0

    def __hash__(self):
        # Build metadata does not take part in equality, so not in the hash.
        return hash((self.major, self.minor, self.patch, self.prerelease))
