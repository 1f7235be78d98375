"""Commit copies from a GPU, checked without one: a stand-in accelerator records the order of
stream calls, and the copies themselves run on CPU tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from elastic.state.device_copy import copy_to_host, host_buffer

pytestmark = pytest.mark.unit


class _Accelerator:
    """Records what ``copy_to_host`` asks of a device's streams."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_side_stream = False
        accelerator = self

        class Stream:
            def __init__(self, device: torch.device) -> None:
                accelerator.calls.append(f"stream({device})")

            def wait_stream(self, other: str) -> None:
                accelerator.calls.append(f"wait({other})")

            def synchronize(self) -> None:
                accelerator.calls.append("synchronize")

        self.Stream = Stream

    def current_stream(self, device: torch.device) -> str:
        return "current"

    @contextlib.contextmanager
    def stream(self, stream: object):
        self.calls.append("enter")
        self.in_side_stream = True
        yield
        self.in_side_stream = False
        self.calls.append("exit")


def test_copies_wait_for_the_step_run_without_blocking_on_a_side_stream_then_wait_once():
    accelerator = _Accelerator()
    sources = [torch.randn(3), torch.randn(2, 2)]
    buffers = [torch.empty_like(s) for s in sources]
    recorded: list[bool] = []
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        recorded.append((non_blocking, accelerator.in_side_stream))
        return original(self, src, non_blocking=non_blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "copy_", copy_)
        copy_to_host(list(zip(buffers, sources)), accelerator_of=lambda device: accelerator)
    assert accelerator.calls == ["stream(cpu)", "wait(current)", "enter", "exit", "synchronize"]
    assert recorded == [(True, True), (True, True)]
    assert all(torch.equal(b, s) for b, s in zip(buffers, sources))


def test_a_device_without_streams_copies_each_tensor_blocking():
    sources = [torch.randn(4)]
    buffers = [torch.empty(4)]
    copy_to_host(list(zip(buffers, sources)), accelerator_of=lambda device: None)
    assert torch.equal(buffers[0], sources[0])


def test_a_host_buffer_for_a_cpu_tensor_is_ordinary_memory():
    buffer = host_buffer(torch.randn(2, 3, dtype=torch.float64))
    assert buffer.shape == (2, 3) and buffer.dtype == torch.float64 and not buffer.is_pinned()
