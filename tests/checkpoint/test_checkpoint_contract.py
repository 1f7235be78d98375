"""The CheckpointStore contract, run on every backend: a plain local path, file://, memory://,
s3:// (a moto server on 127.0.0.1) and gs:// (a GCS emulator on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from elastic.checkpoint import (
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointRaceError,
    CheckpointStore,
    CheckpointUnsafeError,
    FileEntry,
    Manifest,
)

pytestmark = pytest.mark.timeout(60)


def sample_state(scale: float = 1.0) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                  "b": torch.zeros(4, dtype=torch.float64)},
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None}],
                      "state": {0: {"step": torch.tensor(3.0)}}},
        "sampler": {"epoch": 2, "seed": 0, "consumed": 96, "name": "elastic", "shuffle": True},
    }


def assert_same_state(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            assert_same_state(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_state(g, w)
    else:
        assert got == want and type(got) is type(want)


class _RunsCode:
    """Pickles to a call of os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _PublishesMeanwhile(torch.Tensor):
    """A tensor that, as it is pickled (while its writer writes the payload), lets another
    writer publish first: it calls ``meanwhile``."""

    meanwhile: Callable[[], object]  # set on the class: the store snapshots a copy of the tensor

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        _PublishesMeanwhile.meanwhile()
        return (torch.zeros, (1,))


def publishing_meanwhile(state: dict[str, Any], meanwhile: Callable[[], object]
                         ) -> dict[str, Any]:
    """``state`` with a tensor that runs ``meanwhile`` while the payload is written."""
    _PublishesMeanwhile.meanwhile = meanwhile
    return {**state, "meanwhile": torch.zeros(1).as_subclass(_PublishesMeanwhile)}


