"""Shared fixtures for the fastmm test suite."""

from __future__ import annotations

import os
import sys

import pytest

# tests/_datasets.py must be importable by name, also in "spawn"/"forkserver" workers (they get
# the parent's sys.path), whatever pytest's import mode is.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


def pytest_collection_modifyitems(items):
    """A module that sets ``PURE_TWIN_IS_SLOW = True`` runs its pure-Python transport cases in
    the full suite only: the quick subset checks the twin elsewhere, and these cases twice
    over would cost it half a minute."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (getattr(item.module, "PURE_TWIN_IS_SLOW", False) and callspec is not None
                and callspec.params.get("transport") == "pure"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["cpp", "pure"])
def transport(request, monkeypatch):
    """Run a test on both slab transports: the C++ extension and its pure-Python twin.

    FASTMM_PURE_PYTHON is read when an iterator is created (``iter(loader)``), so the
    environment set here applies to every loader the test iterates."""
    import fastmm

    if request.param == "cpp":
        monkeypatch.delenv("FASTMM_PURE_PYTHON", raising=False)
        if not fastmm.uses_cpp():
            if os.environ.get("FASTMM_REQUIRE_CPP") == "1":
                pytest.fail("fastmm._C is not built but FASTMM_REQUIRE_CPP=1")
            pytest.skip("fastmm._C is not importable here; only the pure-Python twin can run")
    else:
        monkeypatch.setenv("FASTMM_PURE_PYTHON", "1")
        assert not fastmm.uses_cpp()
    return request.param


@pytest.fixture
def native(transport):
    """The module behind ``transport``: fastmm._C, or its pure-Python twin fastmm._twin."""
    from fastmm._native import native_backend

    return native_backend()


@pytest.fixture(scope="module")
def corpus(request, tmp_path_factory):
    """A generated multimodal corpus (``fastmm.bench.mmcorpus``), written once per test module
    from the module's ``CORPUS_SPEC``: its root (``posix/``, ``shards/``, composition.json)."""
    from fastmm.bench.mmcorpus import write_corpus

    out = str(tmp_path_factory.mktemp("corpus"))
    write_corpus(request.module.CORPUS_SPEC, out)
    return out
