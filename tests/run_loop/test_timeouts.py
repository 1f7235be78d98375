"""The one timeout table: defaults, environment overrides, flags, and the order it enforces."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastic.timeouts import Timeouts

pytestmark = pytest.mark.unit
S = timedelta(seconds=1)


def test_the_defaults_are_the_documented_ones():
    t = Timeouts()
    assert (t.lease_ttl, t.keepalive, t.settle, t.rendezvous, t.form, t.collective) == (
        3 * S, 0.75 * S, 0.5 * S, 300 * S, 20 * S, 1800 * S)


def test_environment_variables_override_the_defaults_and_arguments_override_both():
    env = {"ELASTIC_LEASE_TTL": "8", "ELASTIC_SETTLE": "0.25", "ELASTIC_FORM_TIMEOUT": "40"}
    t = Timeouts.from_env(env, form=30 * S)
    assert t.lease_ttl == 8 * S and t.settle == 0.25 * S and t.form == 30 * S
    assert t.keepalive == 2 * S, "a lease TTL set alone brings four renewals per lease"


def test_the_table_travels_to_a_worker_through_its_environment():
    t = Timeouts.from_env({}, lease_ttl=5 * S, collective=600 * S)
    assert Timeouts.from_env(t.as_env()) == t


@pytest.mark.parametrize(("env", "message"), [
    ({"ELASTIC_SETTLE": "soon"}, "ELASTIC_SETTLE='soon' must be a number of seconds"),
    ({"ELASTIC_FORM_TIMEOUT": "0"}, "ELASTIC_FORM_TIMEOUT (0:00:00) must be positive"),
    ({"ELASTIC_LEASE_TTL": "0.5"}, "must be at least 1 second"),
    ({"ELASTIC_LEASE_TTL": "2", "ELASTIC_KEEPALIVE": "1.5"}, "ELASTIC_KEEPALIVE (1.5 s) must be"),
    ({"ELASTIC_SETTLE": "400"}, "ELASTIC_SETTLE (400.0 s) must be shorter than "
                                "ELASTIC_RENDEZVOUS_TIMEOUT (300.0 s)"),
    ({"ELASTIC_COLLECTIVE_TIMEOUT": "10"}, "ELASTIC_FORM_TIMEOUT (20.0 s) must be shorter than "
                                           "ELASTIC_COLLECTIVE_TIMEOUT (10.0 s)"),
])
def test_a_bad_value_or_order_is_one_sentence_naming_the_values(env, message):
    with pytest.raises(ValueError) as raised:
        Timeouts.from_env(env)
    assert message in str(raised.value)
