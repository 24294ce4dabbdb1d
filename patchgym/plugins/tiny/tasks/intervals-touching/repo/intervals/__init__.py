"""Small helpers for working with sets of closed numeric intervals.

An interval is a pair ``(start, end)`` with ``start <= end``.  Both ends are
included, so ``(1, 3)`` and ``(3, 5)`` share the point 3 and their union is
the single interval ``(1, 5)``.  Functions accept any iterable of pairs and
return lists of tuples.
"""

__all__ = ["normalize", "merge", "total_length", "gaps", "contains", "intersect"]


def normalize(interval):
    """Validate *interval* and return it as a ``(start, end)`` tuple.

    Raises TypeError if it is not a pair and ValueError if ``start > end``.
    """
    try:
        start, end = interval
    except (TypeError, ValueError):
        raise TypeError("interval must be a (start, end) pair: %r" % (interval,)) from None
    if start > end:
        raise ValueError("interval start is after its end: %r" % (interval,))
    return (start, end)


def merge(intervals):
    """Return the union of *intervals* as a sorted list of disjoint intervals.

    Intervals that overlap or touch (share an endpoint) are combined into one.

        >>> merge([(5, 8), (1, 3), (2, 4)])
        [(1, 4), (5, 8)]
    """
    merged = []
    for start, end in sorted(normalize(item) for item in intervals):
        if merged and start < merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    """Return the total length covered by *intervals*, counting overlaps once."""
    return sum(end - start for start, end in merge(intervals))


def gaps(intervals):
    """Return the uncovered stretches between the merged *intervals*.

    Each gap is returned as ``(end_of_previous, start_of_next)``.

        >>> gaps([(0, 2), (5, 6), (1, 3)])
        [(3, 5)]
    """
    merged = merge(intervals)
    return [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]


def contains(intervals, point):
    """Return True if *point* lies inside (or on the edge of) any interval."""
    return any(start <= point <= end for start, end in merge(intervals))


def intersect(first, second):
    """Return the points covered by both interval sets, as merged intervals."""
    a, b = merge(first), merge(second)
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if start <= end:
            result.append((start, end))
        # Advance whichever interval finishes first.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result
