"""Aggregation as a named step with per-client results: an algorithm that chooses ``Stacked`` sees every
client's update (robust rules as user code) and every client left out (as a failure, never an update)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.nn import functional as F

from lightning_fedrep import FedRepStrategy
from lightning_fedrep.federation import ClientFaultWarning, ClientUpdate, Stacked
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.collective import Collective, to_cpu
from tests.fixtures import HEAD, TinyNet, client_batches, quiet_trainer, reference_clients, tiny_datamodule
from tests.test_faults import FaultyNet


class LossNet(TinyNet):
    """TinyNet declaring its pure loss, so that the vectorized runner can run it."""

    fedrep_loss = "cross_entropy"


class CoordinateMedian(Algorithm):
    """FedRep whose server takes the coordinate-wise median of the participants' bodies: user code on
    the public API (``aggregator`` keeps every update, ``aggregate`` reads them)."""

    def __init__(self) -> None:
        super().__init__("fedrep_median", {"body"}, "FedRep with a coordinate-wise median of the bodies")
        self.rounds: list[tuple[list[int], list[tuple[int, str]]]] = []
        """Per aggregated round: the clients whose updates arrived, and the failures (client, reason)."""

    epochs = ("head_epochs", "body_epochs")

    def default_phases(self, head_epochs: int, body_epochs: int) -> tuple[Phase, ...]:
        return (Phase("head", epochs=head_epochs), Phase("body", epochs=body_epochs))

    def aggregator(self, like):
        return Stacked(like)

    def aggregate(self, server, results, failures):
        self.rounds.append(([u.client for u in results.updates], [(f.client, f.reason) for f in failures]))
        rows = results.aggregator.stacked()
        return server.replace(shared={name: rows[name].median(dim=0).values for name in server.shared}), {}


def plain_median_fedrep(init, dm, rounds, per_round, head_epochs, body_epochs, seed):
    """Algorithm 1 with the server's mean replaced by the coordinate-wise median (an odd number of
    clients: the middle value of the sorted column), written out with a fresh SGD per client per round."""
    body = {k: v.clone() for k, v in init.state_dict().items() if k not in HEAD}
    heads = {}
    for r in range(rounds):
        bodies = []
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            model = copy.deepcopy(init)
            model.load_state_dict({**body, **heads.get(cid, {k: init.state_dict()[k] for k in HEAD})})
            opt = model.configure_optimizers()
            per_epoch = math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            phases = [("head", head_epochs * per_epoch), ("body", body_epochs * per_epoch)]
            batches = client_batches(dm, dm.seed, r, cid, sum(n for _, n in phases))
            for part, n in phases:
                for name, p in model.named_parameters():
                    p.requires_grad_((name in HEAD) == (part == "head"))
                for _ in range(n):
                    x, y = next(batches)
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            heads[cid] = {k: v.clone() for k, v in model.state_dict().items() if k in HEAD}
            bodies.append({k: v.clone() for k, v in model.state_dict().items() if k not in HEAD})
        middle = len(bodies) // 2
        body = {k: torch.stack([b[k] for b in bodies]).sort(dim=0).values[middle] for k in body}
    return body, heads


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_coordinate_wise_median_written_as_user_code_trains_like_a_plain_median_loop(runner):
    """3 of 8 clients per round, 3 rounds: the body is the coordinate-wise median of the participants'
    bodies, the heads as the plain loop's. Fails when the federation ignores ``Algorithm.aggregator()``
    (always ``WeightedMean``) or when ``Stacked.add`` keeps the client's views instead of copies (on the
    sequential path every row then holds the live module's last values)."""
    torch.manual_seed(0)
    init = LossNet()
    dm = tiny_datamodule(num_clients=8, seed=3)
    dm.setup()
    algorithm = CoordinateMedian()
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=3,
        head_epochs=1,
        body_epochs=1,
        seed=5,
        runner=runner,
    )
    model = copy.deepcopy(init)
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(model, datamodule=dm)

    body, heads = plain_median_fedrep(init, dm, 3, 3, 1, 1, 5)
    for name, value in body.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for cid, head in heads.items():
        for name in HEAD:
            torch.testing.assert_close(
                strategy.client_state_dict(cid)[name], head[name], rtol=1e-5, atol=1e-6
            )
    assert [clients for clients, _ in algorithm.rounds] == [reference_clients(8, 3, 5, r) for r in range(3)]


