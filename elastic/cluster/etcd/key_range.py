"""A range of etcd keys, ``[start, end)`` in etcd's byte order, built from prefixes.

Kept apart from the etcd client's modules so that the key builder (``keys.py``) can name ranges
without importing gRPC, whose environment ``client`` sets before gRPC is first imported.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeyRange"]


def _after_prefix(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (etcd's range end of a
    prefix). Code points sort as their UTF-8 bytes do, so the last one is incremented."""
    if not prefix:
        raise ValueError("an empty prefix has no range end short of every key")
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class KeyRange:
    """The keys from ``start`` (included) to ``end`` (excluded), in etcd's byte order."""

    start: str
    end: str

    @classmethod
    def prefix(cls, prefix: str) -> KeyRange:
        """Every key that starts with ``prefix``."""
        return cls(prefix, _after_prefix(prefix))

    @classmethod
    def after_prefix(cls, prefix: str, within: str) -> KeyRange:
        """The keys under ``within`` that sort after every key under ``prefix``."""
        return cls(_after_prefix(prefix), _after_prefix(within))

    def __str__(self) -> str:
        return f"{self.start}*" if self.end == _after_prefix(self.start) else \
            f"[{self.start}, {self.end})"
