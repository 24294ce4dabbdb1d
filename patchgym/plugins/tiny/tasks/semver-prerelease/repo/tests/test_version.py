import unittest

from semverlite import Version, compare_identifiers


def v(text):
    return Version.parse(text)


class ParseTests(unittest.TestCase):
    def test_components(self):
        version = v("2.10.3-beta.4+exp.sha.5114f85")
        self.assertEqual((version.major, version.minor, version.patch), (2, 10, 3))
        self.assertEqual(version.prerelease, ("beta", "4"))
        self.assertEqual(version.build, ("exp", "sha", "5114f85"))
        self.assertTrue(version.is_prerelease)
        self.assertFalse(v("1.0.0").is_prerelease)

    def test_str_round_trip(self):
        for text in ("0.0.1", "1.2.3-alpha.1", "1.2.3+build.7", "4.5.6-rc.2+b1"):
            self.assertEqual(str(v(text)), text)

    def test_rejects_invalid_versions(self):
        for text in ("1.2", "1.2.3.4", "01.2.3", "1.2.3-", "1.2.3-01", "v1.2.3", ""):
            with self.assertRaises(ValueError, msg=repr(text)):
                v(text)


class OrderingTests(unittest.TestCase):
    def test_core_versions(self):
        self.assertLess(v("1.0.0"), v("2.0.0"))
        self.assertLess(v("2.0.0"), v("2.1.0"))
        self.assertLess(v("2.1.0"), v("2.1.1"))
        self.assertLess(v("1.9.0"), v("1.10.0"))

    def test_prerelease_identifiers(self):
        self.assertLess(v("1.0.0-alpha"), v("1.0.0-alpha.1"))
        self.assertLess(v("1.0.0-alpha.1"), v("1.0.0-alpha.beta"))
        self.assertLess(v("1.0.0-beta.2"), v("1.0.0-beta.11"))
        self.assertLess(v("1.0.0-rc.1"), v("1.0.0-rc.2"))
        self.assertLess(compare_identifiers("9", "alpha"), 0)

    def test_release_outranks_its_prereleases(self):
        self.assertLess(v("1.0.0-rc.1"), v("1.0.0"))
        self.assertGreater(v("2.0.0"), v("2.0.0-alpha"))
        self.assertEqual(max([v("3.1.0"), v("3.1.0-beta")]), v("3.1.0"))

    def test_prerelease_of_later_version_is_newer(self):
        self.assertLess(v("1.0.0"), v("1.0.1-alpha"))
        self.assertGreater(v("2.0.0-rc.1"), v("1.9.9"))

    def test_specification_example_order(self):
        expected = [
            "1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta",
            "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0",
        ]
        shuffled = [expected[i] for i in (7, 3, 0, 6, 5, 1, 4, 2)]
        self.assertEqual([str(x) for x in sorted(map(v, shuffled))], expected)

    def test_build_metadata_is_ignored(self):
        self.assertEqual(v("1.0.0+build.1"), v("1.0.0+build.2"))
        self.assertEqual(hash(v("1.0.0-rc.1+a")), hash(v("1.0.0-rc.1+b")))
        self.assertFalse(v("1.0.0+a") < v("1.0.0+b"))


if __name__ == "__main__":
    unittest.main()
