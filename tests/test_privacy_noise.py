"""The keyed Gaussian noise of DP-SGD (``lightning_fedrep.privacy.noise``) against independent references: the
SplitMix64 finalizer computed exactly with Python integers, the standard normal distribution (moments and a
Kolmogorov-Smirnov test), and the unbatched call for the ``vmap``-batched one."""

from __future__ import annotations

import pytest
import torch

from lightning_fedrep.privacy.noise import (
    _signed,
    _splitmix,
    keyed_normal,
    name_key,
    noise_key,
    splitmix_int,
)


def reference_splitmix(value: int) -> int:
    """SplitMix64's finalizer as published (Steele, Lea, Flood 2014), unsigned 64-bit arithmetic."""
    mask = (1 << 64) - 1
    z = value & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & mask


VALUES = [0, 1, 2, 12345, 2**31 - 1, 2**32 + 7, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1]


def test_splitmix_on_tensors_equals_the_unsigned_reference():
    """The int64 tensor version (arithmetic shifts masked into logical ones, wrapping products) gives the bits of
    the unsigned reference, including values with the sign bit set; and SplitMix64 from seed 0 gives its known
    first output (0xE220A8397B1DCDAF, the stream's first number in the reference implementation)."""
    for value in VALUES:
        expected = reference_splitmix(value)
        assert splitmix_int(value) == expected
        assert _splitmix(torch.tensor([_signed(value)])).item() == _signed(expected)
    assert reference_splitmix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_keyed_normal_is_standard_normal():
    """200,000 draws: mean 0 and std 1 within 4 standard errors, and a Kolmogorov-Smirnov test that does not
    reject the standard normal at 1%."""
    stats = pytest.importorskip("scipy.stats")
    draws = keyed_normal(noise_key(7, 3, 11), (200_000,), torch.float64)
    assert abs(draws.mean().item()) < 4 / 200_000**0.5
    assert abs(draws.std().item() - 1.0) < 4 * (2 / 200_000) ** 0.5
    assert stats.kstest(draws.numpy(), "norm").pvalue > 0.01
    tail = (draws.abs() > 3).double().mean().item()  # P(|Z| > 3) = 0.0027
    assert 0.0020 < tail < 0.0035


def test_different_keys_give_independent_noise_and_the_same_key_the_same():
    """Keys differing in one part (the client, the step, the tensor's name) give uncorrelated draws; the same key
    gives the same numbers, whatever the shape's split (a pure function of the element's index)."""
    n = 100_000
    base = keyed_normal(noise_key(1, 2, torch.tensor(3), 4, name_key("w")), (n,), torch.float64)
    for key in (
        noise_key(1, 2, torch.tensor(4), 4, name_key("w")),
        noise_key(1, 2, torch.tensor(3), 5, name_key("w")),
        noise_key(1, 2, torch.tensor(3), 4, name_key("b")),
        noise_key(2, 2, torch.tensor(3), 4, name_key("w")),
    ):
        other = keyed_normal(key, (n,), torch.float64)
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1].item()) < 4 / n**0.5
    again = keyed_normal(noise_key(1, 2, torch.tensor(3), 4, name_key("w")), (250, 400), torch.float64)
    torch.testing.assert_close(again.reshape(-1), base, rtol=0, atol=0)


def test_a_batched_key_under_vmap_gives_each_clients_own_noise():
    """Inside ``torch.func.vmap`` over clients (the vectorized runner) each client's key and noise equal the
    unbatched call's: the runners draw the same numbers."""
    clients = torch.tensor([0, 5, 9])
    steps = torch.tensor([3, 0, 7])

    def draw(client, step):
        return keyed_normal(noise_key(4, 1, client, step, name_key("body.0.weight")), (6, 5), torch.float32)

    batched = torch.func.vmap(draw)(clients, steps)
    for row, (client, step) in enumerate(zip(clients, steps)):
        torch.testing.assert_close(batched[row], draw(client, int(step)), rtol=0, atol=0)
