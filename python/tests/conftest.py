"""Shared test setup: the package path, a skip for everything that needs librdep_capi.so when it cannot
be found (saying where it was looked for), and tolerance helpers.

Run:  RDEP_LIBRARY=build/lib/librdep_capi.so PYTHONPATH=python python3 -m pytest python/tests -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rdep package, without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py

import rdep._capi as _capi  # noqa: E402

try:
    _capi.lib()
    LIBRARY_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the machine
    LIBRARY_ERROR = str(e)


def pytest_collection_modifyitems(config, items):
    if LIBRARY_ERROR is None:
        return
    if os.environ.get("RDEP_REQUIRE_LIBRARY"):  # scripts/test.sh: a missing library is a failure, not a skip
        raise pytest.UsageError(f"RDEP_REQUIRE_LIBRARY is set but librdep_capi.so cannot be loaded: {LIBRARY_ERROR}")
    skip = pytest.mark.skip(reason=f"librdep_capi.so not available: {LIBRARY_ERROR}")
    for item in items:
        if "no_library" not in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "no_library: the test does not need librdep_capi.so")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in fp64; 0 when both are zero)."""
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == b.shape, f"shape {list(a.shape)} != {list(b.shape)}"
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


def assert_rel_close(actual, expected, tol: float, what: str) -> None:
    assert torch.isfinite(actual.detach().double()).all(), f"{what}: non-finite values"
    e = rel_err(actual, expected)
    assert e <= tol, f"{what}: max|a-b|/max|b| = {e:.3g} > {tol:g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def python_path():
    """rdep.torch.moe's eager calls through the Python path (rdep.torch.eager_ext off) for the test: for tests of that
    path's own pieces (its ops' kernels and formula, the bookkeeping they keep, what its functions are called with)."""
    from rdep.torch import eager_ext

    eager_ext.enabled = False
    try:
        yield
    finally:
        eager_ext.enabled = True
