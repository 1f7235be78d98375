"""Faults and bad input: storage errors mid-write (a fault-injecting fsspec filesystem), async
writes that must not block the caller, unknown schemes, incompatible states, bad arguments."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import (
    CheckpointBackendError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointIncompatibleError,
    CheckpointStore,
    CheckpointWriteError,
    check_compatible,
)
from elastic.checkpoint.manifest import DCP_FORMAT
from elastic.checkpoint.payload import file_entry

pytestmark = pytest.mark.timeout(60)
URL = "faultmem://run"


def big_state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 1024), value), "step": torch.tensor(int(value))}


def test_storage_error_mid_write_keeps_previous_checkpoint_loadable(faulty_fs) -> None:
    store = CheckpointStore(URL)
    store.save(1, big_state(1.0))
    faulty_fs.plan.fail_after_bytes = 100_000
    with pytest.raises(CheckpointWriteError, match="step 2.*Earlier checkpoints are intact"):
        store.save(2, big_state(2.0))
    assert faulty_fs.plan.fired == 1
    assert [r.step for r in store.list()] == [1]
    assert not any("000000000002" in p for p in faulty_fs.store)  # partial payload removed
    assert torch.equal(store.load().state_dict["w"], big_state(1.0)["w"])
    assert store.save(3, big_state(3.0)).step == 3  # the job keeps training and saving


def test_storage_error_mid_async_write_surfaces_through_the_future(faulty_fs) -> None:
    store = CheckpointStore(URL)
    store.save(1, big_state(1.0))
    faulty_fs.plan.fail_after_bytes = 4096
    future = store.save_async(2, big_state(2.0))
    with pytest.raises(CheckpointWriteError) as info:
        future.result(timeout=30)
    assert isinstance(info.value.__cause__, OSError)
    assert isinstance(info.value, CheckpointError)
    assert store.load().ref.step == 1
    store.close()


def test_transient_connection_error_is_retried_and_the_save_completes(faulty_fs, caplog) -> None:
    faulty_fs.plan.fail_after_bytes = 10
    faulty_fs.plan.error = lambda: ConnectionResetError(104, "injected: connection reset")
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        ref = CheckpointStore(URL).save(1, big_state(1.0))
    assert faulty_fs.plan.fired == 1 and "Retrying" in caplog.text
    assert torch.equal(CheckpointStore(URL).load(ref).state_dict["w"], big_state(1.0)["w"])


def test_the_retry_deadline_given_to_the_store_bounds_the_retries(faulty_fs, caplog) -> None:
    faulty_fs.plan.fail_after_bytes = 10
    faulty_fs.plan.failures = 1000  # the storage never heals
    faulty_fs.plan.error = lambda: ConnectionResetError(104, "injected: connection reset")
    store = CheckpointStore(URL, retry_for=timedelta(seconds=0.1))
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint"), \
            pytest.raises(CheckpointWriteError):
        store.save(1, big_state(1.0))
    # One try, the first pause (1 s), one more try: then the 0.1 s deadline has passed (the
    # default deadline would allow five tries, four pauses).
    assert caplog.text.count("Retrying") == 1


def test_a_retry_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="retry_for"):
        CheckpointStore("memory://deadline", retry_for=timedelta(0))


def test_async_save_returns_before_the_write_finishes(faulty_fs) -> None:
    faulty_fs.plan.gate = threading.Event()
    store = CheckpointStore(URL)
    future = store.save_async(1, big_state(1.0))
    assert faulty_fs.plan.started.wait(10), "the background write never started"
    assert not future.done()  # the writer is stuck in storage; the caller is not
    assert store.wait(timedelta(seconds=0.05)) is False
    assert store.list() == []  # nothing is visible before the manifest
    faulty_fs.plan.gate.set()
    assert future.result(timeout=30).step == 1
    assert store.wait(timedelta(seconds=10)) is True
    store.close()


def test_a_write_that_fails_after_a_newer_generation_published_is_fenced_not_failed(
        faulty_fs) -> None:
    """A frozen rank 0 wakes up after the new rank 0 published and removed its unfinished
    directory: its write fails (the file is gone), and that is the fence, not a storage
    failure that would fail the run."""
    store = CheckpointStore(URL)
    store.save(10, big_state(1.0), {"generation": 5})
    gate = faulty_fs.plan.gate = threading.Event()
    faulty_fs.plan.started.clear()  # set by step 10's write
    stale = store.save_async(11, big_state(2.0), {"generation": 5})
    assert faulty_fs.plan.started.wait(10), "the stale write never started"
    faulty_fs.plan.gate = None  # the newer writer is not held
    CheckpointStore(URL).save(20, big_state(3.0), {"generation": 6})
    faulty_fs.plan.fail_after_bytes = 0
    faulty_fs.plan.error = lambda: FileNotFoundError(2, "No such file or directory")
    gate.set()
    with pytest.raises(CheckpointFencedError, match="generation 6 has already written"):
        stale.result(timeout=30)
    assert [r.step for r in store.list()] == [10, 20]
    store.close()


def test_next_async_save_waits_for_the_previous_one(faulty_fs) -> None:
    faulty_fs.plan.gate = threading.Event()
    store = CheckpointStore(URL)
    first = store.save_async(1, big_state(1.0))
    assert faulty_fs.plan.started.wait(10)
    second_returned = threading.Event()
    results = []

    def second_save() -> None:
        results.append(store.save_async(2, big_state(2.0)))
        second_returned.set()

    thread = threading.Thread(target=second_save)
    thread.start()
    assert not second_returned.wait(0.2)  # blocked: one write in flight at most
    faulty_fs.plan.gate.set()
    assert second_returned.wait(10)
    thread.join(10)
    assert first.done() and results[0].result(timeout=30).step == 2
    assert [r.step for r in store.list()] == [1, 2]
    store.close()


def test_unknown_scheme_is_a_backend_error_saying_what_to_install() -> None:
    with pytest.raises(CheckpointBackendError, match="nosuchscheme.*pip install"):
        CheckpointStore("nosuchscheme://bucket/run")


def test_missing_backend_package_is_named_in_the_error() -> None:
    try:
        import adlfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("adlfs is installed here")
    with pytest.raises(CheckpointBackendError, match="adlfs"):
        CheckpointStore("az://container/run")


def test_check_compatible_names_the_key_and_both_shapes() -> None:
    live = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "epoch": 1}
    loaded = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(4)}, "epoch": 3}
    with pytest.raises(CheckpointIncompatibleError,
                       match=r"'model\.w'.*\(4, 3\).*\(3, 4\)"):
        check_compatible(loaded, live)


def test_check_compatible_names_missing_and_unexpected_keys() -> None:
    live = {"model": {"w": torch.zeros(2)}}
    with pytest.raises(CheckpointIncompatibleError, match="lacks key 'model.w'"):
        check_compatible({"model": {}}, live)
    with pytest.raises(CheckpointIncompatibleError, match="has key 'model.extra'"):
        check_compatible({"model": {"w": torch.zeros(2), "extra": 1}}, live)
    check_compatible({"model": {"w": torch.ones(2, dtype=torch.float64)}}, live)


def test_values_that_cannot_be_loaded_safely_are_rejected_before_writing(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(TypeError, match=r"state_dict\.opt\.fn has type function"):
        store.save(1, {"opt": {"fn": lambda: 0}})
    assert store.list() == [] and list(tmp_path.iterdir()) == []


def test_bad_arguments_are_rejected_with_the_value_in_the_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keep \(0\)"):
        CheckpointStore(str(tmp_path), keep=0)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ValueError, match=r"step \(-1\)"):
        store.save(-1, {})
    with pytest.raises(ValueError, match=r"metadata generation \('2'\)"):
        store.save(1, {}, {"generation": "2"})
    with pytest.raises(ValueError, match="JSON"):
        store.save(1, {}, {"when": object()})
    with pytest.raises(ValueError, match=r"metadata step \(2\) differs"):
        store.save(1, {}, {"step": 2})


def test_local_checkpoint_loads_memory_mapped_and_independent_of_the_file(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=1)
    store.save(1, big_state(1.0))
    loaded = store.load()
    store.save(2, big_state(2.0))  # retention deletes step 1 while its tensors are mapped
    assert not (tmp_path / "000000000001").exists()
    assert torch.equal(loaded.state_dict["w"], big_state(1.0)["w"])
    loaded.state_dict["w"].add_(1.0)  # private mapping: writes never reach a file
    assert torch.equal(store.load().state_dict["w"], big_state(2.0)["w"])


def test_consecutive_async_saves_each_keep_their_own_values(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=None)
    state = big_state(0.0)
    futures = []
    for step in range(1, 4):
        state["w"].fill_(float(step))  # staging buffers are reused between saves
        futures.append(store.save_async(step, state))
    assert [f.result(timeout=30).step for f in futures] == [1, 2, 3]
    for ref in store.list():
        assert torch.equal(store.load(ref).state_dict["w"], big_state(float(ref.step))["w"])
    store.close()
    with pytest.raises(CheckpointError, match="closed"):
        store.save_async(4, state)
    assert store.latest().step == 3  # reading still works


def test_retention_keeps_an_older_checkpoint_while_a_newer_one_fails_its_checksum(
        tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (1, 2):
        store.save(step, {"w": torch.full((256,), float(step))})
    [name] = store.list()[-1].manifest.files
    payload = tmp_path / f"{2:012d}" / name
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # step 2 rots on disk
    payload.write_bytes(bytes(data))

    store.save(3, {"w": torch.full((256,), 3.0)})

    assert [ref.step for ref in store.list()] == [1, 2, 3]  # 1 stays: 2 does not verify
    assert store.load(store.list()[0]).state_dict["w"][0] == 1.0


def test_with_keep_one_a_newer_checkpoint_that_fails_its_checksum_never_costs_the_last_good_one(
        faulty_fs) -> None:
    store = CheckpointStore(URL, keep=1)
    store.save(1, big_state(1.0))
    faulty_fs.plan.corrupt = True  # step 2's payload rots as it is stored: same size
    store.save(2, big_state(2.0))
    assert faulty_fs.plan.fired == 1
    assert 1 in [ref.step for ref in store.list()]  # 2 does not verify: 1 must stay
    assert torch.equal(store.load().state_dict["w"], big_state(1.0)["w"])
    store.save(3, big_state(3.0))  # a newer one that verifies: now 1 may go
    assert [ref.step for ref in store.list()] == [3]


def test_a_stale_writer_s_higher_step_never_becomes_the_latest_or_outlives_retention(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    store.save(12, {"w": torch.zeros(2)}, {"generation": 1})  # a stale writer ran ahead
    store.save(10, {"w": torch.ones(2)}, {"generation": 2})
    store.save(11, {"w": torch.full((2,), 2.0)}, {"generation": 2})
    assert store.latest().step == 11
    assert [ref.step for ref in store.list()] == [10, 11]  # gen 1's step 12 went first
    assert torch.equal(store.load().state_dict["w"], torch.full((2,), 2.0))


def test_a_fenced_writer_of_shards_leaves_a_newer_generations_checkpoint_of_its_step(
        tmp_path) -> None:
    # generations 1 and 2 both commit step 10; the stale one opened it first, the newer one
    # published, then the stale one is fenced at its own publish
    url = str(tmp_path / "ckpt")
    stale, newer = CheckpointStore(url), CheckpointStore(url)
    stale.open_step(10, {"generation": 1})
    newer.open_step(10, {"generation": 2})
    step_dir = tmp_path / "ckpt" / "000000000010"  # where the newer writer's DCP writes
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "__0_0.distcp").write_bytes(b"shard of generation 2")
    files = {"__0_0.distcp": file_entry(newer.storage,
                                        newer.storage.join("000000000010/__0_0.distcp"))}
    newer.publish_files(10, files, {"generation": 2}, DCP_FORMAT)
    with pytest.raises(CheckpointFencedError):
        stale.publish_files(10, files, {"generation": 1}, DCP_FORMAT)
    assert [(r.step, r.generation) for r in CheckpointStore(url).list()] == [(10, 2)]
    assert (step_dir / "__0_0.distcp").read_bytes() == b"shard of generation 2"
