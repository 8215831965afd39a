"""Shared fixtures, each built once per test session (per xdist worker): synthetic family checkpoints (`family_dir`)
and converted drafters (`converted`); the helpers the test files share are in tests/helpers.py.

The default run is spread over two pytest-xdist workers (pyproject.toml: `-n 2 --dist loadgroup`): every
test file is one unit of work, so its module-scoped fixtures are built once, except the docs tests
(`tests/test_readme.py`), one unit per markdown file, scheduled first because they are the longest.
"""

from __future__ import annotations

import os
import re
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

from fixtures.families import build  # imports torch: after OMP_NUM_THREADS
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
# The commands that take more than a few seconds on the fixtures: a docs file's count of them ranks its test.
_EXPENSIVE = re.compile(r"^recycle (?:bench|distill|plan) |--calibrate ", re.M)


def _docs_cost(item: pytest.Item) -> int | None:
    """For a docs test (xdist group "docs:FILE"), how many expensive commands FILE holds; None for other tests."""
    for mark in item.iter_markers("xdist_group"):
        name = str(mark.args[0] if mark.args else "")
        if name.startswith("docs:") and item.name.startswith("test_every_readme_command_runs"):
            return len(_EXPENSIVE.findall((ROOT / name.removeprefix("docs:")).read_text(encoding="utf-8")))
    return None


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM to pytest (the controller or a pytest-xdist worker) stops every subprocess a test started through
    tests/helpers.py, and the workers, before pytest dies of it: a killed run leaves nothing running."""
    helpers.install_sigterm_handler()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`: one xdist group per test file (its module fixtures are built once) and one per
    markdown file for the docs test. The docs units go first, the costliest first, so that the longest units
    start early and the run does not end on one of them while the other worker idles."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    costs = {id(item): _docs_cost(item) for item in items}
    items.sort(key=lambda item: (costs[id(item)] is None, -(costs[id(item)] or 0)))


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


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`converted(fmt, source=FIXTURE, **options)` -> the drafter `convert_checkpoint(source, fmt, OUT, **options)`
    writes, converted on first use and then reused by every test file of the session (per xdist worker), keyed by
    (source, format, options).

    Each drafter sits alone in a folder of its own (OUT's parent holds nothing else). Tests must treat it as read-only
    (copy it first to change it); a test of conversion itself calls convert_checkpoint.
    """
    from recycle.converters.api import convert_checkpoint

    from tests.trained import FIXTURE

    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple, Path] = {}

    def get(fmt: str, source: str | Path = FIXTURE, **options) -> Path:
        source = Path(source).resolve()
        key = (str(source), fmt, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in cache:
            out = root / f"{len(cache):02d}-{source.name}" / fmt
            cache[key] = Path(convert_checkpoint(source, fmt, out, **options)["out"])
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
