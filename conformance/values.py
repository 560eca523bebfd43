"""Value domains: the tensors a checkpoint must carry bit for bit, and targets that differ from them.

A round trip proves something only when (a) the values saved span what a narrow implementation
would get wrong (a float64 squeezed through float32, an int64 through a float, a NaN payload
canonicalised, ``-0.0`` turned into ``0.0``, a view saved with its whole storage or its offset lost)
and (b) the target it loads into starts out different in every one of those respects, so "loaded"
cannot be confused with "left as it was". :func:`edge_tensors` gives (a); :func:`different_like`
gives (b). Compare with :func:`conformance.asserts.assert_bitwise_equal`.
"""

from __future__ import annotations

import struct

import torch

__all__ = ["EDGE_DTYPES", "edge_values", "edge_tensors", "lazy_views", "different_like", "perturb_hyperparameters", "HYPERPARAMETER_EXTRAS"]

#: Every dtype a checkpoint of these models holds, floating first.
EDGE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)


def _nan_with_payload(dtype: torch.dtype, payload: int) -> torch.Tensor:
    """A quiet NaN of ``dtype`` whose mantissa carries ``payload`` (a loader that canonicalises NaNs,
    or routes values through another float type, loses it)."""
    width = torch.finfo(dtype).bits
    int_type = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    mantissa = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent_all_ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    quiet = 1 << (mantissa - 1)
    raw = exponent_all_ones | quiet | (payload % quiet or 1)
    if raw >= 1 << (width - 1):  # keep it a positive signed integer of the width
        raw -= 1 << width
    return torch.tensor([raw], dtype=int_type).view(dtype)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding the values a narrow implementation gets wrong."""
    if dtype == torch.bool:
        return torch.tensor([True, False, False, True, True])
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        plain = torch.tensor(
            [0.0, -0.0, 1.0, -1.5, info.max, info.min, info.tiny, info.eps, float("inf"), float("-inf")], dtype=dtype
        )
        extra = [plain, _nan_with_payload(dtype, 0x5), _nan_with_payload(dtype, 0x3)]
        if dtype == torch.float64:
            # values float32 cannot represent: precision (1 + 2**-40) and range (1e300, 1e-310 subnormal)
            extra.append(torch.tensor([1.0 + 2.0**-40, 1e300, -1e-310, struct.unpack("<d", struct.pack("<Q", 0x3FF0000000000001))[0]], dtype=dtype))
        if dtype == torch.float32:
            extra.append(torch.tensor([16777217.0, 1.0 + 2.0**-23, 1e-45], dtype=dtype))  # 2**24 + 1 rounds; a subnormal
        return torch.cat(extra)
    bounds = torch.iinfo(dtype)
    values = [0, 1, -1, bounds.max, bounds.min, bounds.max - 1]
    if dtype == torch.int64:
        values += [2**24 + 1, 2**53 + 1, -(2**53) - 3, 2**62 + 12345]  # not representable in float32 / float64
    return torch.tensor([v for v in values if bounds.min <= v <= bounds.max], dtype=dtype)


def edge_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Named tensors covering every dtype of :data:`EDGE_DTYPES` with its edge values, plus the shapes
    and memory layouts that break savers: 0-dim, 0-element, non-contiguous and offset views.

    ``seed`` mixes in seeded random values, so two seeds give different dicts with the same keys,
    dtypes and shapes (the target of a load is :func:`different_like` of the source, not another
    seed alone: edge values are the same for every seed)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for dtype in EDGE_DTYPES:
        name = str(dtype).removeprefix("torch.")
        edges = edge_values(dtype)
        if dtype == torch.bool:
            noise = torch.rand(7, generator=gen) > 0.5
        elif dtype.is_floating_point:
            noise = torch.randn(7, generator=gen, dtype=torch.float64).to(dtype)
        else:
            info = torch.iinfo(dtype)
            noise = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (7,), generator=gen, dtype=torch.int64).to(dtype)
        out[name] = torch.cat([edges, noise])
        out[f"{name}.scalar"] = noise[0].clone().reshape(())
    out["float32.empty"] = torch.empty(0, 3)
    out["int64.empty"] = torch.empty(2, 0, dtype=torch.int64)
    base = torch.randn(6, 9, generator=gen)
    out["float32.transposed"] = base.t()  # non-contiguous, the whole storage
    out["float32.strided"] = base[1:5:2, 2:8:3]  # non-contiguous with an offset into a larger storage
    out["float64.offset"] = torch.randn(20, generator=gen, dtype=torch.float64)[7:13]  # contiguous, storage offset 7
    return out


def lazy_views(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors whose values are a lazy view of their storage: a complex tensor with the conjugate bit
    (``.conj()``) and a real one with the negative bit (the imaginary part of a conjugate). A saver or
    loader that copies their raw storage, or rebuilds a record without its bits, gets the values of the
    unconjugated, unnegated storage: wrong signs, equal magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    complex_values = torch.randn(6, generator=gen, dtype=torch.complex64)
    return {
        "complex64": complex_values.clone(),
        "complex64.conj": complex_values.conj(),
        "float32.neg": torch.randn(5, generator=gen, dtype=torch.complex64).conj().imag,
    }


def different_like(value: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``value``'s dtype and shape whose every element differs from ``value``'s
    (bitwise), so a load that skipped it is visible. Not zeros, not the same seed: a function of the
    value itself."""
    plain = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if plain.dtype == torch.bool:
        return ~plain
    if plain.is_complex():
        return torch.view_as_complex(different_like(torch.view_as_real(plain)))
    if plain.is_floating_point():
        from conformance.asserts import bits  # bit-level: NaN payloads and -0.0 must differ too

        raw = bits(plain)
        return (raw ^ 1).view(plain.dtype)  # flip the lowest mantissa bit: a different value or NaN payload
    return plain ^ 1


#: Keys a param group may carry beyond an optimizer's defaults: a scheduler's, and a user's own.
HYPERPARAMETER_EXTRAS: tuple[str, ...] = ("initial_lr", "sdc_custom")


def perturb_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Give every param group of ``optimizer`` hyperparameters that differ from any a test saves:
    every numeric default changed (lr, betas, eps, weight_decay, momentum, ...), booleans flipped
    where flipping keeps the optimizer valid, and the extra keys of :data:`HYPERPARAMETER_EXTRAS`
    set to values no source uses. A load must overwrite all of them."""
    for index, group in enumerate(optimizer.param_groups):
        for key, value in list(group.items()):
            if key == "params" or isinstance(value, bool) or value is None:
                continue
            if isinstance(value, tuple) and all(isinstance(v, float) for v in value):
                group[key] = tuple(v * 0.5 + 0.01 * (index + 1) for v in value)
            elif isinstance(value, float):
                group[key] = value * 3.0 + 0.07 * (index + 1)
            elif isinstance(value, int):
                group[key] = value + 2 + index
        group["initial_lr"] = 9.5 + index
        group["sdc_custom"] = f"target-{index}"
