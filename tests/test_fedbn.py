"""FedBN (``lightning_fedrep.federation.algorithms.fedbn``) against a plain PyTorch loop: FedAvg whose BatchNorm
layers (affine parameters and running statistics) stay on each client; what evaluation scores; the layers found
by type or by a name pattern; the runners; and ``Algorithm.keep_local``, the mechanism it is written on."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import Algorithm, FedBN, FederatedStrategy
from lightning_fedrep.federation.module.split import resolve_layout
from tests.fixtures import TinyNet, client_batches, quiet_trainer, reference_clients, tiny_datamodule
from tests.test_claims import BatchNormTinyNet, unequal_datamodule

ROUNDS, PER_ROUND, SEED, LOCAL_EPOCHS = 3, 3, 5, 2
BN = {
    "body.1.weight",
    "body.1.bias",
    "body.1.running_mean",
    "body.1.running_var",
    "body.1.num_batches_tracked",
}


def plain_fedbn(init, dm, weighting="samples", local=BN):
    """FedBN written out: each round's clients (``reference_clients``) load the global tensors and their own
    ``local`` tensors (the module's initial ones before they first train), train everything for
    ``LOCAL_EPOCHS`` epochs with the module's optimizer (momentum, weight decay) in train mode, keep their
    ``local`` tensors, and the server takes the weighted float64 mean of every other tensor. Returns the global
    tensors and each client's own ones."""
    start = init.state_dict()
    global_state = {k: v.clone() for k, v in start.items() if k not in local}
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(ROUNDS):
        trained, weights = [], []
        for cid in reference_clients(dm.num_clients, PER_ROUND, SEED, r):
            model = copy.deepcopy(init)
            model.load_state_dict({**start, **clients.get(cid, {}), **global_state})
            model.train()
            optimizer = model.configure_optimizers()
            steps = LOCAL_EPOCHS * math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            for x, y in client_batches(dm, dm.seed, r, cid, steps):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            after = {k: v.detach().clone() for k, v in model.state_dict().items()}
            clients[cid] = {k: v for k, v in after.items() if k in local}
            trained.append(after)
            weights.append(float(dm.client_num_samples(cid)) if weighting == "samples" else 1.0)
        for k, ref in global_state.items():
            mean = sum(w * s[k].double() for w, s in zip(weights, trained)) / sum(weights)
            global_state[k] = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
    return global_state, clients


def fit(algorithm, model, dm, runner="sequential", **settings):
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
        **settings,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    return strategy, trainer


def test_fedbn_equals_a_plain_loop_and_keeps_batch_norm_per_client():
    """Golden test (sequential runner). The global tensors are the plain loop's mean of everything but the
    BatchNorm layer, which is not in them; every client's BatchNorm parameters and running statistics are its
    own plain-loop values (the initial ones for a client that never trained). Fails if ``FedBN.keep_local``
    misses the running statistics (``named_buffers`` left out: they would be averaged) or the affine
    parameters, or if the layer is found under another name."""
    torch.manual_seed(0)
    init, dm = BatchNormTinyNet(), unequal_datamodule()
    strategy, _ = fit(FedBN(), copy.deepcopy(init), dm)
    assert set(strategy.federation.layout.local) == BN
    expected, clients = plain_fedbn(init, dm)
    got = strategy.global_tensors()
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    initial = {k: v for k, v in init.state_dict().items() if k in BN}
    for cid in range(dm.num_clients):
        own = {**initial, **clients.get(cid, {})}
        state = strategy.client_state_dict(cid)
        for name, value in {**own, **expected}.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=(cid, name))
    fedavg, _ = plain_fedbn(init, dm, local=set())  # BatchNorm averaged too: another model here
    assert max(float((fedavg[k] - expected[k]).abs().max()) for k in expected) > 1e-3
    means = [clients[c]["body.1.running_mean"] for c in clients]
    assert min(float((a - b).abs().max()) for i, a in enumerate(means) for b in means[i + 1 :]) > 1e-3


def test_evaluation_scores_global_tensors_with_each_clients_batch_norm():
    """``trainer.test`` scores, for every client, the global non-BatchNorm tensors with its own BatchNorm layer
    in eval mode (its running statistics): the mean over clients of plain PyTorch's accuracy and loss. Fails if
    evaluation used the initial BatchNorm layer or another client's."""
    torch.manual_seed(0)
    init, dm = BatchNormTinyNet(), unequal_datamodule()
    model = copy.deepcopy(init)
    strategy, trainer = fit(FedBN(), model, dm, weighting="uniform")
    expected, clients = plain_fedbn(init, dm, weighting="uniform")
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    accuracy, loss = [], []
    for cid in range(dm.num_clients):
        net = copy.deepcopy(init).eval()
        net.load_state_dict({**init.state_dict(), **clients.get(cid, {}), **expected})
        data = dm.client_data(cid, "test")
        x, y = (t[data.indices] for t in data.dataset.tensors)
        with torch.no_grad():
            out = net(x)
        accuracy.append((out.argmax(1) == y).double().mean().item())
        loss.append(F.cross_entropy(out, y).item())
    assert abs(metrics["test/acc"] - sum(accuracy) / len(accuracy)) < 1e-6
    assert abs(metrics["test/loss"] - sum(loss) / len(loss)) < 1e-4 * max(1.0, abs(metrics["test/loss"]))


