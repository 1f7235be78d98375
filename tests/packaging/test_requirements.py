"""The package's declared requirements against what its tests run on."""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.packaging.test_wheel_install import pinned_torch
from tests.support.harness import REPO

pytestmark = pytest.mark.unit


def test_the_package_asks_for_no_older_torch_than_the_one_its_tests_run_on():
    # sharded state calls torch APIs that older releases lack (DTensor's C++ sharding cache,
    # broadcast_object_list's group_src): a floor below the tested torch lets pip install one
    # on which a job fails at its first formation
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(r) for r in declared if Requirement(r).name == "torch")
    tested = Version(next(iter(Requirement(pinned_torch()).specifier)).version)
    floors = [Version(s.version) for s in torch.specifier if s.operator in (">=", "==", "~=")]
    assert floors and min(floors) >= tested, (
        f"pyproject.toml asks for {torch}, but the tests run on torch {tested}")
