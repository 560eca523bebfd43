"""Tests of the benchmarks' device plumbing that run without a GPU: which device/world-size cases skip
and why, the ranks' backend, and the raw limit's host staging (its double-buffer logic, exercised with
plain CPU buffers; on a GPU the same code runs with pinned buffers and CUDA events). Nothing is timed."""

from __future__ import annotations

import pytest
import torch

from bench import config
from bench.workloads.checkpoint import HostStaging


def test_cpu_is_always_available() -> None:
    assert config.device_unavailable("cpu", 4, cuda_devices=0) is None


@pytest.mark.parametrize(("world_size", "visible", "needle"), [
    (1, 0, "no CUDA device is visible"),
    (2, 1, "needs 2 GPUs (one per rank), 1 visible"),
    (4, 2, "needs 4 GPUs (one per rank), 2 visible"),
])
def test_cuda_without_enough_gpus_is_a_skip_that_says_why(world_size: int, visible: int, needle: str) -> None:
    reason = config.device_unavailable("cuda", world_size, cuda_devices=visible)
    assert reason is not None and needle in reason and "BENCH_DEVICE=cuda" in reason


def test_cuda_with_enough_gpus_runs() -> None:
    assert config.device_unavailable("cuda", 2, cuda_devices=2) is None


def test_unknown_device_is_named() -> None:
    reason = config.device_unavailable("tpu", 1, cuda_devices=0)
    assert reason is not None and "'tpu'" in reason


def test_world_size_4_only_for_cuda_with_4_gpus() -> None:
    assert config.checkpoint_world_sizes("cpu", cuda_devices=8) == [1, 2]
    assert config.checkpoint_world_sizes("cuda", cuda_devices=2) == [1, 2]
    assert config.checkpoint_world_sizes("cuda", cuda_devices=4) == [1, 2, 4]


def test_backend_follows_the_device() -> None:
    assert config.backend("cpu") == "gloo"
    assert config.backend("cuda") == "nccl"


def _tensors() -> list[torch.Tensor]:
    # Mixed dtypes and sizes, a 0-d and an empty one: each staged through a 64-byte buffer.
    return [torch.arange(6, dtype=torch.float32), torch.tensor(3.5, dtype=torch.float64),
            torch.arange(16, dtype=torch.int32).reshape(4, 4), torch.empty(0), torch.ones(3, dtype=torch.bfloat16)]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def test_to_host_hands_out_each_tensors_bytes_and_keeps_them_until_the_next() -> None:
    tensors = _tensors()
    staging = HostStaging(64, pin=False)
    stream = staging.to_host(tensors)
    seen: list[bytes] = []
    previous = None
    for k, view in enumerate(stream):
        assert bytes(view) == _bytes(tensors[k]), f"tensor #{k}"
        if previous is not None:
            # The copy of tensor k went to the other buffer: what k-1 handed out was not overwritten
            # before the caller asked for k.
            assert previous[1] == seen[-1]
        seen.append(bytes(view))
        previous = (view, bytes(view))
    assert seen == [_bytes(t) for t in tensors]


def test_to_host_alternates_buffers() -> None:
    staging = HostStaging(64, pin=False)
    pointers = []
    for k, _ in enumerate(staging.to_host(_tensors())):
        pointers.append(staging.buffers[k % 2].data_ptr())
    assert pointers[0] != pointers[1] and pointers[0] == pointers[2]


def test_from_host_fills_every_tensor_from_what_is_read() -> None:
    source = _tensors()
    dest = [torch.zeros_like(t) for t in source]
    asked: list[int] = []

    def read_into(k: int, view: memoryview) -> None:
        asked.append(k)
        view[:] = _bytes(source[k])

    HostStaging(64, pin=False).from_host(dest, read_into)
    assert asked == list(range(len(source)))
    for k, (s, d) in enumerate(zip(source, dest)):
        assert _bytes(s) == _bytes(d), f"tensor #{k}"


def test_a_tensor_larger_than_the_buffers_is_an_error() -> None:
    with pytest.raises(ValueError, match="tensor #0 has 400 bytes"):
        list(HostStaging(64, pin=False).to_host([torch.zeros(100)]))
