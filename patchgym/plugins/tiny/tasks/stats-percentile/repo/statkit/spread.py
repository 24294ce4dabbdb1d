"""Measures of spread and position."""

import math

from .central import _as_list, mean


def variance(data, sample=True):
    """Return the variance of *data*.

    With ``sample=True`` (the default) Bessel's correction is applied and
    at least two data points are needed.
    """
    values = _as_list(data)
    if sample and len(values) < 2:
        raise ValueError("sample variance requires at least two data points")
    centre = mean(values)
    squares = sum((x - centre) ** 2 for x in values)
    return squares / (len(values) - 1 if sample else len(values))


def stdev(data, sample=True):
    """Return the standard deviation of *data* (square root of the variance)."""
    return math.sqrt(variance(data, sample=sample))


def percentile(data, p):
    """Return the *p*-th percentile of *data*, for ``0 <= p <= 100``.

    Uses linear interpolation between the two closest ranks (the default
    method of spreadsheets and NumPy): the sorted values sit at positions
    ``0 .. n-1`` and the percentile lies at position ``(n - 1) * p / 100``.
    """
    if not 0 <= p <= 100:
        raise ValueError("percentile must be between 0 and 100, got %r" % (p,))
    values = sorted(_as_list(data))
    position = (len(values) - 1) * p / 100
    lower = math.floor(position)
    upper = math.ceil(position)
    if lower == upper:
        return values[lower]
    # Weight each neighbour by how close the position is to it.
    return values[lower] * (position - lower) + values[upper] * (upper - position)


def quartiles(data):
    """Return the first, second and third quartiles as a tuple."""
    values = sorted(_as_list(data))
    return tuple(percentile(values, p) for p in (25, 50, 75))


def iqr(data):
    """Return the interquartile range (third minus first quartile)."""
    q1, _, q3 = quartiles(data)
    return q3 - q1
