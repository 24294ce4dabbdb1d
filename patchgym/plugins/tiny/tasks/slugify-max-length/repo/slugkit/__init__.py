"""Turn arbitrary titles into URL-friendly slugs.

    >>> slugify("Héllo, Wörld!")
    'hello-world'
"""

import re
import unicodedata

__all__ = ["slugify", "unique_slug"]

_WORD = re.compile(r"[A-Za-z0-9]+")
_APOSTROPHES = re.compile(r"['\u2019]")


def slugify(text, separator="-", max_length=None, lowercase=True):
    """Return a slug made of the ASCII letters and digits of *text*.

    Accented characters are reduced to their base letter, apostrophes are
    dropped so that "don't" becomes "dont", and every other run of
    punctuation or whitespace becomes a single *separator*.

    If *max_length* is given the slug is cut to at most that many
    characters; the result never starts or ends with a separator.
    """
    if max_length is not None and max_length < 1:
        raise ValueError("max_length must be positive, got %r" % (max_length,))
    text = unicodedata.normalize("NFKD", text)
    text = text.encode("ascii", "ignore").decode("ascii")
    text = _APOSTROPHES.sub("", text)
    if lowercase:
        text = text.lower()
    slug = separator.join(_WORD.findall(text))
    if max_length is not None:
        slug = slug[:max_length]
    return slug


def unique_slug(text, existing, separator="-", **options):
    """Return a slug for *text* that is not in the *existing* collection.

    When the plain slug is taken, a counter is appended: ``title``,
    ``title-2``, ``title-3``, ...
    """
    base = slugify(text, separator=separator, **options)
    candidate = base
    counter = 2
    while candidate in existing:
        candidate = "%s%s%d" % (base, separator, counter)
        counter += 1
    return candidate
