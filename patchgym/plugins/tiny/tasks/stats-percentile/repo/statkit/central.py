"""Measures of central tendency."""

from collections import Counter


def _as_list(data):
    values = list(data)
    if not values:
        raise ValueError("statistic requires at least one data point")
    return values


def mean(data):
    """Return the arithmetic mean of *data*."""
    values = _as_list(data)
    return sum(values) / len(values)


def median(data):
    """Return the middle value of *data*.

    For an even number of points this is the mean of the two middle ones.
    """
    values = sorted(_as_list(data))
    middle = len(values) // 2
    if len(values) % 2:
        return values[middle]
    return (values[middle - 1] + values[middle]) / 2


def mode(data):
    """Return the most common value; ties go to the value seen first."""
    counts = Counter(_as_list(data))
    return counts.most_common(1)[0][0]
