"""Shared fixtures: synthetic family checkpoints, each built once per test session (per xdist worker).

The default run is spread over two pytest-xdist workers (pyproject.toml: `-n 2 --dist loadgroup`): every
test file is one unit of work, so its module-scoped fixtures are built once, except the docs tests
(`tests/test_readme.py`), one unit per markdown file, scheduled first because they are the longest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def _threads() -> int:
    """Torch threads per test process: the cores shared among the xdist workers, at most 2 (the models are tiny).

    RECYCLE_TEST_THREADS overrides (to measure which split is faster)."""
    if os.environ.get("RECYCLE_TEST_THREADS"):
        return int(os.environ["RECYCLE_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, min(2, (os.cpu_count() or 1) // workers))


# Subprocesses the tests start (the CLI, torchrun) inherit the same share.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads()))

from fixtures.families import build  # noqa: E402  (imports torch: after OMP_NUM_THREADS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`: one xdist group per test file (its module fixtures are built once), the docs
    tests' own groups (one per markdown file) first, so the longest units start first and none is last."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    items.sort(key=lambda item: not any(str(m.args[0] if m.args else "").startswith("docs:")
                                        for m in item.iter_markers("xdist_group")))


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`family_dir(name, **opts)` -> directory of that variant, built on first use and then reused.

    Tests must treat the directory as read-only (copy it first to corrupt it).
    """
    root = tmp_path_factory.mktemp("families")
    cache: dict[tuple, Path] = {}

    def get(name: str, **opts) -> Path:
        key = (name, tuple(sorted(opts.items())))
        if key not in cache:
            suffix = "".join(f"-{k}{v}" for k, v in key[1])
            cache[key] = build(name, root / f"{name}{suffix}", **opts)
        return cache[key]

    return get


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    """The suite's models are tiny: more threads than the worker's share of CI's 2 cores only add contention."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(min(_threads(), old))
    yield
    torch.set_num_threads(old)
