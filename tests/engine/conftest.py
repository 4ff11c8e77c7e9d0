"""Fixtures of the engine suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(arch="llama", **kw) -> Path``: a tiny checkpoint from ``engine.tiny``.

    Built once per session for each set of arguments and shared, so treat it as read-only.
    """
    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kw) -> Path:
        key = (arch, repr(sorted(kw.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, **kw)
        return built[key]

    return factory
