"""The default run's own set-up: each test file is one xdist unit of work (tests/conftest.py), so its module
fixtures are built once. pytest 9.2 with pytest-xdist 3.8 silently lost that (constraints.txt pins pytest)."""

from __future__ import annotations

import pytest


def test_each_file_runs_as_one_xdist_unit(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@test_suite_setup.py"), request.node.nodeid
