"""Comparing nested states (dicts, lists, tuples of tensors and plain values) in tests."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """Asserts that two nested states are equal: same keys, lengths, dtypes, shapes, values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}/{i}")
    else:
        assert a == b, where
