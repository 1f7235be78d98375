"""The ``bytes_per_rank`` record in a real etcd: written once per figure, read back, and
ignored (never trusted, never fatal) when it is missing, malformed or hostile."""

from __future__ import annotations

import json
import logging

import pytest

from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.rank_bytes import MAX_BYTES, RankBytes
from elastic.foundation.timeouts import Timeouts

WRITTEN = Timeouts().etcd_retry.total_seconds()  # a write's retries end within it


def test_a_published_figure_is_read_back_and_written_only_when_it_changes(client):
    keys = JobKeys("rank-bytes-published")
    record = RankBytes(client, keys)
    assert record.read() is None  # nothing recorded yet
    record.publish(123_456).join(WRITTEN)
    written = client.get(keys.bytes_per_rank)
    assert record.publish(123_456) is None  # the same figure: no write
    assert client.get(keys.bytes_per_rank).mod_revision == written.mod_revision
    record.publish(654_321).join(WRITTEN)
    assert RankBytes(client, keys).read() == 654_321


@pytest.mark.parametrize("raw", [
    b"not json", b"[1]", b'{"bytes": -1}', b'{"bytes": "12"}', b'{"bytes": true}',
    b'{"bytes": 1e9}', b'{"bytes": NaN}', b'{}', b'{"bytes": 1, "more": 2}',
    json.dumps({"bytes": MAX_BYTES + 1}).encode(), b"\xff\xfe"])
def test_a_malformed_or_hostile_record_is_ignored_with_a_warning(client, caplog, raw):
    keys = JobKeys("rank-bytes-hostile")
    client.put(keys.bytes_per_rank, raw)
    with caplog.at_level(logging.WARNING):
        assert RankBytes(client, keys).read() is None
    assert "joiners touch no memory ahead" in caplog.text


def test_of_figures_published_in_quick_succession_the_newest_is_the_one_left_written(client):
    keys = JobKeys("rank-bytes-succession")
    record = RankBytes(client, keys)
    threads = [record.publish(nbytes) for nbytes in range(1, 9)]
    for thread in threads:
        thread.join(WRITTEN)
    assert RankBytes(client, keys).read() == 8
