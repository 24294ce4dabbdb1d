import unittest

from roman import MAX_VALUE, from_roman, is_roman, to_roman


class ToRomanTests(unittest.TestCase):
    def test_known_values(self):
        cases = {
            1: "I", 3: "III", 4: "IV", 9: "IX", 14: "XIV", 40: "XL",
            90: "XC", 400: "CD", 944: "CMXLIV", 1994: "MCMXCIV",
            2024: "MMXXIV", 3999: "MMMCMXCIX",
        }
        for number, expected in cases.items():
            self.assertEqual(to_roman(number), expected, msg=number)

    def test_out_of_range(self):
        for number in (0, -1, MAX_VALUE + 1):
            with self.assertRaises(ValueError, msg=number):
                to_roman(number)

    def test_rejects_non_integers(self):
        for value in (1.0, "5", True, None):
            with self.assertRaises(TypeError, msg=repr(value)):
                to_roman(value)


class FromRomanTests(unittest.TestCase):
    def test_additive_numerals(self):
        cases = {"I": 1, "III": 3, "VIII": 8, "LXX": 70, "MDCLXVI": 1666}
        for numeral, expected in cases.items():
            self.assertEqual(from_roman(numeral), expected, msg=numeral)

    def test_subtractive_pair_inside_numeral(self):
        cases = {"XLII": 42, "MCMLXXX": 1980, "CDXLVIII": 448, "XCVII": 97}
        for numeral, expected in cases.items():
            self.assertEqual(from_roman(numeral), expected, msg=numeral)

    def test_subtractive_pair_at_end(self):
        cases = {"IV": 4, "IX": 9, "XIV": 14, "XC": 90, "MCMXCIV": 1994}
        for numeral, expected in cases.items():
            self.assertEqual(from_roman(numeral), expected, msg=numeral)

    def test_case_and_whitespace_are_ignored(self):
        self.assertEqual(from_roman("  mdclxvi\n"), 1666)
        self.assertEqual(from_roman("Xlii"), 42)

    def test_rejects_invalid_numerals(self):
        for numeral in ("", "   ", "IIII", "VX", "IC", "MMMM", "ABC", "X I"):
            with self.assertRaises(ValueError, msg=repr(numeral)):
                from_roman(numeral)

    def test_round_trip(self):
        for number in range(1, MAX_VALUE + 1):
            self.assertEqual(from_roman(to_roman(number)), number)


class IsRomanTests(unittest.TestCase):
    def test_is_roman(self):
        self.assertTrue(is_roman("XLII"))
        self.assertTrue(is_roman("mmxx"))
        self.assertFalse(is_roman("IIII"))
        self.assertFalse(is_roman("hello"))
        self.assertFalse(is_roman(42))


if __name__ == "__main__":
    unittest.main()
