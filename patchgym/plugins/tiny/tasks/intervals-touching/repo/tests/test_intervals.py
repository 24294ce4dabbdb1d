import unittest

from intervals import contains, gaps, intersect, merge, normalize, total_length


class NormalizeTests(unittest.TestCase):
    def test_accepts_pairs(self):
        self.assertEqual(normalize([2, 7]), (2, 7))
        self.assertEqual(normalize((4, 4)), (4, 4))

    def test_rejects_bad_intervals(self):
        with self.assertRaises(ValueError):
            normalize((5, 1))
        with self.assertRaises(TypeError):
            normalize((1, 2, 3))
        with self.assertRaises(TypeError):
            normalize(7)


class MergeTests(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(merge([]), [])

    def test_overlapping_and_unsorted(self):
        self.assertEqual(merge([(5, 8), (1, 3), (2, 4)]), [(1, 4), (5, 8)])
        self.assertEqual(merge([(1, 10), (2, 3), (4, 5)]), [(1, 10)])

    def test_disjoint_intervals_are_kept(self):
        self.assertEqual(merge([(6, 7), (0, 1), (3, 4)]), [(0, 1), (3, 4), (6, 7)])

    def test_touching_intervals_are_merged(self):
        self.assertEqual(merge([(1, 3), (3, 5)]), [(1, 5)])
        self.assertEqual(merge([(3, 5), (0, 1), (1, 3)]), [(0, 5)])
        self.assertEqual(merge([(2, 2), (2, 2)]), [(2, 2)])


class QueryTests(unittest.TestCase):
    def test_total_length_counts_overlap_once(self):
        self.assertEqual(total_length([(0, 4), (2, 6), (10, 11)]), 7)
        self.assertEqual(total_length([]), 0)

    def test_gaps(self):
        self.assertEqual(gaps([(0, 2), (5, 6), (1, 3)]), [(3, 5)])
        self.assertEqual(gaps([(0, 1)]), [])

    def test_gaps_skip_touching_intervals(self):
        self.assertEqual(gaps([(0, 2), (2, 4), (6, 7)]), [(4, 6)])

    def test_contains(self):
        spans = [(0, 2), (5, 7)]
        self.assertTrue(contains(spans, 0))
        self.assertTrue(contains(spans, 6.5))
        self.assertTrue(contains(spans, 7))
        self.assertFalse(contains(spans, 3))

    def test_intersect(self):
        self.assertEqual(
            intersect([(0, 5), (8, 12)], [(3, 9), (11, 20)]),
            [(3, 5), (8, 9), (11, 12)],
        )
        self.assertEqual(intersect([(0, 1)], [(2, 3)]), [])


if __name__ == "__main__":
    unittest.main()
