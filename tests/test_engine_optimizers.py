"""One optimizer per client over stacked tensors equals ``torch.optim`` run on each client alone."""

import pytest
import torch

from lightning_fedrep.runners.lockstep.optimizers import StackedSGD, ViewOptimizers, client_optimizers

SGD_SETTINGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.5, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.001),
    dict(lr=0.05, momentum=0.5, maximize=True),
]


def run_both(make_optimizer, steps=9, clients=4):
    """Per client a real torch optimizer; the stacked version with some clients idle in some steps (every
    client steps in the first two and the last two: the first steps and the in-place update of clients
    that all have momentum)."""
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(clients, 3, 2, generator=g), "b": torch.randn(clients, 2, generator=g)}
    grads = [{n: torch.randn(t.shape, generator=g) for n, t in start.items()} for _ in range(steps)]
    active = [[s < 2 or s >= steps - 2 or (s + k) % 3 != 0 for k in range(clients)] for s in range(steps)]

    reference = []
    for k in range(clients):
        params = {n: t[k].clone().requires_grad_(True) for n, t in start.items()}
        optimizer = make_optimizer([params["w"], params["b"]])
        for s in range(steps):
            if active[s][k]:
                for n, p in params.items():
                    p.grad = grads[s][n][k].clone()
                optimizer.step()
        reference.append((params, optimizer))

    stacked = {n: t.clone() for n, t in start.items()}
    user = make_optimizer([torch.zeros(3, 2, requires_grad=True), torch.zeros(2, requires_grad=True)])
    optimizers = client_optimizers(stacked, user, ["w", "b"])
    for s in range(steps):
        leaves = {
            n: t.requires_grad_(False)[0:clients].detach().requires_grad_(True) for n, t in stacked.items()
        }
        for n, leaf in leaves.items():
            leaf.grad = grads[s][n].clone()
        optimizers.step(leaves, 0, active[s])
    return reference, stacked, optimizers


@pytest.mark.parametrize("settings", SGD_SETTINGS, ids=[str(s) for s in SGD_SETTINGS])
def test_stacked_sgd_equals_torch_sgd_per_client(settings):
    reference, stacked, optimizers = run_both(lambda params: torch.optim.SGD(params, **settings))
    assert isinstance(optimizers, StackedSGD)
    for k, (params, optimizer) in enumerate(reference):
        for n, p in params.items():
            torch.testing.assert_close(stacked[n][k], p.detach(), rtol=1e-6, atol=1e-7)
        state = optimizers.client_state(k, {"w", "b"})
        expected = {
            i: optimizer.state[p] for i, p in enumerate([params["w"], params["b"]]) if optimizer.state[p]
        }
        assert state.keys() == {i for i, e in expected.items() if e.get("momentum_buffer") is not None}
        for i, entries in state.items():
            torch.testing.assert_close(entries["momentum_buffer"], expected[i]["momentum_buffer"])


def test_adam_runs_on_per_client_views_and_equals_torch_adam():
    reference, stacked, optimizers = run_both(
        lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.01)
    )
    assert isinstance(optimizers, ViewOptimizers)
    for k, (params, _) in enumerate(reference):
        for n, p in params.items():
            torch.testing.assert_close(stacked[n][k], p.detach(), rtol=1e-6, atol=1e-7)


def test_kept_momentum_moves_between_clients_states():
    _, stacked, optimizers = run_both(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    state = optimizers.client_state(2, {"w", "b"})
    other = client_optimizers(
        {n: t.clone() for n, t in stacked.items()},
        torch.optim.SGD(
            [torch.zeros(3, 2, requires_grad=True), torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9
        ),
        ["w", "b"],
    )
    other.load_client_state(0, state)
    assert other.client_state(0, {"w", "b"}).keys() == state.keys()
    torch.testing.assert_close(
        other.client_state(0, {"w"})[0]["momentum_buffer"], state[0]["momentum_buffer"]
    )
    assert other.client_state(1, {"w", "b"}) == {}


def test_a_group_finds_each_client_whose_tensors_are_not_all_finite():
    """One NaN in one tensor of one client (and an infinity in another tensor of another) flags exactly
    those clients: every tensor counts for its client, the others stay finite (the per-client check the
    federation would do, done for the whole group at once)."""
    from lightning_fedrep.runners.lockstep.group import ClientGroup

    stacked = {"w": torch.zeros(4, 3, 2), "b": torch.zeros(4, 2), "steps": torch.zeros(4, dtype=torch.long)}
    stacked["w"][1, 2, 0] = float("nan")
    stacked["b"][3, 1] = float("inf")
    user = torch.optim.SGD(
        [torch.zeros(3, 2, requires_grad=True), torch.zeros(2, requires_grad=True)], lr=0.1
    )
    group = ClientGroup([10, 11, 12, 13], stacked, user, ["w", "b"], [None] * 4)
    expected = [all(bool(torch.isfinite(t[k]).all()) for t in stacked.values()) for k in range(4)]
    assert expected == [True, False, True, False]
    assert group.finite_clients() == expected
