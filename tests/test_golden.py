"""The strategy against an independent plain-PyTorch FedRep loop: same seed, clients and batches."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.federation.api.epochs import epoch_settings
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, reference_clients, tiny_datamodule


def plain_fedrep(
    init, dm, rounds, per_round, head_epochs, body_epochs, seed, joint=False, keep_opt=False, excluded=()
):
    """Algorithm 1 written out: fresh SGD per client per round, frozen parts get no update. The
    ``(round, client)`` pairs in ``excluded`` do not take part in that round."""
    global_body = {k: v.clone() for k, v in init.state_dict().items() if k not in HEAD}
    heads = {}
    opt_states = {}
    for r in range(rounds):
        total, weight = None, 0.0
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            if (r, cid) in excluded:
                continue
            model = copy.deepcopy(init)
            state = dict(global_body)
            state.update(heads.get(cid, {k: init.state_dict()[k] for k in HEAD}))
            model.load_state_dict(state)
            opt = model.configure_optimizers()
            params = dict(model.named_parameters())
            for name, state in opt_states.get(cid, {}).items():  # kept: the head's state only
                opt.state[params[name]] = copy.deepcopy(state)
            per_epoch = math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            phases = (
                [("all", head_epochs * per_epoch)]
                if joint
                else [("head", head_epochs * per_epoch), ("body", body_epochs * per_epoch)]
            )
            batches = client_batches(dm, dm.seed, r, cid, sum(n for _, n in phases))
            for part, n in phases:
                for name, p in model.named_parameters():
                    p.requires_grad_(part == "all" or (name in HEAD) == (part == "head"))
                for _ in range(n):
                    x, y = next(batches)
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            if keep_opt:
                opt_states[cid] = {
                    n: copy.deepcopy(opt.state[params[n]]) for n in HEAD if params[n] in opt.state
                }
            heads[cid] = {k: v.clone() for k, v in model.state_dict().items() if k in HEAD}
            n_i = float(dm.client_num_samples(cid))
            body = {k: v.clone() for k, v in model.state_dict().items() if k not in HEAD}
            total = (
                {k: v * n_i for k, v in body.items()}
                if total is None
                else {k: total[k] + v * n_i for k, v in body.items()}
            )
            weight += n_i
        global_body = {k: v / weight for k, v in total.items()}
    return global_body, heads


@pytest.mark.parametrize(
    "algorithm,keep_opt",
    [("fedrep", False), ("fedrep", True), ("fedper", False)],
    ids=["fedrep", "fedrep-keep-optimizer", "fedper"],
)
def test_strategy_matches_plain_loop(algorithm, keep_opt):
    torch.manual_seed(0)
    init = TinyNet()
    dm = tiny_datamodule(num_clients=8, seed=3)
    dm.setup()
    rounds, per_round, seed = 4, 3, 11
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=per_round,
        **epoch_settings(algorithm, head_epochs=2, body_epochs=1, local_epochs=2),
        client_optimizer_state="keep" if keep_opt else "reset",
        seed=seed,
    )
    model = copy.deepcopy(init)
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(model, datamodule=dm)

    ref_body, ref_heads = plain_fedrep(
        init, dm, rounds, per_round, 2, 1, seed, joint=algorithm == "fedper", keep_opt=keep_opt
    )
    for name, value in ref_body.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert len(ref_heads) >= per_round
    for cid in range(dm.num_clients):
        got = strategy.client_state_dict(cid)
        expected = ref_heads.get(cid, {k: init.state_dict()[k] for k in HEAD})
        for name in HEAD:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def plain_joint(init, dm, rounds, per_round, epochs, seed, shared):
    """FedPer / LG-FedAvg / FedAvg / Local Only written out: every parameter trains jointly for
    ``epochs`` local epochs with a fresh SGD; the server averages the ``shared`` keys (by samples)
    and every client keeps the others."""
    start = init.state_dict()
    global_part = {k: v.clone() for k, v in start.items() if k in shared}
    local = {}
    for r in range(rounds):
        total, weight = {k: torch.zeros_like(v) for k, v in global_part.items()}, 0.0
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            model = copy.deepcopy(init)
            state = {k: v.clone() for k, v in start.items()}
            state.update(local.get(cid, {}))
            state.update(global_part)
            model.load_state_dict(state)
            opt = model.configure_optimizers()
            steps = epochs * math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            for x, y in client_batches(dm, dm.seed, r, cid, steps):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            trained = model.state_dict()
            local[cid] = {k: v.clone() for k, v in trained.items() if k not in shared}
            n_i = float(dm.client_num_samples(cid))
            for k in total:
                total[k] += trained[k] * n_i
            weight += n_i
        if global_part:
            global_part = {k: v / weight for k, v in total.items()}
    return global_part, local


@pytest.mark.parametrize("algorithm", ["lg_fedavg", "fedavg", "local"])
def test_joint_algorithms_match_plain_loop(algorithm):
    torch.manual_seed(0)
    init = TinyNet()
    dm = tiny_datamodule(num_clients=6, seed=3)
    dm.setup()
    rounds, per_round, seed = 3, 3, 5
    names = list(init.state_dict())
    shared = {
        "lg_fedavg": {n for n in names if n.startswith("classifier")},  # LG-FedAvg: the head part is global
        "fedavg": set(names),
        "local": set(),
    }[algorithm]
    strategy = FedRepStrategy(
        head="classifier", algorithm=algorithm, clients_per_round=per_round, local_epochs=2, seed=seed
    )
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(
        copy.deepcopy(init), datamodule=dm
    )
    ref_global, ref_local = plain_joint(init, dm, rounds, per_round, 2, seed, shared)
    for cid in range(dm.num_clients):
        got = strategy.client_state_dict(cid)
        expected = {k: v for k, v in init.state_dict().items()}
        expected.update(ref_local.get(cid, {}))
        expected.update(ref_global)
        for name in names:
            torch.testing.assert_close(
                got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"client {cid} {name}"
            )
    assert set(strategy.federation.store.local) == set(ref_local)
