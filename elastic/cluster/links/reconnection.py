"""What a member that its peers lost (cut off) waits for before it asks to join again: to reach
rank 0 of the newest round again, at the store address that round published in etcd.

A member still cut off would make the others re-form around it and wait the form timeout for
it, again and again. The wait retries only the probe's connection errors (``OSError``), bounded
by the admit timeout and by a request to leave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import tenacity

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.links.round_store import reach
from elastic.foundation.errors import LeaveInterrupt, RendezvousTimeoutError
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)


def await_peers(client: EtcdClient, keys: JobKeys, latest_round: Callable[[], int],
                timeouts: Timeouts, cancelled: Callable[[], bool]) -> None:
    """Waits until this member reaches rank 0 of the newest round (``latest_round()``) again.

    Raises:
        LeaveInterrupt: ``cancelled()`` turned true (SIGTERM) while waiting.
        RendezvousTimeoutError: still unreachable after the admit timeout.
    """
    told: list[str] = []

    def tell_once(state: tenacity.RetryCallState) -> None:  # not a line per attempt
        if not told and state.outcome is not None:
            told.append(f"{state.outcome.exception()}")
            log.warning("waiting to reach the job's other members again (%s)", told[0])

    retrying = tenacity.Retrying(
        stop=tenacity.stop_any(tenacity.stop_after_delay(timeouts.admit.total_seconds()),
                               lambda _: cancelled()),
        retry=tenacity.retry_if_exception_type(OSError),
        wait=tenacity.wait_exponential_jitter(initial=timeouts.backoff.total_seconds(),
                                              max=timeouts.backoff_max.total_seconds()),
        before_sleep=tell_once, reraise=True)
    try:
        for attempt in retrying:
            with attempt:
                reach(client, keys.store_address(latest_round()), timeouts.peer)
    except OSError as exc:
        if cancelled():
            raise LeaveInterrupt("asked to leave while cut off from the job") from None
        raise RendezvousTimeoutError(
            f"could not reach the job's other members within {timeouts.admit} ({exc}): "
            f"check the network between this machine and theirs.") from None
