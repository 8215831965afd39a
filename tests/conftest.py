"""Shared fixtures: synthetic family checkpoints, each built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fixtures.families import build


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
    """The suite's models are tiny: more than two threads only adds contention on CI's 2 cores."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(min(2, old))
    yield
    torch.set_num_threads(old)
