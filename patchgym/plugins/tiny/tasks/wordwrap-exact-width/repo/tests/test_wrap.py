import unittest

from wordwrap import wrap


class WrapTests(unittest.TestCase):
    def test_short_text_is_one_line(self):
        self.assertEqual(wrap("hello world", 20), ["hello world"])

    def test_empty_and_blank_text(self):
        self.assertEqual(wrap("", 10), [])
        self.assertEqual(wrap("   \n\t ", 10), [])

    def test_greedy_wrapping(self):
        self.assertEqual(wrap("the quick brown fox", 10), ["the quick", "brown fox"])
        self.assertEqual(
            wrap("one two three four five six", 12),
            ["one two", "three four", "five six"],
        )

    def test_whitespace_is_collapsed(self):
        self.assertEqual(wrap("a\n\nb   c\td", 20), ["a b c d"])

    def test_line_may_fill_width_exactly(self):
        self.assertEqual(wrap("aaa bbb ccc", 7), ["aaa bbb", "ccc"])
        self.assertEqual(wrap("the quick brown fox", 9), ["the quick", "brown fox"])

    def test_long_words_are_broken(self):
        self.assertEqual(wrap("abcdefghij xy", 4), ["abcd", "efgh", "ij", "xy"])

    def test_long_words_kept_when_not_breaking(self):
        self.assertEqual(
            wrap("hi abcdefghij xy", 4, break_long_words=False),
            ["hi", "abcdefghij", "xy"],
        )

    def test_invalid_width(self):
        with self.assertRaises(ValueError):
            wrap("text", 0)


if __name__ == "__main__":
    unittest.main()
