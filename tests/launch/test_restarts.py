"""Which crashed workers the launcher restarts (pure bookkeeping, no processes)."""

from __future__ import annotations

import pytest

from elastic.launch.restarts import Restarts

pytestmark = pytest.mark.unit
BAD_ARGUMENT = "ValueError: --data /nope does not exist"
IMPORT_ERROR = "ModuleNotFoundError: No module named 'missing'"


def test_a_worker_failing_before_joining_the_same_way_twice_is_not_restarted_a_third_time():
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, BAD_ARGUMENT, joined=False) == ""
    said = restarts.refusal(0, BAD_ARGUMENT, joined=False)
    assert "failed the same way again before it joined the job" in said
    assert BAD_ARGUMENT in said and "fix the script" in said
    assert restarts.failed == 1 and restarts.used == 1


def test_a_worker_that_had_committed_is_restarted_even_when_its_error_repeats():
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, "RuntimeError: boom", joined=True, committed=True) == ""
    assert restarts.refusal(0, "RuntimeError: boom", joined=True, committed=True) == ""
    assert restarts.refusal(0, "RuntimeError: boom", joined=False) == ""


def test_a_worker_that_joined_but_fails_the_same_way_before_its_first_commit_is_not_restarted():
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, "RuntimeError: boom", joined=True) == ""
    said = restarts.refusal(0, "RuntimeError: boom", joined=True)
    assert "failed the same way again before its first commit" in said


def test_different_errors_or_different_slots_do_not_count_as_a_repeat():
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, BAD_ARGUMENT, joined=False) == ""
    assert restarts.refusal(1, BAD_ARGUMENT, joined=False) == ""
    assert restarts.refusal(0, "ValueError: other", joined=False) == ""
    assert restarts.refusal(0, "", joined=False) == ""
    assert restarts.refusal(0, "", joined=False) == "", "an unknown error is not a repeat"


def test_an_error_that_repeats_but_for_its_numbers_counts_as_a_repeat():
    # A message holding a value (a step, a shape, an address) differed at every failure: the
    # worker was restarted until --max-restarts ran out, its traceback shown each time.
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, "ValueError: loss is nan at step 3 (0x7f3a2c)", joined=True) == ""
    said = restarts.refusal(0, "ValueError: loss is nan at step 7 (0x7f9b11)", joined=True)
    assert "failed the same way again before its first commit" in said
    assert restarts.refusal(1, "ValueError: loss is nan at step 3", joined=True) == ""
    assert restarts.refusal(1, "ValueError: loss is inf at step 3", joined=True) == ""


def test_restarts_stop_when_max_restarts_is_used_up():
    restarts = Restarts(max_restarts=1)
    assert restarts.refusal(0, "a", joined=True, committed=True) == ""
    assert "--max-restarts (1) is used up" in restarts.refusal(1, "b", joined=True,
                                                                committed=True)
    assert restarts.failed == 1


@pytest.mark.parametrize("line", [IMPORT_ERROR, "SyntaxError: invalid syntax",
                                  "IndentationError: unexpected indent",
                                  "[rank0]: ImportError: cannot import name 'x' from 'y'"])
def test_a_broken_script_or_import_before_joining_is_never_restarted(line):
    restarts = Restarts(max_restarts=5)
    said = restarts.refusal(0, line, joined=False)
    assert "not restarting it" in said and line.split("]: ")[-1] in said
    assert restarts.failed == 1 and restarts.used == 0


def test_an_import_error_after_joining_is_restarted_like_any_other_error():
    restarts = Restarts(max_restarts=5)
    assert restarts.refusal(0, IMPORT_ERROR, joined=True, committed=True) == ""


def test_a_setup_mistake_is_never_restarted():
    restarts = Restarts(max_restarts=5)
    assert "not restarting it" in restarts.refusal(0, "", joined=False, setup_error=True)
    assert restarts.failed == 1 and restarts.used == 0
