import unittest

from wordwrap import fill, shorten


class FillTests(unittest.TestCase):
    def test_fill_joins_lines(self):
        self.assertEqual(fill("the quick brown fox", 10), "the quick\nbrown fox")

    def test_fill_indent_counts_towards_width(self):
        self.assertEqual(fill("one two three", 10, indent="> "), "> one two\n> three")

    def test_fill_uses_full_width(self):
        text = "lorem ipsum dolor sit amet"
        self.assertEqual(fill(text, 11), "lorem ipsum\ndolor sit\namet")
        self.assertEqual(fill(text, 13, indent="  "), "  lorem ipsum\n  dolor sit\n  amet")

    def test_fill_rejects_oversized_indent(self):
        with self.assertRaises(ValueError):
            fill("text", 4, indent="    ")


class ShortenTests(unittest.TestCase):
    def test_fitting_text_is_only_collapsed(self):
        self.assertEqual(shorten("  Hello \n world  ", 20), "Hello world")

    def test_truncates_on_word_boundary(self):
        self.assertEqual(
            shorten("Hello world, this is a long sentence", 20),
            "Hello world, [...]",
        )

    def test_first_word_too_long(self):
        self.assertEqual(shorten("Supercalifragilistic is long", 12), "[...]")


if __name__ == "__main__":
    unittest.main()
