"""pytest and pytest-asyncio, which the conformance suites run under, or an error saying how to get them."""

from __future__ import annotations

try:
    import pytest
    import pytest_asyncio
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"patchgym.testing's suites run under pytest with pytest-asyncio: pip install 'patchgym[testing]' ({exc})"
    ) from exc

__all__ = ["pytest", "pytest_asyncio"]
