"""semverlite: parse and order Semantic Versioning 2.0.0 version strings.

    >>> from semverlite import Version
    >>> Version.parse("1.4.0-rc.1") < Version.parse("1.4.0")
    True
"""

from .compare import compare, compare_identifiers, compare_prerelease
from .version import Version

__all__ = ["Version", "compare", "compare_identifiers", "compare_prerelease"]
