"""A missing-credentials error of the object store's client leaves the checkpoint package as a
CheckpointError whose message says what to set, never as the client's own exception."""

from __future__ import annotations

import pytest

from elastic.checkpoint import CheckpointCredentialsError, CheckpointError
from elastic.checkpoint.backend import Storage

botocore_exceptions = pytest.importorskip("botocore.exceptions")
pytestmark = pytest.mark.unit


class NoCredentialsFs:
    """An fsspec-like filesystem whose every call fails as s3fs does without credentials."""

    def invalidate_cache(self) -> None:
        pass

    def find(self, *args: object, **kwargs: object) -> dict:
        raise botocore_exceptions.NoCredentialsError()

    def cat_file(self, path: str) -> bytes:
        raise botocore_exceptions.NoCredentialsError()

    def unstrip_protocol(self, path: str) -> str:
        return f"s3://{path}"


def test_botocore_no_credentials_becomes_a_checkpoint_error_that_names_the_variables():
    storage = Storage(NoCredentialsFs(), "bucket/run-7")
    for call in (storage.entries, lambda: storage.read_bytes("bucket/run-7/x")):
        with pytest.raises(CheckpointCredentialsError) as caught:
            call()
        assert isinstance(caught.value, CheckpointError)
        assert "s3://bucket/run-7" in str(caught.value)
        assert "AWS_ACCESS_KEY_ID" in str(caught.value)
        assert isinstance(caught.value.__cause__, botocore_exceptions.NoCredentialsError)