class NamedNormNet(TinyNet):
    """Two BatchNorm layers, one called ``bn1`` and one not (a ResNet's ``downsample.1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(6)
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU()
        )

    def forward(self, x):
        return self.classifier(self.body(self.bn1(x)))


def test_layers_by_type_or_by_pfllib_name_pattern():
    """By default every BatchNorm module is local, whatever its name; ``pattern="bn"`` (the authors' and
    PFLlib's ``'bn' in name``) keeps only the tensors so named, sharing ``body.1``."""
    module = NamedNormNet()
    by_type = resolve_layout(
        module,
        None,
        shares=frozenset({"body", "head"}),
        needs_head=False,
        keep_local=FedBN().keep_local(module),
    )
    bn1 = {f"bn1.{n}" for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    assert set(by_type.local) == BN | bn1
    by_name = resolve_layout(
        module,
        None,
        shares=frozenset({"body", "head"}),
        needs_head=False,
        keep_local=FedBN(pattern="bn").keep_local(module),
    )
    assert set(by_name.local) == bn1 and BN <= set(by_name.shared)
    pfllib = resolve_layout(
        module,
        None,
        shares=frozenset({"body", "head"}),
        needs_head=False,
        buffers="local",
        keep_local=FedBN(pattern="bn").keep_local(module),
    )  # PFLlib: every buffer local
    assert set(pfllib.local) == bn1 | {n for n in BN if "running" in n or "num_batches" in n}


def test_the_vectorized_runner_refuses_batch_norm_and_auto_says_why():
    """The lockstep runner does not run BatchNorm in train mode: ``runner="vectorized"`` is refused naming the
    layer, ``runner="auto"`` runs sequentially and its report says why."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"batch norm in train mode \('body.1'"):
        fit(FedBN(), BatchNormTinyNet(), unequal_datamodule(), runner="vectorized")
    strategy, _ = fit(FedBN(), BatchNormTinyNet(), unequal_datamodule(), runner="auto")
    report = strategy.runner_report
    assert report.runner == "sequential" and "batch norm in train mode ('body.1'" in report.reason, report


def test_by_name_and_without_batch_norm():
    """``Trainer(strategy="fedbn")`` runs ``FedBN()``; on a module without BatchNorm it warns that it is FedAvg
    (everything shared)."""
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy="fedbn", max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="FedBN: TinyNet has no BatchNorm module, so FedBN is FedAvg"):
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=10))
    assert isinstance(trainer.strategy.algorithm, FedBN) and trainer.strategy.federation.layout.local == ()
    assert "fedbn_ddp" in __import__("lightning").pytorch.strategies.StrategyRegistry


@pytest.mark.parametrize("pattern, error", [("", TypeError), (3, TypeError), ("bn(", ValueError)])
def test_bad_pattern_is_refused(pattern, error):
    with pytest.raises(error, match=r"FedBN\(pattern="):
        FedBN(pattern=pattern)


class KeepsUnknown(Algorithm):
    def keep_local(self, module):
        return ["body.9.weight"]


def test_keep_local_naming_no_tensor_is_refused_at_setup():
    """``Algorithm.keep_local`` returning a name that is no parameter or buffer: a ``ValueError`` naming the
    algorithm, the name and real names, before any step."""
    with pytest.raises(ValueError, match=r"KeepsUnknown.keep_local named \['body.9.weight'\].*body.0.weight"):
        fit(KeepsUnknown("keeps_unknown", {"body", "head"}, "x"), TinyNet(), unequal_datamodule())


def test_a_run_resumed_mid_round_keeps_every_clients_batch_norm(tmp_path):
    """Resumed from a mid-round checkpoint, FedBN ends with the uninterrupted run's global tensors and every
    client's BatchNorm layer, bit for bit (the kept-local tensors are saved and restored with the client)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_resume import assert_same_federation

    def run(root, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        strategy = FederatedStrategy(
            algorithm=FedBN(), clients_per_round=PER_ROUND, seed=SEED, local_epochs=1
        )
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=ROUNDS,
            limit_val_batches=0,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            default_root_dir=root,
        )
        trainer.fit(BatchNormTinyNet(), datamodule=unequal_datamodule(), ckpt_path=ckpt_path)
        return strategy

    full = run(tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    first = run(tmp_path / "a", callbacks=[saver])
    ends = set(torch.tensor([first.round_plan(r).length for r in range(ROUNDS)]).cumsum(0).tolist())
    steps = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ck").glob("step=*.ckpt"))
    mid = [s for s in steps if s not in ends and s > first.round_plan(0).length]
    assert mid, (steps, ends)
    resumed = run(tmp_path / "b", ckpt_path=tmp_path / "ck" / f"step={mid[0]}.ckpt")
    assert set(resumed.federation.layout.local) == BN
    assert_same_federation(full, resumed)


def test_fedbn_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedBN (``tests/scripts/algorithms_run.py``, its ``NormNet``), 2 rounds, every client: the global tensors,
    every client's BatchNorm layer and the validation accuracy on 2 processes equal the 1-process run bit for
    bit. Fails when a client's kept-local tensors do not travel with it between processes."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedbn"]
    assert not any("norm.1" in name for name in single["global"])  # kept local
    assert any("norm.1.running_mean" in name for name in single["clients"][0])
    for held in (rank["fedbn"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