def test_a_non_finite_client_reaches_the_aggregator_as_a_failure_not_an_update():
    """Client 2 turns NaN in round 1 (``on_nonfinite="skip"``): the aggregator of round 1 gets the other
    clients' updates and one failure naming client 2 and why; the other rounds have no failure, and no
    round claims that every client was left out. Fails when ``close_round`` does not hand the faults to
    ``aggregate`` (``failures``), when a faulty client is added as an update, or when the "every client was left out"
    warning hangs on the ``first_state`` branch (as it did: it fired for any round with a fault)."""
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=4, seed=3)
    algorithm = CoordinateMedian()
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=1.0,
        head_epochs=1,
        body_epochs=1,
        seed=0,
        runner="sequential",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(
            FaultyNet({(1, 2): "nan"}), datamodule=dm
        )
    faults = [str(w.message) for w in caught if issubclass(w.category, ClientFaultWarning)]
    assert len(faults) == 1 and faults[0].startswith("Client 2 is left out of round 1"), faults
    assert [clients for clients, _ in algorithm.rounds] == [[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]]
    assert [len(failures) for _, failures in algorithm.rounds] == [0, 1, 0]
    ((client, reason),) = algorithm.rounds[1][1]
    assert client == 2 and reason.startswith("non-finite values in ")


class GatheringCollective(Collective):
    """Rank ``rank`` of a simulated 2-process group whose other rank sent ``others`` (by rank)."""

    def __init__(self, rank: int, sent: list):
        self._rank, self.sent = rank, sent

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self.sent)

    def all_gather_object(self, obj):
        return [obj if r == self._rank else other for r, other in enumerate(self.sent)]


def _update(client: int, value: float, weight: float) -> ClientUpdate:
    return ClientUpdate(
        client, 0, weight, int(weight), 3, {"w": torch.full((2,), value), "n": torch.tensor(client)}
    )


def test_stacked_gathers_every_ranks_updates_in_client_order_and_its_mean_is_the_weighted_mean():
    """Two ranks hold clients {3, 0} and {1}: after ``reduce`` both see the rows of clients 0, 1, 3 (in
    that order, whatever the rank or arrival order) and ``result`` is ``sum w_i x_i / sum w_i`` restated
    (integers rounded). Fails when ``reduce`` keeps only this rank's updates or orders rows by rank."""
    like = {"w": torch.zeros(2), "n": torch.tensor(0)}
    ranks = [Stacked(like), Stacked(like)]
    for rank, updates in enumerate([[_update(3, 4.0, 1.0), _update(0, 1.0, 2.0)], [_update(1, 2.0, 5.0)]]):
        for u in updates:
            ranks[rank].add(u)
    sent = [to_cpu(r._updates) for r in ranks]
    for rank, aggregator in enumerate(ranks):
        aggregator.reduce(GatheringCollective(rank, sent))
        assert [u.client for u in aggregator.updates] == [0, 1, 3]
        assert torch.equal(aggregator.stacked()["w"][:, 0], torch.tensor([1.0, 2.0, 4.0]))
        assert aggregator.weight == 8.0
        result = aggregator.result()
        assert torch.allclose(result["w"], torch.full((2,), (2 * 1.0 + 5 * 2.0 + 1 * 4.0) / 8))
        assert result["n"].dtype == torch.int64 and int(result["n"]) == round((2 * 0 + 5 * 1 + 1 * 3) / 8)


def test_stacked_refuses_a_round_larger_than_max_bytes_naming_both_numbers():
    """A round of 3 clients x 8 bytes against ``max_bytes=16``: refused, naming 24 bytes and the bound
    (fails when ``expect`` compares one client's bytes only)."""
    aggregator = Stacked({"w": torch.zeros(2)}, max_bytes=16)
    aggregator.expect(2)
    with pytest.raises(ValueError, match=r"3 clients x 8 bytes = 24 bytes, more than max_bytes=16"):
        aggregator.expect(3)


