import unittest

from statkit import iqr, median, percentile, quartiles, stdev, variance


class VarianceTests(unittest.TestCase):
    def test_sample_and_population_variance(self):
        data = [2, 4, 4, 4, 5, 5, 7, 9]
        self.assertAlmostEqual(variance(data, sample=False), 4.0)
        self.assertAlmostEqual(variance(data), 32 / 7)
        self.assertAlmostEqual(stdev(data, sample=False), 2.0)

    def test_sample_variance_needs_two_points(self):
        with self.assertRaises(ValueError):
            variance([1])
        self.assertEqual(variance([1], sample=False), 0)


class PercentileTests(unittest.TestCase):
    def test_extremes_are_min_and_max(self):
        data = [15, 20, 35, 40, 50]
        self.assertEqual(percentile(data, 0), 15)
        self.assertEqual(percentile(data, 100), 50)

    def test_exact_ranks(self):
        data = [50, 15, 40, 20, 35]
        self.assertEqual(percentile(data, 25), 20)
        self.assertEqual(percentile(data, 50), 35)
        self.assertEqual(percentile(data, 75), 40)

    def test_fiftieth_percentile_matches_median(self):
        for data in ([1, 2], [3, 1, 4, 1, 5, 9], [2.5, 7.5, 10, 20]):
            self.assertAlmostEqual(percentile(data, 50), median(data), msg=data)

    def test_interpolates_between_ranks(self):
        self.assertAlmostEqual(percentile([1, 2, 3, 4], 25), 1.75)
        self.assertAlmostEqual(percentile([10, 20], 90), 19.0)
        self.assertAlmostEqual(percentile([0, 100, 200], 30), 60.0)

    def test_quartiles_and_iqr(self):
        data = [7, 1, 3, 9, 5, 11]
        self.assertEqual(quartiles(data), (3.5, 6.0, 8.5))
        self.assertAlmostEqual(iqr(data), 5.0)

    def test_rejects_bad_input(self):
        with self.assertRaises(ValueError):
            percentile([1, 2, 3], 101)
        with self.assertRaises(ValueError):
            percentile([1, 2, 3], -1)
        with self.assertRaises(ValueError):
            percentile([], 50)


if __name__ == "__main__":
    unittest.main()
