"""The one timeout table: defaults, environment overrides, flags, the order it enforces, and
no literal timeout anywhere else in the cluster and launch layers."""

from __future__ import annotations

import ast
import dataclasses
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.checkpoint.backend import DEFAULT_RETRY_FOR
from elastic.launch.cli import _run_parser, _timeouts
from elastic.launch.launch_spec import LaunchSpec, join_command
from elastic.foundation.settings import WorkerSettings
from elastic.foundation.timeouts import Timeouts
from tests.support.timeout_literals import literal_timeouts

pytestmark = pytest.mark.unit
S = timedelta(seconds=1)
REPO = Path(__file__).resolve().parents[2]

DEFAULTS_S = {
    "lease_ttl": 3, "keepalive": 0.75, "settle": 0.5, "node_settle": 1, "local_start": 30, "rejoin": 120,
    "release": 30, "rendezvous": 300, "peer": 2.5, "peer_probe": 1,
    "frozen": 0.5, "heartbeat": 0.1,
    "admit": 1800, "form": 20, "free_group": 1, "store": 60, "collective": 1800, "sync": 300, "finish": 300,
    "finished_marker": 600,
    "progress": 0.5, "storage_retry": 60, "final_write": 300, "checkpoint_claim": 60, "etcd_rpc": 3, "etcd_retry": 10, "etcd_outage": 600,
    "connect": 5,
    "backoff": 0.05, "backoff_max": 1, "reconnect": 0.2, "etcd_ping": 5, "etcd_ping_timeout": 2,
    "etcd_start": 20, "replace_wait": 2, "template_ready": 120, "fork": 5, "warm_connect": 0.3,
    "grace": 30, "restart_grace": 3, "shutdown": 5, "drain": 0.2, "reap": 10,
    "wake": 1,
    "poll": 0.05,
}
# (shorter, longer, may they be equal): the hierarchy, as docs/timeouts.md states it.
ORDER = [("keepalive", "lease_ttl", False), ("peer_probe", "peer", True),
         ("heartbeat", "frozen", False), ("settle", "rendezvous", False),
         ("node_settle", "rendezvous", False),
         ("settle", "rejoin", False),
         ("node_settle", "rejoin", False), ("release", "rejoin", False),
         ("form", "collective", False),
         ("sync", "collective", True), ("etcd_rpc", "etcd_retry", True),
         ("etcd_retry", "etcd_outage", True),
         ("backoff", "backoff_max", True), ("reconnect", "backoff_max", True)]
SHORT_SIDE = {short for short, _, _ in ORDER}
NAMES = [f.name for f in dataclasses.fields(Timeouts)]


def test_the_defaults_are_the_documented_ones():
    assert {name: getattr(Timeouts(), name).total_seconds() for name in NAMES} == DEFAULTS_S


