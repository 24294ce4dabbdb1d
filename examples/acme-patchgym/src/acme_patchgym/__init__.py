"""ACME's patchgym plugins (an example third-party distribution; see docs/plugins.md in patchgym)."""
