"""Model factories (tiny random models for tests and quickstarts)."""
