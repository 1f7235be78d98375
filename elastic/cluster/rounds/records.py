"""Checks on what the cluster layer reads from etcd, before any of it is used.

Whoever can write the job's prefix can write anything there, so every record is read as
untrusted JSON: an object with exactly the expected fields, each of the expected type and in
range. A malformed join request is skipped (``SkippedRecords`` warns once per key and
revision); a malformed plan or round counter, which the job cannot go on without, is an
``EtcdRecordError``. No torch, no etcd calls.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from elastic.foundation.errors import EtcdRecordError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_VERSION = 2**63 - 1  # commit versions travel as int64 (the versions all-gather)
MAX_ROUND = 10**8 - 1  # round numbers are eight digits in keys
_MAX_MEMBER_ID = 300  # a host name (up to 253 characters), a pid and a random suffix
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


class RecordError(ValueError):
    """A record read from etcd is malformed; the message says which field and how."""


def load_object(raw: bytes, fields: dict[str, bool]) -> dict[str, Any]:
    """Parses ``raw`` as a JSON object with the given fields (name -> required).

    Raises:
        RecordError: not UTF-8 JSON, not an object, a required field missing, an unknown field.
    """
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"not JSON ({type(exc).__name__})") from None
    if type(data) is not dict:
        raise RecordError(f"a JSON {type(data).__name__}, not an object")
    missing = sorted(name for name, required in fields.items() if required and name not in data)
    unknown = sorted(name for name in data if name not in fields)
    if missing:
        raise RecordError(f"it lacks the fields {missing}")
    if unknown:
        raise RecordError(f"it has unknown fields {_show(unknown)}")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the constant {name} is not JSON")


def integer(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``.

    Raises:
        RecordError: otherwise.
    """
    if type(value) is not int or not low <= value <= high:
        raise RecordError(f"{name} is {_show(value)}, not an integer in [{low}, {high}]")
    return value


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is true or false.

    Raises:
        RecordError: otherwise.
    """
    if type(value) is not bool:
        raise RecordError(f"{name} is {_show(value)}, not true or false")
    return value


def member_id(name: str, value: Any) -> str:
    """``value`` if it can be a member id (``host-pid-hex``): printable, no '/' or space.

    Raises:
        RecordError: otherwise.
    """
    if type(value) is not str or not 0 < len(value) <= _MAX_MEMBER_ID \
            or not value.isprintable() or "/" in value or " " in value:
        raise RecordError(f"{name} is {_show(value)}, not a member id")
    return value


def member_ids(name: str, values: list[Any]) -> list[str]:
    """``values`` if each can be a member id (``member_id``), checked in a few passes over them
    all: a plan names every member of the job.

    Raises:
        RecordError: an entry is not a member id.
    """
    if all(type(v) is str and 0 < len(v) <= _MAX_MEMBER_ID for v in values):
        joined = "".join(values)
        if joined.isprintable() and "/" not in joined and " " not in joined:
            return values
    return [member_id(name, value) for value in values]  # raises, naming the entry


def address(name: str, value: Any) -> str:
    """``value`` if it is an IP address or a host name.

    Raises:
        RecordError: otherwise.
    """
    if type(value) is str and len(value) <= 253:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            if _HOSTNAME.fullmatch(value):
                return value
    raise RecordError(f"{name} is {_show(value)}, not an IP address or host name")


def one_of(name: str, value: Any, allowed: frozenset[str]) -> str:
    """``value`` if it is one of ``allowed``.

    Raises:
        RecordError: otherwise.
    """
    if type(value) is not str or value not in allowed:
        raise RecordError(f"{name} is {_show(value)}, not one of {sorted(allowed)}")
    return value


def round_number(key: str, raw: bytes) -> int:
    """The round counter stored at ``key``.

    Raises:
        EtcdRecordError: ``raw`` is not a round number.
    """
    text = raw.decode("ascii", errors="replace")
    if not (text.isascii() and text.isdigit() and 0 < int(text) <= MAX_ROUND):
        raise corrupt(key, f"{_show(text)} is not a round number")
    return int(text)


def corrupt(key: str, why: str) -> EtcdRecordError:
    """The error for a record the job cannot go on without."""
    return EtcdRecordError(
        f"the record at {key} is malformed ({why}): something other than this job's workers "
        f"wrote the job's etcd prefix. Restrict who can write it (docs/security.md) and start "
        f"the job again under a new --job-id.")


def _show(value: Any) -> str:
    """A short rendering of untrusted input for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class SkippedRecords:
    """Warns once for each skipped record (by key and revision), however often it is read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[tuple[str, int]] = set()

    def skip(self, key: str, revision: int, why: str) -> None:
        """Records that the record at ``key`` (this revision) is skipped; warns the first time."""
        with self._lock:
            if (key, revision) in self._warned:
                return
            self._warned.add((key, revision))
        log.warning("skipped the record at %s: %s", key, why)

    def read(self, key: str, revision: int, parse: Callable[[], T]) -> T | None:
        """What ``parse()`` reads from the record at ``key``, or None (skipped) on a
        ``RecordError``."""
        try:
            return parse()
        except RecordError as exc:
            self.skip(key, revision, str(exc))
            return None
