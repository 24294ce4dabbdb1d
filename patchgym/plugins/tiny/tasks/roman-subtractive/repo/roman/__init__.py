"""Conversion between integers and Roman numerals.

Only the standard (canonical) notation is supported: whole numbers from
1 to 3999, written with the subtractive pairs IV, IX, XL, XC, CD and CM.

    >>> to_roman(1994)
    'MCMXCIV'
    >>> from_roman("mcmxciv")
    1994
"""

__all__ = ["MIN_VALUE", "MAX_VALUE", "to_roman", "from_roman", "is_roman"]

MIN_VALUE = 1
MAX_VALUE = 3999

# Largest first, so that a greedy walk produces the canonical spelling.
_NUMERALS = (
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"),
    (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"),
    (1, "I"),
)

_SYMBOLS = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def to_roman(number):
    """Return the Roman numeral for *number* as an upper-case string.

    Raises TypeError for anything that is not an ``int`` (``bool`` included)
    and ValueError when *number* is outside ``MIN_VALUE..MAX_VALUE``.
    """
    if isinstance(number, bool) or not isinstance(number, int):
        raise TypeError("expected an int, got %s" % type(number).__name__)
    if not MIN_VALUE <= number <= MAX_VALUE:
        raise ValueError(
            "number out of range (%d..%d): %d" % (MIN_VALUE, MAX_VALUE, number)
        )
    parts = []
    for value, symbol in _NUMERALS:
        count, number = divmod(number, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(numeral):
    """Parse a Roman numeral and return its integer value.

    Parsing ignores case and surrounding whitespace.  A symbol that is
    followed by a larger one is subtracted (as the I in "IX"), every other
    symbol is added.  Spellings that :func:`to_roman` would never produce,
    such as "IIII", "VX" or "IC", are rejected with ValueError.
    """
    if not isinstance(numeral, str):
        raise TypeError("expected a str, got %s" % type(numeral).__name__)
    text = numeral.strip().upper()
    if not text:
        raise ValueError("empty Roman numeral")

    total = 0
    last = len(text) - 1
    for index, char in enumerate(text):
        try:
            value = _SYMBOLS[char]
        except KeyError:
            raise ValueError("invalid Roman numeral symbol: %r" % char) from None
        # Look ahead: a smaller symbol before a larger one is subtractive.
        if index < last - 1 and value < _SYMBOLS.get(text[index + 1], 0):
            total -= value
        else:
            total += value

    # Reject non-canonical forms by checking that they round-trip.
    if not MIN_VALUE <= total <= MAX_VALUE or to_roman(total) != text:
        raise ValueError("not a canonical Roman numeral: %r" % numeral)
    return total


def is_roman(numeral):
    """Return True if *numeral* is a valid, canonical Roman numeral."""
    try:
        from_roman(numeral)
    except (TypeError, ValueError):
        return False
    return True
