"""Byte views of CPU tensors' memory, without numpy.

torch does not require numpy (``Tensor.numpy()`` raises "Numpy is not available" without it), and a
fork validating its own torch build may have none, so the reference never calls it: the bytes a file
write or read, or a received frame, needs are a ``memoryview`` over the tensor's memory made with
``ctypes``. A view keeps its tensor alive (the ctypes array it exports holds a reference), so it stays
valid as long as it is used, like the buffer ``numpy()`` would have given. Nothing is copied.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["element_bytes", "storage_bytes"]


def _view(address: int, nbytes: int, owner: object) -> memoryview:
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    array._owner = owner  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(array).cast("B")


def element_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor``'s elements, in order, writable.

    Raises ValueError for any other tensor: a raw view of a strided or non-CPU tensor, or of bytes past
    its storage's end, would read or write memory that is not its elements."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or start + nbytes > storage.nbytes():
        raise ValueError(
            f"no raw byte view of a {tensor.device.type} tensor of shape {tuple(tensor.shape)}, stride {tensor.stride()}: "
            f"bytes [{start}, {start + nbytes}) of a storage of {storage.nbytes()}"
        )
    return _view(tensor.data_ptr(), nbytes, tensor)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU ``tensor``'s whole storage (what ``torch.save`` writes for it), writable."""
    if tensor.device.type != "cpu":
        raise ValueError(f"no raw byte view of a {tensor.device.type} tensor's storage")
    storage = tensor.untyped_storage()
    return _view(storage.data_ptr(), storage.nbytes(), storage)
