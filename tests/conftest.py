"""Shared fixtures: every test gets its own cache directory and a fresh config chain."""

from __future__ import annotations

import pytest

import ejkernel.ops.config.chain as chain_module


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """A private ``EJKERNEL_CACHE_DIR`` and a fresh default chain (empty memory cache) per test."""
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EJKERNEL_AUTOTUNE_POLICY", raising=False)
    monkeypatch.setattr(chain_module, "_default_chain", None)
    yield tmp_path / "cache"
