"""Set-up for tests/ only (the root conftest.py serves tests/ and the notebooks alike).

Once every test module is imported, what is alive (torch, transformers, the test modules: about half a million
objects) is moved out of the garbage collector's sight with `gc.freeze()`. Every engine's `close()` calls
`gc.collect()`, and so do the tests that check what a request or an engine leaves behind: without this, each of those
collections walks the whole heap again (0.3-0.6 s each here, hundreds of them in a run). Objects made by the tests
themselves (engines, sequences, requests, KV caches) are made after the freeze: they are collected, and seen by
`gc.get_objects()`, exactly as before, so the checks of what is freed or left alive are unchanged.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest


def pytest_collection_finish(session):
    import hypothesis  # noqa: F401  (its plugins register PRNGs, checking their referrers: before the freeze hides them)

    gc.collect()  # (nothing that is garbage now is kept for ever)
    gc.freeze()


@pytest.fixture(scope="session")
def _rank_pools():
    pools = []
    yield pools
    for pool in pools:
        pool.close()


@pytest.fixture
def rank_pool(_rank_pools):
    """Two spawned processes for checks over a 2-rank gloo group, started once for the session (tests/_rank_pool.py);
    a new pair after a job that failed."""
    import os
    import sys

    here = os.path.dirname(__file__)
    if here not in sys.path:  # (the ranks import the check modules from here)
        sys.path.insert(0, here)
    from _rank_pool import RankPool

    if not _rank_pools or not _rank_pools[-1].alive:
        _rank_pools.append(RankPool())
    return _rank_pools[-1]


@pytest.fixture(scope="session")
def train_script():
    "`tools/train_tiny_qwen3.py` (the script that makes the embedded model), imported once."
    path = Path(__file__).resolve().parents[1] / "tools" / "train_tiny_qwen3.py"
    spec = importlib.util.spec_from_file_location("train_tiny_qwen3", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module
