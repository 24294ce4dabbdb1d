"""statkit: descriptive statistics for small in-memory samples.

The functions accept any iterable of real numbers and never modify it.
"""

from .central import mean, median, mode
from .spread import iqr, percentile, quartiles, stdev, variance

__all__ = [
    "mean", "median", "mode",
    "variance", "stdev", "percentile", "quartiles", "iqr",
]
