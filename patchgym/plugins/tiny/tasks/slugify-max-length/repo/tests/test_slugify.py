import unittest

from slugkit import slugify, unique_slug


class SlugifyTests(unittest.TestCase):
    def test_basic_title(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_punctuation_and_whitespace_collapse(self):
        self.assertEqual(slugify("  Rock -- & -- Roll!!  "), "rock-roll")
        self.assertEqual(slugify("a_b.c/d"), "a-b-c-d")

    def test_accents_and_apostrophes(self):
        self.assertEqual(slugify("Crème Brûlée"), "creme-brulee")
        self.assertEqual(slugify("Don't Stop Believin\u2019"), "dont-stop-believin")

    def test_separator_and_case_options(self):
        self.assertEqual(slugify("Hello Big World", separator="_"), "hello_big_world")
        self.assertEqual(slugify("Hello World", lowercase=False), "Hello-World")

    def test_max_length_cuts_long_slugs(self):
        self.assertEqual(slugify("Hello World", max_length=5), "hello")
        self.assertEqual(slugify("Hello World", max_length=8), "hello-wo")
        self.assertEqual(slugify("Hello World", max_length=50), "hello-world")

    def test_max_length_never_leaves_trailing_separator(self):
        self.assertEqual(slugify("Hello World", max_length=6), "hello")
        self.assertEqual(slugify("one two three", separator="_", max_length=8), "one_two")

    def test_invalid_max_length(self):
        with self.assertRaises(ValueError):
            slugify("x", max_length=0)

    def test_unique_slug(self):
        self.assertEqual(unique_slug("My Post", set()), "my-post")
        taken = {"my-post", "my-post-2"}
        self.assertEqual(unique_slug("My Post", taken), "my-post-3")


if __name__ == "__main__":
    unittest.main()
