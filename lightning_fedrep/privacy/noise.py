"""Gaussian noise that is a pure function of a key: the same numbers on every runner, process and resume.

DP-SGD adds noise at every local step of every client. Drawn from a global generator, that noise would depend
on which runner trains (the vectorized runner draws for many clients at once, inside ``torch.func.vmap``,
where random calls are refused or batched differently), on the process and on whether the run was resumed.
Here each noise tensor is instead a function of a 64-bit key (the seed, the round, the client, its local
step and the tensor's name) and of the element's index: SplitMix64 (Steele, Lea and Flood 2014, the
generator Java's ``SplittableRandom`` uses) turns each ``key + (index + 1) * golden`` into 64 random bits,
two such words give two 53-bit uniforms, and the Box-Muller transform (computed in float64) turns them into
two standard normals. Tensor ops only, so it runs inside ``vmap`` with a batched key (one per client).

Like ``torch.randn`` (and Opacus without ``secure_mode``) this is a statistical generator, not a
cryptographically secure one, and the normals are floating-point numbers: the usual caveats of DP
implementations on floats apply (:doc:`/privacy` says so).
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 number with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """The logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(z: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 ``z`` (wrapping multiplication: the bits of the unsigned product)."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def splitmix_int(value: int) -> int:
    """SplitMix64's finalizer on a Python integer (exact, unsigned): what :func:`_splitmix` computes on tensors."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def name_key(name: str) -> int:
    """A stable integer for a tensor's name (its CRC-32), the last part of a noise key."""
    return zlib.crc32(name.encode())


def noise_key(seed: int, *parts: int | Tensor) -> Tensor:
    """The int64 key of one noise tensor: ``seed`` and ``parts`` (Python integers, or 0-dim integer tensors
    such as a step view's ``client``, batched under ``vmap``) folded one after another through SplitMix64.
    Different parts give unrelated keys."""
    key = splitmix_int(seed + _GOLDEN)
    tensor: Tensor | None = None
    for part in parts:
        if isinstance(part, Tensor):
            mixed = _splitmix(part.to(torch.int64) + _signed(_GOLDEN))
            current = torch.as_tensor(_signed(key), device=part.device) if tensor is None else tensor
            tensor = _splitmix(current ^ mixed)
        elif tensor is None:
            key = splitmix_int(key ^ splitmix_int(int(part) + _GOLDEN))
        else:
            tensor = _splitmix(tensor ^ _signed(splitmix_int(int(part) + _GOLDEN)))
    return torch.as_tensor(_signed(key)) if tensor is None else tensor


def keyed_normal(key: Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Standard normal noise of ``shape``, a pure function of ``key`` (an int64 0-dim tensor from
    ``noise_key``) and each element's position: computed in float64, returned as ``dtype``, on ``key``'s
    device. Runs inside ``torch.func.vmap`` with a batched ``key``."""
    numel = 1
    for size in shape:
        numel *= int(size)
    pairs = (numel + 1) // 2
    index = torch.arange(1, 2 * pairs + 1, device=key.device, dtype=torch.int64)
    bits = _splitmix(key + index * _signed(_GOLDEN))
    uniform = _shift_right(bits, 11).to(torch.float64) * 2.0**-53  # [0, 1), 53 bits
    first, second = uniform[0::2], uniform[1::2]
    radius = torch.sqrt(-2.0 * torch.log1p(-first))  # 1 - first in (0, 1]
    angle = (2.0 * torch.pi) * second
    normals = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=-1).reshape(-1)
    return normals[:numel].reshape(shape).to(dtype)
