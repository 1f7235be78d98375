"""The layering rule and the absence of import cycles are enforced on the source, and each
checker catches a planted import."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.import_cycles import cycles, import_graph
from tests.support.layering import violations

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_no_module_imports_against_the_layering():
    found = violations(REPO)
    assert not found, "imports against the layering:\n" + "\n".join(map(str, found))


@pytest.fixture
def source_copy(tmp_path: Path) -> Path:
    for folder in ("elastic", "state", "checkpoint"):
        shutil.copytree(REPO / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize(("module", "planted", "why"), [
    ("checkpoint/store.py", "from elastic.state import TrainState", "checkpoint layer may not"),
    ("state/sampler.py", "from elastic.cluster.rounds.keys import JobKeys", "state layer may not"),
    ("state/sampler.py", "import elastic.launch.cli", "state layer may not"),
    ("elastic/cluster/rounds/tracker.py", "from elastic.elastic_state import ElasticState",
     "rounds layer may not import the run_loop"),
    ("elastic/cluster/rounds/rendezvous.py", "from elastic import ElasticState",
     "rounds layer may not import the launch"),
    ("elastic/cluster/etcd/watch.py", "from elastic.cluster.rounds.keys import JobKeys",
     "etcd layer may not import the rounds layer"),
    ("elastic/cluster/rounds/plan.py", "    from elastic.cluster.links import ports",
     "rounds layer may not import the links layer"),
    ("elastic/cluster/links/ports.py", "from elastic.cluster.cluster import Cluster",
     "links layer may not import the cluster layer"),
    ("elastic/agreement.py", "from elastic.launch import launcher", "run_loop layer may not"),
    ("elastic/foundation/errors.py", "from elastic.cluster.rounds.plan import Plan",
     "foundation layer may not"),
    ("elastic/cluster/rounds/plan.py", "from state.sampler import ElasticSampler",
     "can be shadowed"),
    ("elastic/durable.py", "    import checkpoint", "can be shadowed"),
])
def test_a_planted_forbidden_import_is_reported(source_copy, module, planted, why):
    target = source_copy / module
    if planted.startswith(" "):  # inside a function, where lazy imports live
        planted = "def _late():\n" + planted + "\n"
    target.write_text(target.read_text() + "\n" + planted + "\n")
    found = violations(source_copy)
    assert len(found) == 1, found
    assert why in str(found[0]) and found[0].path == target


def test_a_relative_import_is_resolved_before_it_is_judged(source_copy):
    target = source_copy / "state" / "rng.py"
    target.write_text(target.read_text() + "\nfrom ..cluster import plan\n")
    found = violations(source_copy)
    assert [v.imported for v in found] == ["elastic.cluster"]


def test_no_import_cycle_anywhere_in_the_package():
    found = cycles(import_graph(REPO))
    assert not found, "import cycles (TYPE_CHECKING and late imports included):\n" + \
        "\n".join(" <-> ".join(cycle) for cycle in found)


@pytest.mark.parametrize(("module", "planted"), [
    ("elastic/cluster/etcd/values.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from elastic.cluster.etcd.client import EtcdClient"),
    ("elastic/foundation/timeouts.py", "def _late():\n    from elastic.foundation import settings"),
    ("elastic/cluster/rounds/plan.py", "from elastic.cluster.rounds import plan"),
])
def test_a_planted_import_cycle_is_reported(source_copy, module, planted):
    target = source_copy / module
    target.write_text(target.read_text() + "\n" + planted + "\n")
    name = module.removesuffix(".py").replace("/", ".")
    assert [cycle for cycle in cycles(import_graph(source_copy)) if name in cycle], \
        f"no cycle through {name} found"
