"""``reference.host_bytes``: raw byte views of CPU tensors, and the reference without numpy.

A raw view that reached past a tensor's elements, or outlived its memory, would be memory corruption;
one over a strided or non-CPU tensor would read the wrong bytes. torch does not require numpy, so
nothing of the reference's may need it: the last test runs a save, a load and a long exchange in a
process where numpy cannot be imported."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reference.host_bytes import element_bytes, storage_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_element_bytes_are_exactly_the_elements_and_writable() -> None:
    storage = torch.arange(40, dtype=torch.int16)
    middle = storage[5:15]
    view = element_bytes(middle)
    assert bytes(view) == bytes(middle.view(torch.uint8).tolist())
    view[:2] = b"\xff\x7f"
    assert middle[0].item() == 0x7FFF and storage[4].item() == 4 and storage[15].item() == 15


def test_storage_bytes_are_the_whole_storage() -> None:
    storage = torch.arange(12, dtype=torch.float32)
    assert bytes(storage_bytes(storage[3:7])) == bytes(storage.view(torch.uint8).tolist())


@pytest.mark.parametrize("view_of", [element_bytes, storage_bytes])
def test_a_view_keeps_its_memory_alive(view_of: object) -> None:
    tensor = torch.full((1 << 16,), 7, dtype=torch.uint8)
    view = view_of(tensor)  # type: ignore[operator]
    del tensor
    gc.collect()
    churn = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(8)]  # would reuse freed memory
    assert bytes(view) == b"\x07" * (1 << 16)
    del churn


@pytest.mark.parametrize("view_of", [element_bytes, storage_bytes])
def test_an_empty_tensor_has_an_empty_view(view_of: object) -> None:
    assert bytes(view_of(torch.zeros(0))) == b""  # type: ignore[operator]


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(4, 4).t(), torch.zeros(8)[::2], torch.zeros(3, device="meta")],
    ids=["transposed", "strided", "meta"],
)
def test_element_bytes_refuses_what_is_not_one_contiguous_cpu_run(tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="no raw byte view"):
        element_bytes(tensor)


def test_storage_bytes_refuses_a_non_cpu_storage() -> None:
    with pytest.raises(ValueError, match="no raw byte view of a meta tensor's storage"):
        storage_bytes(torch.zeros(3, device="meta"))


def test_the_reference_saves_loads_and_exchanges_without_numpy(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["numpy"] = None  # as if numpy were not installed
        import torch
        import torch.distributed as dist
        try:
            torch.ones(1).numpy()
            raise SystemExit("numpy is importable: this test proves nothing")
        except RuntimeError:
            pass
        from reference import comm
        from reference.checkpoint import load, save

        directory = sys.argv[1]
        dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
        long = "x" * (3 * comm.FRAME_BYTES)  # past one frame: the rest travels after it
        assert comm.all_gather_objects(long, None) == [long]
        source = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16), "step": 3}
        save(source, checkpoint_id=f"{directory}/checkpoint")
        target = {"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 0}
        load(target, checkpoint_id=f"{directory}/checkpoint")
        assert torch.equal(target["w"], source["w"]) and torch.equal(target["b"], source["b"]), target
        assert target["step"] == 3, target
        dist.destroy_process_group()
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