def test_a_median_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """``fedrep_median`` (``tests/scripts/algorithms_run.py``), 2 rounds, every client, uneven sizes: the
    body and every head on 2 processes equal (bit for bit) the 1-process run. Fails when
    ``Stacked.reduce`` keeps only this rank's updates (each rank takes the median of its own clients)."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch for this file and two others
    single = singles["fedrep_median"]
    for held in (rank["fedrep_median"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)


def _median_fit(root, **kwargs):
    strategy = FedRepStrategy(
        head="classifier",
        algorithm=CoordinateMedian(),
        clients_per_round=1.0,
        head_epochs=1,
        body_epochs=1,
        runner="sequential",  # clients finish one by one, so a checkpoint falls between them
    )
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=3, limit_val_batches=0, default_root_dir=root, **kwargs
    )
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=4, seed=1), ckpt_path=ckpt_path)
    return strategy


def test_a_mid_round_checkpoint_keeps_the_stacked_updates_and_resumes_bit_exactly(tmp_path):
    """A run resumed from a checkpoint taken after some clients of a round finished equals the
    uninterrupted run (body and heads, bit for bit). Fails when the open round's aggregator state is
    not saved (``Stacked.state_dict`` returning no updates): the resumed median misses those clients."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fedrep import CHECKPOINT_KEY

    torch.manual_seed(0)
    full = _median_fit(tmp_path / "full")
    torch.manual_seed(0)
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _median_fit(tmp_path / "a", callbacks=[saver], enable_checkpointing=True)

    def finished(path) -> int:  # clients already handed to the open round's aggregator
        state = torch.load(path, weights_only=True)[CHECKPOINT_KEY]["round"]
        return len(state.get("finished", [])) if state["open"] else 0

    mid = [p for p in sorted((tmp_path / "ck").glob("step=*.ckpt")) if finished(p) > 0]
    assert mid
    resumed = _median_fit(tmp_path / "b", ckpt_path=mid[-1])
    for name, value in full.global_tensors().items():
        assert torch.equal(resumed.global_tensors()[name], value), name
    for cid in range(4):
        for name, value in full.client_state_dict(cid).items():
            assert torch.equal(resumed.client_state_dict(cid)[name], value), (cid, name)


def test_the_default_server_step_is_the_float64_weighted_mean_cast_back_bit_for_bit():
    """``Algorithm.aggregate``'s default on a ``WeightedMean``'s results: the shared tensors become
    ``sum_i w_i x_i / sum_i w_i`` summed in float64 and cast to each tensor's dtype (integers rounded), equal
    bit for bit to that sum written out here; the server tensors stay and no metric is reported. Fails when
    the default sums in the tensors' own dtype (float32 rounding), forgets to round integer tensors, or drops
    a server tensor."""
    from lightning_fedrep.federation import WeightedMean
    from lightning_fedrep.federation.api.exchange import RoundResults, ServerState

    torch.manual_seed(0)
    like = {"w": torch.randn(5), "h": torch.randn(2, 3).to(torch.float16), "n": torch.tensor(0)}
    clients = [(torch.randn(5), torch.randn(2, 3).to(torch.float16), torch.tensor(c + 3)) for c in range(3)]
    weights = [7.0, 1.0, 30.0]
    aggregator = WeightedMean(like)
    for c, ((w, h, n), weight) in enumerate(zip(clients, weights)):
        aggregator.add(ClientUpdate(c, 0, weight, int(weight), 2, {"w": w, "h": h, "n": n}))
    server = ServerState(like, {"momentum": torch.ones(3)}, num_clients=3)
    results = RoundResults(aggregator.result(), aggregator, (0, 1, 2), aggregator.weight, None)
    new, metrics = Algorithm("mean", {"body"}, "the default").aggregate(server, results, ())
    assert metrics == {} and torch.equal(new.tensors["momentum"], torch.ones(3))
    for index, (name, ref) in enumerate(like.items()):
        total = torch.zeros(ref.shape, dtype=torch.float64)
        for values, weight in zip(clients, weights):
            total += values[index].to(torch.float64) * weight
        expected = total / sum(weights)
        expected = (expected if ref.is_floating_point() else expected.round()).to(ref.dtype)
        assert new.shared[name].dtype == ref.dtype and torch.equal(new.shared[name], expected), name
