"""``first_state="average"`` against the official FedRep loop (``main_fedrep.py``) restated in plain PyTorch.

The official loop, written out: ``w_locals[user]`` starts as *aliases* of the global model's tensors, and
every round ``w_glob`` = the sample-weighted average over the round's clients of *every* key (heads, or
LG-FedAvg's local layers, included), loaded into the global model in place. So a client that has not
trained yet starts (and is evaluated) with the current global value of its local part; a client that
trained keeps its own. The shared part is loaded from the global model as usual.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, reference_clients, tiny_datamodule


def official_loop(init, dm, rounds, per_round, seed, algorithm, head_epochs, epochs):
    """``main_fedrep.py``'s rounds with fresh SGD per client; returns (global model state, trained clients)."""
    names = list(init.state_dict())
    local = set(HEAD) if algorithm == "fedrep" else {n for n in names if n not in HEAD}  # LG: HEAD is global
    net_glob = {k: v.clone() for k, v in init.state_dict().items()}
    w_locals: dict[int, dict] = {}
    for r in range(rounds):
        total, weight = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in net_glob.items()}, 0.0
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            state = dict(net_glob)  # an untrained client: aliases of the global model, every key
            state.update({k: v for k, v in w_locals.get(cid, {}).items() if k in local})
            model = copy.deepcopy(init)
            model.load_state_dict(state)
            opt = model.configure_optimizers()
            per_epoch = math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            if algorithm == "fedrep":
                phases = [("head", head_epochs * per_epoch), ("body", epochs * per_epoch)]
            else:
                phases = [("all", epochs * per_epoch)]
            batches = client_batches(dm, dm.seed, r, cid, sum(n for _, n in phases))
            for part, n in phases:
                for name, p in model.named_parameters():
                    p.requires_grad_(part == "all" or (name in HEAD) == (part == "head"))
                for _ in range(n):
                    x, y = next(batches)
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            w_locals[cid] = {k: v.clone() for k, v in model.state_dict().items()}
            n_i = float(dm.client_num_samples(cid))
            for k in total:
                total[k] += w_locals[cid][k].double() * n_i
            weight += n_i
        net_glob = {k: (v / weight).float() for k, v in total.items()}  # every key, heads included
    return net_glob, w_locals, local


@pytest.mark.parametrize("algorithm", ["fedrep", "lg_fedavg"])
def test_untrained_clients_start_from_the_averaged_local_part_as_the_official_loop(algorithm):
    """Catches: untrained clients reading the initial template (``first_state`` ignored), a template
    averaged over the shared part only or not updated each round, or an unweighted average: each
    client's model after 3 rounds (trained ones, which started from the average in their first round,
    and never-trained ones, which read it) equals the official loop's."""
    torch.manual_seed(0)
    init = TinyNet()
    dm = tiny_datamodule(num_clients=8, seed=3)
    dm.setup()
    rounds, per_round, seed = 3, 3, 11
    settings = {"head_epochs": 2, "body_epochs": 1} if algorithm == "fedrep" else {"local_epochs": 1}
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=per_round,
        first_state="average",
        seed=seed,
        **settings,
    )
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(
        copy.deepcopy(init), datamodule=dm
    )
    net_glob, w_locals, local = official_loop(init, dm, rounds, per_round, seed, algorithm, 2, 1)
    sampled = [set(reference_clients(8, per_round, seed, r)) for r in range(rounds)]
    assert sampled[1] - sampled[0], "some client must first train after round 0 (from the average)"
    assert set(range(8)) - set(w_locals), "some client must never train (it reads the average)"
    for cid in range(dm.num_clients):
        got = strategy.client_state_dict(cid)
        for name in init.state_dict():
            expected = w_locals[cid][name] if (cid in w_locals and name in local) else net_glob[name]
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6, msg=f"client {cid} {name}")


def test_initial_first_state_is_the_default_and_keeps_the_initial_head():
    """The default (``"initial"``): a never-trained client keeps the module's initial head."""
    torch.manual_seed(0)
    init = TinyNet()
    dm = tiny_datamodule(num_clients=8, seed=3)
    strategy = FedRepStrategy(head="classifier", clients_per_round=2, head_epochs=1, body_epochs=1, seed=1)
    assert strategy.config.first_state == "initial"
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(
        copy.deepcopy(init), datamodule=dm
    )
    untrained = next(c for c in range(8) if c not in strategy.federation.store.local)
    for name in HEAD:
        torch.testing.assert_close(strategy.client_state_dict(untrained)[name], init.state_dict()[name])


def test_unknown_first_state_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="first_state.*'initial', 'average'"):
        FedRepStrategy(head="classifier", first_state="global")


def _fit(root, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    strategy = FedRepStrategy(
        head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=5, first_state="average"
    )
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=4,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        default_root_dir=root,
        limit_val_batches=0,
    )
    trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=ckpt_path)
    return strategy


def test_average_first_state_resumes_bit_exactly_from_a_mid_round_checkpoint(tmp_path):
    """Catches: the round's running average of the local part not saved with a mid-round checkpoint
    (``local_average`` left out of the round state): the resumed run's average, hence the untrained
    clients' heads, would miss the clients trained before the checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    full = _fit(tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first = _fit(tmp_path / "a", callbacks=[saver])
    ends = set(torch.tensor([first.round_plan(r).length for r in range(4)]).cumsum(0).tolist())
    steps = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ck").glob("step=*.ckpt"))
    from lightning_fedrep import CHECKPOINT_KEY

    def finished(step: int) -> int:  # clients already added to the open round's average
        state = torch.load(tmp_path / "ck" / f"step={step}.ckpt", weights_only=True)[CHECKPOINT_KEY]
        return len(state["round"].get("finished", [])) if state["round"]["open"] else 0

    mid = [s for s in steps if s not in ends and s > min(ends) and finished(s) > 0]
    assert mid, steps
    resumed = _fit(
        tmp_path / "b", ckpt_path=tmp_path / "ck" / f"step={mid[-1]}.ckpt"
    )  # the last round: its average is the template
    for a, b in zip(full.federation.store.template, resumed.federation.store.template, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for cid in range(6):
        for name, value in full.client_state_dict(cid).items():
            torch.testing.assert_close(resumed.client_state_dict(cid)[name], value, rtol=0, atol=0)