class StoreContract:
    """Every backend must pass these. Subclasses provide ``url`` and ``options``."""

    url: str
    options: dict[str, Any] | None = None

    def store(self, keep: int | None = 3) -> CheckpointStore:
        return CheckpointStore(self.url, keep=keep, storage_options=self.options)

    def raw_fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **(self.options or {}))
        fs.invalidate_cache()
        return fs, root.rstrip("/")

    def put(self, rel: str, data: bytes) -> None:
        fs, root = self.raw_fs()
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{rel}", data)

    def names_in(self, step: int) -> list[str]:
        fs, root = self.raw_fs()
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{step:012d}", detail=False))

    def payload_path(self, ref: Any) -> str:
        [name] = ref.manifest.files
        return f"{self.raw_fs()[1]}/{ref.step:012d}/{name}"

    def test_saved_state_loads_back_equal_with_its_metadata(self) -> None:
        store = self.store()
        state = sample_state()
        ref = store.save(7, state, {"epoch": 2, "world_size": 3, "generation": 4, "note": "x"})
        loaded = store.load()
        assert loaded.ref == ref and ref.step == 7
        assert (ref.epoch, ref.world_size, ref.generation) == (2, 3, 4)
        assert loaded.metadata == {"step": 7, "epoch": 2, "world_size": 3, "generation": 4,
                                   "note": "x"}
        assert_same_state(loaded.state_dict, state)
        assert_same_state(store.load(ref).state_dict, state)

    def test_a_reader_sees_checkpoints_completed_after_it_first_listed(self) -> None:
        # Another process in real jobs: a filesystem instance of its own (no shared caches).
        reader = self.store()
        writer = CheckpointStore(self.url, storage_options={**(self.options or {}),
                                                            "skip_instance_cache": True})
        assert reader.list() == []
        writer.save(1, sample_state())
        assert [r.step for r in reader.list()] == [1]
        self.put(f"{3:012d}/state.pt", b"a write in progress: no manifest yet")
        assert [r.step for r in reader.list()] == [1]  # the reader lists the step meanwhile
        writer.save(3, sample_state())
        assert [r.step for r in reader.list()] == [1, 3]
        assert reader.latest().step == 3

    def test_empty_store_has_no_latest_and_load_raises_not_found(self) -> None:
        store = self.store()
        assert store.latest() is None and store.list() == []
        with pytest.raises(CheckpointNotFoundError, match="no readable checkpoint"):
            store.load()

    def test_layout_is_a_step_directory_with_payload_and_manifest(self) -> None:
        self.store().save(42, sample_state(), {"epoch": 1, "world_size": 2, "generation": 0})
        fs, root = self.raw_fs()
        step_dir = f"{root}/000000000042"
        manifest, name = self.names_in(42)
        assert manifest == "manifest.json" and re.fullmatch(r"state\.[0-9a-f]{16}\.pt", name)
        doc = json.loads(fs.cat_file(f"{step_dir}/manifest.json"))
        assert doc["format_version"] == 1 and doc["step"] == 42 and doc["epoch"] == 1
        assert doc["world_size"] == 2 and doc["generation"] == 0 and doc["created"] > 0
        payload = fs.cat_file(f"{step_dir}/{name}")
        assert doc["files"] == {name: {"size": len(payload),
                                       "sha256": hashlib.sha256(payload).hexdigest()}}

    def test_list_returns_checkpoints_oldest_first_and_latest_is_the_newest(self) -> None:
        store = self.store(keep=None)
        for step in (30, 10, 20):
            store.save(step, sample_state(step))
        assert [r.step for r in store.list()] == [10, 20, 30]
        assert store.latest().step == 30

    def test_retention_keeps_only_the_newest_checkpoints(self) -> None:
        store = self.store(keep=2)
        for step in range(1, 5):
            store.save(step, sample_state(step))
        assert [r.step for r in store.list()] == [3, 4]
        fs, root = self.raw_fs()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
            "000000000003", "000000000004"]

    def test_saving_an_existing_step_raises_and_keeps_the_original(self) -> None:
        store = self.store()
        store.save(5, sample_state(1.0))
        with pytest.raises(CheckpointError, match="step 5 already has a checkpoint"):
            store.save(5, sample_state(2.0))
        assert_same_state(store.load().state_dict, sample_state(1.0))

    def test_torn_write_falls_back_to_previous_checkpoint(self, caplog) -> None:
        store = self.store()
        store.save(1, sample_state(1.0))
        fs, root = self.raw_fs()
        self.put("000000000002/state.pt", b"half a payload")  # no manifest
        assert [r.step for r in store.list()] == [1]
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            loaded = store.load()
        assert loaded.ref.step == 1
        assert "000000000002" in caplog.text and "no manifest" in caplog.text

    def test_torn_write_leftovers_are_cleaned_up_by_the_next_save(self) -> None:
        store = self.store()
        fs, root = self.raw_fs()
        self.put("000000000001/state.pt", b"torn")
        store.save(2, sample_state())
        fs.invalidate_cache()
        assert not fs.exists(f"{root}/000000000001/state.pt")
        assert [r.step for r in store.list()] == [2]

    def test_manifest_naming_a_missing_file_is_skipped(self, caplog) -> None:
        store = self.store()
        store.save(1, sample_state(1.0))
        fs, _ = self.raw_fs()
        fs.rm_file(self.payload_path(store.save(2, sample_state(2.0))))
        assert [r.step for r in store.list()] == [1]
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            assert store.load().ref.step == 1
        assert "missing" in caplog.text

    def test_corrupt_payload_falls_back_to_previous_checkpoint_with_a_warning(
            self, caplog) -> None:
        store = self.store()
        store.save(1, sample_state(1.0))
        path = self.payload_path(store.save(2, sample_state(2.0)))
        fs, _ = self.raw_fs()
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        fs.pipe_file(path, bytes(data))
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            loaded = store.load()
        assert loaded.ref.step == 1
        assert_same_state(loaded.state_dict, sample_state(1.0))
        assert "does not match its manifest" in caplog.text

    def test_async_save_snapshots_the_state_before_returning(self) -> None:
        store = self.store()
        state = sample_state(1.0)
        future = store.save_async(3, state, {"epoch": 0})
        state["model"]["w"].add_(100.0)  # training goes on and updates in place
        assert future.result(timeout=30).step == 3
        store.close()
        assert_same_state(self.store().load().state_dict, sample_state(1.0))

    def test_writer_of_an_older_generation_cannot_publish(self) -> None:
        store = self.store()
        store.save(10, sample_state(), {"generation": 5})
        with pytest.raises(CheckpointFencedError, match="generation 5"):
            store.save(11, sample_state(), {"generation": 4})
        assert [r.step for r in store.list()] == [10]
        assert store.save(12, sample_state(), {"generation": 6}).generation == 6

    def test_a_write_that_fails_because_a_newer_generation_published_meanwhile_is_fenced(
            self) -> None:
        store = self.store()
        store.save(10, sample_state(), {"generation": 5})
        newer = self.store()
        stale = publishing_meanwhile(sample_state(),
                                     lambda: newer.save(20, sample_state(), {"generation": 6}))
        with pytest.raises(CheckpointFencedError, match="generation 6 has already written"):
            store.save(11, stale, {"generation": 5})
        assert [r.step for r in store.list()] == [10, 20]

    def test_a_writer_losing_the_race_to_publish_a_step_gets_a_typed_error_and_overwrites_nothing(
            self) -> None:
        first, second = self.store(), self.store()
        winner = sample_state(2.0)

        def meanwhile() -> None:  # the other writer publishes this step before we do
            second.save(7, winner, {"generation": 5, "job_id": "other"})

        with pytest.raises(CheckpointRaceError, match="published step 7 first by generation 5 "
                                                      "of job 'other'"):
            first.save(7, sample_state(1.0), {"generation": 5}, before_publish=meanwhile)
        loaded = self.store().load()
        assert loaded.metadata["job_id"] == "other"
        assert_same_state(loaded.state_dict, winner)

    def test_a_writer_losing_the_race_never_overwrites_the_winner_s_payload(self) -> None:
        loser, winner = self.store(), self.store()
        won = sample_state(2.0)
        late = publishing_meanwhile(  # the loser's payload lands after the winner published
            sample_state(1.0), lambda: winner.save(7, won, {"generation": 5, "job_id": "other"}))
        with pytest.raises(CheckpointRaceError, match="published step 7 first"):
            loser.save(7, late, {"generation": 5})
        loaded = self.store().load()
        assert loaded.metadata["job_id"] == "other"
        assert_same_state(loaded.state_dict, won)
        assert self.names_in(7) == sorted(["manifest.json", *loaded.ref.manifest.files])

    def test_a_file_beside_a_published_checkpoint_s_payload_is_removed_by_retention(self) -> None:
        self.put(f"{3:012d}/state.0123456789abcdef.pt", b"a payload that lost the race")
        ref = self.store().save(3, sample_state())
        assert self.names_in(3) == sorted(["manifest.json", *ref.manifest.files])

    def test_a_checkpoint_whose_payload_is_the_old_state_pt_loads_and_is_retained(self) -> None:
        old = io.BytesIO()
        torch.save(sample_state(5.0), old)
        payload = old.getvalue()
        self.put("000000000005/state.pt", payload)
        self.put("000000000005/manifest.json", Manifest(
            step=5, epoch=1, world_size=2, generation=3, metadata={"step": 5},
            files={"state.pt": FileEntry(len(payload), hashlib.sha256(payload).hexdigest())},
        ).to_json())
        store = self.store(keep=1)
        assert_same_state(store.load().state_dict, sample_state(5.0))
        store.save(6, sample_state(6.0), {"generation": 3})
        assert [r.step for r in store.list()] == [6]  # retention removes it like any other

    def test_crafted_payload_that_runs_code_is_refused_and_nothing_runs(
            self, marker_path: Path, tmp_path: Path) -> None:
        proof = tmp_path / "proof"
        unsafe = io.BytesIO()
        torch.save({"w": torch.ones(1), "x": _RunsCode(proof)}, unsafe)
        torch.load(io.BytesIO(unsafe.getvalue()), weights_only=False)  # the exploit is real
        assert proof.exists()
        evil = io.BytesIO()
        torch.save({"w": torch.ones(1), "x": _RunsCode(marker_path)}, evil)
        payload = evil.getvalue()
        manifest = Manifest(step=1, epoch=None, world_size=None, generation=None, metadata={},
                            files={"state.pt": FileEntry(len(payload),
                                                         hashlib.sha256(payload).hexdigest())})
        self.put("000000000001/state.pt", payload)
        self.put("000000000001/manifest.json", manifest.to_json())
        store = self.store()
        with pytest.raises(CheckpointUnsafeError, match="refused"):
            store.load(store.latest())
        with pytest.raises(CheckpointNotFoundError, match="refused"):
            store.load()
        assert not marker_path.exists()


class TestLocalPathStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.url = str(tmp_path / "ckpt")


class TestFileUrlStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.url = f"file://{tmp_path}/ckpt"


class TestMemoryStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _root(self, clean_memory_fs: None) -> None:
        self.url = "memory://ckpt/run"


class ConditionalCreateContract(StoreContract):
    """Object stores: the server itself refuses a second conditional create of one name, which
    is what keeps two writers racing inside the window between the store's look for a manifest
    and its write from both publishing."""

    def test_the_server_refuses_a_conditional_create_over_an_existing_object(self) -> None:
        fs, root = self.raw_fs()
        fs.pipe_file(f"{root}/taken", b"first", mode="create")
        with pytest.raises(FileExistsError):
            fs.pipe_file(f"{root}/taken", b"second", mode="create")
        fs.invalidate_cache()
        assert fs.cat_file(f"{root}/taken") == b"first"


class TestS3Store(ConditionalCreateContract):
    @pytest.fixture(autouse=True)
    def _root(self, s3_server: dict[str, Any], s3_url: str) -> None:
        self.url = s3_url
        self.options = s3_server


class TestGCSStore(ConditionalCreateContract):
    @pytest.fixture(autouse=True)
    def _root(self, gcs_server: dict[str, Any], gcs_url: str) -> None:
        self.url = gcs_url
        self.options = gcs_server

    @pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,
                       reason="gcp-storage-emulator ignores ifGenerationMatch (real GCS honours "
                              "it): the second create overwrites; see docs/storage.md")
    def test_the_server_refuses_a_conditional_create_over_an_existing_object(self) -> None:
        super().test_the_server_refuses_a_conditional_create_over_an_existing_object()
