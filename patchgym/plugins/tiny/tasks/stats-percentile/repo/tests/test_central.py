import unittest

from statkit import mean, median, mode


class CentralTests(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)
        self.assertEqual(mean(iter([7])), 7)

    def test_median_odd_and_even(self):
        self.assertEqual(median([5, 1, 3]), 3)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_mode_prefers_first_seen_on_ties(self):
        self.assertEqual(mode([3, 1, 3, 2, 1]), 3)
        self.assertEqual(mode(["b", "a", "a"]), "a")

    def test_empty_data_is_rejected(self):
        for func in (mean, median, mode):
            with self.assertRaises(ValueError, msg=func.__name__):
                func([])


if __name__ == "__main__":
    unittest.main()
