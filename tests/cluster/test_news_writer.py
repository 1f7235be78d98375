"""``NewsWriter`` against a real etcd: the news record's compare-and-swap, and its guard, when the
``control/`` watch missed what changed."""

from __future__ import annotations

from elastic.cluster.etcd.client import EtcdClient, KeyValue, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import RoundNews
from elastic.cluster.rounds.news_writer import NewsWriter


def put_event(kv: KeyValue) -> WatchEvent:
    return WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease, kv.create_revision)


def leading(client: EtcdClient, job: str) -> tuple[NewsWriter, JobKeys]:
    """A writer for member "m1", whose watch told it that m1 holds the coordinator key."""
    keys = JobKeys(job)
    client.put(keys.coordinator, "m1")
    writer = NewsWriter(client, keys, lambda: "m1")
    writer.on_control([put_event(client.get(keys.coordinator))])
    writer.lead()
    return writer, keys


def test_a_leader_whose_key_went_to_another_unseen_steps_down_at_its_next_write(client):
    writer, keys = leading(client, "news-writer-guard")
    assert writer.write(RoundNews(1))
    client.put(keys.coordinator, "m2")  # a successor; this leader's watch has not told it
    assert not writer.write(RoundNews(1, broken="m3 is gone"))
    assert writer.lost and writer.holder() == (True, "m2")
    assert RoundNews.from_json(client.get(keys.news).value) == RoundNews(1)


def test_a_news_record_deleted_unseen_is_written_again_in_one_call(client):
    writer, keys = leading(client, "news-writer-deleted")
    assert writer.write(RoundNews(1))
    client.delete(keys.news)
    assert writer.write(RoundNews(2))
    assert RoundNews.from_json(client.get(keys.news).value) == RoundNews(2)
    assert not writer.lost


def test_a_late_event_of_its_own_write_does_not_make_the_next_write_retry(client, monkeypatch):
    writer, keys = leading(client, "news-writer-late")
    assert writer.write(RoundNews(1))
    first = client.get(keys.news)
    assert writer.write(RoundNews(2))
    writer.on_control([put_event(first)])  # the watch brings the first write back, late
    tries: list[int] = []
    replace = client.replace

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        done = replace(*args, **kwargs)
        tries.append(done.revision)
        return done

    monkeypatch.setattr(client, "replace", counted)
    assert writer.write(RoundNews(3))
    assert len(tries) == 1 and tries[0], f"tries: {tries}"