def test_every_field_documents_its_default_and_its_variable():
    tree = ast.parse((REPO / "elastic" / "foundation" / "timeouts.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Timeouts").body
    docs = {a.target.id: body[i + 1].value.value for i, a in enumerate(body[:-1])
            if isinstance(a, ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)}
    for name in NAMES:
        doc = " ".join(docs[name].split())
        assert doc.startswith(f"Default {DEFAULTS_S[name]:g} s"), (name, doc)
        assert f"``{Timeouts.env_name(name)}``" in doc, (name, doc)
        flag = Timeouts.flag_name(name)
        assert flag is None or f"``{flag}``" in doc, (name, doc)


@pytest.mark.parametrize("name", NAMES)
def test_each_variable_overrides_its_field(name):
    value = getattr(Timeouts(), name) * (0.5 if name in SHORT_SIDE else 2)
    table = Timeouts.from_env({Timeouts.env_name(name): str(value.total_seconds())})
    assert getattr(table, name) == value
    assert all(getattr(table, other) == getattr(Timeouts(), other) for other in NAMES
               if other not in (name, "keepalive"))


def test_the_variables_of_earlier_releases_keep_their_names():
    env = {"ELASTIC_LEASE_TTL": "8", "ELASTIC_SETTLE": "0.25", "ELASTIC_RENDEZVOUS_TIMEOUT": "60"}
    table = Timeouts.from_env(env)
    assert (table.lease_ttl, table.settle, table.rendezvous) == (8 * S, 0.25 * S, 60 * S)
    assert [Timeouts.env_name(n) for n in ("admit", "form", "collective", "sync")] == [
        "ELASTIC_ADMIT_TIMEOUT", "ELASTIC_FORM_TIMEOUT", "ELASTIC_COLLECTIVE_TIMEOUT",
        "ELASTIC_SYNC_TIMEOUT"]


def test_a_lease_ttl_set_alone_brings_four_renewals_per_lease_and_a_keepalive_set_wins():
    assert Timeouts.from_env({"ELASTIC_LEASE_TTL": "8"}).keepalive == 2 * S
    assert Timeouts.from_env({}, lease_ttl=8 * S).keepalive == 2 * S
    both = Timeouts.from_env({"ELASTIC_LEASE_TTL": "8", "ELASTIC_KEEPALIVE": "1"})
    assert both.keepalive == 1 * S


def test_arguments_override_variables_and_the_table_is_frozen():
    table = Timeouts.from_env({"ELASTIC_FORM_TIMEOUT": "40"}, form=30 * S)
    assert table.form == 30 * S
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.form = 10 * S  # type: ignore[misc]


def test_the_whole_table_travels_to_a_worker_through_its_environment():
    table = Timeouts.from_env({}, lease_ttl=5 * S, collective=600 * S, wake=0.25 * S)
    assert Timeouts.from_env(table.as_env()) == table
    spec = LaunchSpec(command=("python", "t.py"), target="t.py", etcd="http://h:1", job_id="j",
                      timeouts=table)
    assert Timeouts.from_env(spec.worker_env(0)) == table


def test_a_worker_reads_the_table_into_its_settings(monkeypatch):
    monkeypatch.setenv("ELASTIC_COLLECTIVE_TIMEOUT", "900")
    monkeypatch.setenv("ELASTIC_SYNC_TIMEOUT", "120")
    settings = WorkerSettings.resolve(etcd="http://h:1", job_id="j", min_workers=None,
                                      max_workers=None, checkpoint=None)
    assert (settings.timeouts.collective, settings.timeouts.sync) == (900 * S, 120 * S)


@pytest.mark.parametrize("raw", ["soon", "nan", "inf", "1e999"])
def test_a_variable_that_is_not_a_number_of_seconds_is_refused_with_an_example(raw):
    with pytest.raises(ValueError, match=rf"^ELASTIC_SETTLE='{raw}' must be a number of "
                                         r"seconds, e\.g\. ELASTIC_SETTLE=0\.5\.$"):
        Timeouts.from_env({"ELASTIC_SETTLE": raw})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("raw", ["0", "-2"])
def test_every_value_must_be_positive(name, raw):
    with pytest.raises(ValueError) as raised:
        Timeouts.from_env({Timeouts.env_name(name): raw})
    message = str(raised.value)
    assert message.startswith(Timeouts.env_name(name)) and f"({float(raw):g} s) must be " \
        "positive: set it to a number of seconds above 0." in message


def test_the_lease_ttl_is_at_least_one_second():
    with pytest.raises(ValueError, match=r"ELASTIC_LEASE_TTL / --lease-ttl \(0\.5 s\) must be "
                                         r"at least 1 s: etcd leases are whole seconds\."):
        Timeouts(lease_ttl=0.5 * S, keepalive=0.1 * S)


@pytest.mark.parametrize(("short", "long", "equal_ok"), ORDER)
def test_each_order_of_the_hierarchy_is_enforced_naming_both_values_and_the_fix(
        short, long, equal_ok):
    factor = 2 if short in ("keepalive", "heartbeat") else 1
    bound = getattr(Timeouts(), long)
    too_long = {short: bound / factor + 0.5 * S}
    with pytest.raises(ValueError) as raised:
        Timeouts(**too_long)
    message = str(raised.value)
    assert f"{Timeouts.env_name(short)}" in message.split(" must be ")[0]
    assert f"({too_long[short].total_seconds():g} s) must be" in message
    assert f"{Timeouts.env_name(long)}" in message and f"({bound.total_seconds():g} s)" in message
    assert message.endswith(f"lower {Timeouts.env_name(short)} or raise "
                            f"{Timeouts.env_name(long)}.")
    equal = {short: bound / factor}
    if equal_ok:
        assert getattr(Timeouts(**equal), short) == bound / factor
    else:
        with pytest.raises(ValueError, match="must be shorter than"):
            Timeouts(**equal)


def test_a_derived_table_is_validated_too():
    with pytest.raises(ValueError, match="ELASTIC_SETTLE / --settle"):
        dataclasses.replace(Timeouts(), settle=400 * S)


def test_the_flags_of_elastic_run_set_their_fields_on_top_of_the_environment(monkeypatch):
    assert {n: Timeouts.flag_name(n) for n in Timeouts.FLAGS} == {
        "lease_ttl": "--lease-ttl", "settle": "--settle", "rejoin": "--rejoin-timeout",
        "release": "--release-grace", "rendezvous": "--rendezvous-timeout",
        "form": "--form-timeout", "collective": "--collective-timeout", "grace": "--grace",
        "etcd_outage": "--etcd-outage", "peer": "--peer-timeout", "frozen": "--frozen-timeout"}
    monkeypatch.setenv("ELASTIC_FORM_TIMEOUT", "40")
    monkeypatch.setenv("ELASTIC_SETTLE", "0.2")
    args = _run_parser().parse_args(["--lease-ttl", "8", "--form-timeout", "30",
                                     "--collective-timeout", "600", "--rendezvous-timeout", "60",
                                     "--grace", "5"])
    table = _timeouts(args)
    assert (table.lease_ttl, table.keepalive, table.form, table.collective, table.rendezvous,
            table.grace, table.settle) == (8 * S, 2 * S, 30 * S, 600 * S, 60 * S, 5 * S, 0.2 * S)


def test_the_join_command_carries_the_budget_to_the_next_node():
    table = Timeouts.from_env({}, lease_ttl=8 * S, form=10 * S)
    spec = LaunchSpec(command=("python", "t.py"), target="t.py", etcd="http://h:1", job_id="j",
                      timeouts=table)
    command = join_command(spec)
    assert "--lease-ttl 8 --form-timeout 10" in command and "--settle" not in command


def test_the_checkpoint_layer_names_the_same_retry_deadline():
    assert Timeouts().storage_retry == DEFAULT_RETRY_FOR


def test_the_user_guide_lists_every_variable_on_its_timeouts_page():
    page = (REPO / "docs" / "timeouts.md").read_text()
    missing = [Timeouts.env_name(n) for n in NAMES if Timeouts.env_name(n) not in page]
    assert not missing, f"docs/timeouts.md lacks {missing}"


# -- no literal timeout outside the table -------------------------------------------------------

PLACES = ("elastic", "state", "checkpoint")
ALLOWED = frozenset({
    # The table itself: its unit.
    ("elastic/foundation/timeouts.py", "timedelta(...) with a literal"),
    # The checkpoint layer may not import the table: its default deadline for a store used
    # outside a job (kept equal to the table's storage_retry), and its retry pauses.
    ("checkpoint/backend.py", "timedelta(...) with a literal"),
    ("checkpoint/backend.py", "_FIRST_PAUSE_S = <literal>"),
    ("checkpoint/backend.py", "_LONGEST_PAUSE_S = <literal>"),
    ("checkpoint/backend.py", "_JITTER_S = <literal>"),
    # The report reads finished event files: its windows are over recorded times, not waits.
    ("elastic/launch/report.py", "parameter window_s defaults to a literal"),
    ("elastic/launch/report.py", "parameter gap_s defaults to a literal")})


def test_no_literal_timeout_in_the_elastic_state_or_checkpoint_packages():
    found = literal_timeouts(REPO, PLACES, ALLOWED)
    assert not found, "literal timeouts (take them from elastic.Timeouts):\n" + \
        "\n".join(map(str, found))


@pytest.fixture
def source_copy(tmp_path: Path) -> Path:
    for folder in PLACES:
        shutil.copytree(REPO / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize(("module", "planted", "what"), [
    ("elastic/cluster/rounds/membership.py", "GRACE = timedelta(seconds=5)", "timedelta(...)"),
    ("elastic/cluster/rounds/rendezvous.py", "def f(e):\n    e.wait(timeout=2.5)",
     "timeout=<literal>"),
    ("elastic/cluster/etcd/client.py", "def f(f, t):\n    f.result(timeout=t + 5)",
     "timeout=<literal>"),
    ("elastic/launch/worker_procs.py", "_POLL_S = 0.1", "_POLL_S = <literal>"),
    ("elastic/launch/launcher.py", "_JOIN_TIMEOUT = 2 * 60", "_JOIN_TIMEOUT = <literal>"),
    ("elastic/launch/plain.py", "def f(t):\n    t.join(5)", "join(<literal>)"),
    ("elastic/launch/status.py", "def f(timeout_s=3.0):\n    pass",
     "parameter timeout_s defaults to a literal"),
    ("elastic/launch/embedded_etcd.py", "from time import sleep\nsleep(0.05)",
     "sleep(<literal>)"),
    ("elastic/cluster/links/round_store.py",
     "import tenacity\nw = tenacity.wait_exponential_jitter(max=2.0)",
     "wait_exponential_jitter(...)"),
    ("elastic/cluster/links/process_group.py", "def f(backoff_s):\n    return min(1.0, backoff_s)",
     "min(...) bounds a duration"),
    ("elastic/cluster/etcd/client.py", "OPTIONS = {'grpc.keepalive_time_ms': 5000}",
     "'grpc.keepalive_time_ms': <literal>"),
    ("elastic/foundation/signals.py", "class K:\n    join_s: float = 5.0", "join_s = <literal>"),
    ("elastic/durable.py", "def f(e):\n    e.wait(30)", "wait(<literal>)"),
    ("state/sampler.py", "_GRACE_S = 2.0", "_GRACE_S = <literal>"),
    ("state/rng.py", "pause_s, tries = 1.0, 5", "pause_s = <literal>"),
    ("checkpoint/store.py", "def f(retry_s=60.0):\n    pass",
     "parameter retry_s defaults to a literal"),
])
def test_a_planted_literal_timeout_is_reported(source_copy, module, planted, what):
    target = source_copy / module
    target.write_text(target.read_text() + "\n\n" + planted + "\n")
    found = literal_timeouts(source_copy, PLACES, ALLOWED)
    assert len(found) == 1, found
    assert what in found[0].what and found[0].path == target


def test_clamps_zero_and_table_values_are_not_literal_timeouts(source_copy):
    target = source_copy / "elastic" / "cluster" / "links" / "agreement_channel.py"
    target.write_text(target.read_text() + "\n\ndef f(e, t, left, table):\n"
                      "    e.wait(timeout=max(left, 0.001))\n    t.join(timeout=0)\n"
                      "    e.wait(table.wake.total_seconds())\n    x_s = 2 * table.wake\n")
    assert literal_timeouts(source_copy, PLACES, ALLOWED) == []
