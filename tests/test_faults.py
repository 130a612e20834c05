"""Faulty clients never poison the federation: a client whose step raises or whose tensors turn
non-finite is left out of its round (or stops the run, by policy), and the run equals a plain loop
that never had that client in that round."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fedrep import CHECKPOINT_KEY, FederatedDataModule, FedRepStrategy, RunSummary
from lightning_fedrep.federation import ClientFaultError, ClientFaultWarning
from tests.fixtures import HEAD, TinyNet, quiet_trainer, tiny_datamodule
from tests.test_golden import plain_fedrep


class FaultyNet(TinyNet):
    """TinyNet whose ``training_step`` misbehaves for chosen (round, client) pairs: ``"raise"`` raises
    at the client's second step, ``"nan"`` returns a NaN loss there."""

    fedrep_loss = "cross_entropy"

    def __init__(self, faults: dict[tuple[int, int], str] | None = None):
        super().__init__()
        self.faults = faults or {}
        self._steps: dict[tuple[int, int], int] = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        key = (self.trainer.current_epoch, self.trainer.strategy.current_client)
        kind = self.faults.get(key)
        # counts only where it injects: a step that writes nothing keeps the vectorized runner
        if kind is None:
            return loss
        self._steps[key] = self._steps.get(key, 0) + 1
        if self._steps[key] == 2:
            if kind == "raise":
                raise RuntimeError("injected failure")
            return loss * float("nan")
        return loss


class RaisingInRoundOne(FaultyNet):
    """Raises as round 1's 6th batch starts (before the step, so both engines meet it) while ``faults``."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.faults and self.trainer.current_epoch == 1 and batch_idx == 5:
            raise RuntimeError("injected failure")


def assert_same_run(model, strategy_, reference_model, reference) -> None:
    """Bit-equal module, clients and history (rounds 0 to 3) to the reference run's."""
    for name, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for cid in range(reference.federation.num_clients):
        for name, value in reference.client_tensors(cid).items():
            assert torch.equal(strategy_.client_tensors(cid)[name], value), (cid, name)
    assert strategy_.history == reference.history and [r["round"] for r in reference.history] == [0, 1, 2, 3]


def strategy(**kwargs):
    settings = dict(head="classifier", clients_per_round=1.0, head_epochs=2, body_epochs=1, seed=0)
    return FedRepStrategy(**{**settings, **kwargs})


def assert_federation_equals(strategy_, model, ref_body, ref_heads, init, clients):
    for name, value in ref_body.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for cid in range(clients):
        got = strategy_.client_state_dict(cid)
        expected = ref_heads.get(cid, {k: init.state_dict()[k] for k in HEAD})
        for name in HEAD:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"client {cid}")


def test_a_raising_and_a_nan_client_are_left_out_of_their_rounds_and_the_run_equals_a_plain_loop(tmp_path):
    """5 clients: client 3 raises in round 1, client 2 turns NaN in round 2 (on_client_error='skip'):
    the run completes, equals the plain loop without those clients in those rounds, and says so."""
    torch.manual_seed(0)
    init = FaultyNet()
    dm = tiny_datamodule(num_clients=5, seed=3)
    dm.setup()
    model = copy.deepcopy(init)
    model.faults = {(1, 3): "raise", (2, 2): "nan"}
    s = strategy(on_client_error="skip")
    with pytest.warns(ClientFaultWarning) as caught:
        summary = RunSummary(dirpath=str(tmp_path), print_table=False)
        quiet_trainer(strategy=s, max_epochs=4, limit_val_batches=0, callbacks=[summary]).fit(
            model, datamodule=dm
        )
    assert s.runner_report.runner == "sequential"  # a client's error needs its own steps
    ref_body, ref_heads = plain_fedrep(init, dm, 4, 1.0, 2, 1, 0, excluded={(1, 3), (2, 2)})
    assert_federation_equals(s, model, ref_body, ref_heads, init, 5)
    faults = [(f.round, f.client, f.step) for f in s.federation.faults]
    # the error at its 2nd step (1 done); the NaN found when the client finished, after all its steps
    assert faults == [(1, 3, 1), (2, 2, s.round_plan(2).steps_of(2))]
    assert "RuntimeError at local step 1: injected failure" in s.federation.faults[0].reason
    assert "non-finite values in" in s.federation.faults[1].reason
    messages = [str(w.message) for w in caught]
    assert any("Client 3 is left out of round 1" in m for m in messages)
    assert any("Client 2 is left out of round 2" in m for m in messages)
    assert s.federation.history.recorded(1) == {"faults": 1.0}
    assert s.federation.history.recorded(2) == {"faults": 1.0}
    assert s.federation.history.recorded(3) == {}
    listed = json.loads((tmp_path / "summary.json").read_text())["faults"]
    assert [(f["round"], f["client"]) for f in listed] == [(1, 3), (2, 2)]


def nan_client_data(nan_client: int):
    """Like ``tiny_datamodule(5 clients)``, client ``nan_client``'s first sample holding a NaN."""
    dm = tiny_datamodule(num_clients=5, seed=3)
    dm.setup()
    train = []
    for cid in range(5):
        data = dm.client_data(cid)
        x, y = (t[data.indices].clone() for t in data.dataset.tensors)
        if cid == nan_client:
            x[0, 0] = float("nan")
        train.append(TensorDataset(x, y))
    return FederatedDataModule.from_client_datasets(train, batch_size=dm.batch_size, seed=dm.seed), dm


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_client_with_nan_data_never_reaches_the_body(runner):
    """NaN in one client's data: on both engines that client is left out of every round (the others'
    lanes in lockstep stay finite) and the body equals the plain loop without it."""
    torch.manual_seed(0)
    init = FaultyNet()
    data, reference_dm = nan_client_data(nan_client=1)
    model = copy.deepcopy(init)
    s = strategy(runner=runner)
    with pytest.warns(ClientFaultWarning):
        quiet_trainer(strategy=s, max_epochs=3, limit_val_batches=0).fit(model, datamodule=data)
    assert s.runner_report.runner == runner
    excluded = {(r, 1) for r in range(3)}
    ref_body, ref_heads = plain_fedrep(init, reference_dm, 3, 1.0, 2, 1, 0, excluded=excluded)
    assert_federation_equals(s, model, ref_body, ref_heads, init, 5)
    assert [(f.round, f.client) for f in s.federation.faults] == sorted(excluded)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_a_round_in_which_every_client_fails_leaves_the_body_unchanged_and_says_so():
    torch.manual_seed(0)
    model = FaultyNet({(1, c): "nan" for c in range(5)})
    dm = tiny_datamodule(num_clients=5, seed=3)
    s = strategy(runner="sequential")  # the faults are injected in training_step
    bodies = []

    class Snapshot(__import__("lightning").Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            bodies.append({k: v.clone() for k, v in pl_module.state_dict().items() if k not in HEAD})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=s, max_epochs=3, limit_val_batches=0, callbacks=[Snapshot()]).fit(
            model, datamodule=dm
        )
    assert any(
        "Every client of round 1 was left out (5 faults): the global state is unchanged" in str(w.message)
        for w in caught
    )
    for name, value in bodies[0].items():
        assert torch.equal(bodies[1][name], value)
        assert not torch.equal(bodies[2][name], value)  # round 2 trains again
    assert s.federation.history.recorded(1) == {"faults": 5.0}


def test_the_raise_policies_stop_the_run_naming_the_client():
    dm = tiny_datamodule(num_clients=5, seed=3)
    with pytest.raises(
        ClientFaultError, match=r"Client 2 in round 0: non-finite values in .* \(on_nonfinite='raise'"
    ):
        quiet_trainer(
            strategy=strategy(on_nonfinite="raise", runner="sequential"), max_epochs=1, limit_val_batches=0
        ).fit(FaultyNet({(0, 2): "nan"}), datamodule=dm)
    with pytest.raises(RuntimeError, match="injected failure"):
        quiet_trainer(strategy=strategy(runner="sequential"), max_epochs=1, limit_val_batches=0).fit(
            FaultyNet({(0, 2): "raise"}), datamodule=dm
        )


def test_skipping_errors_keeps_the_engine_off_and_forcing_it_is_refused():
    dm = tiny_datamodule(num_clients=5, seed=3)
    with pytest.raises(
        ValueError, match="on_client_error='skip' leaves out the one client whose step raised"
    ):
        quiet_trainer(strategy=strategy(on_client_error="skip", runner="vectorized"), max_epochs=1).fit(
            FaultyNet(), datamodule=dm
        )
    with pytest.raises(ValueError, match="on_nonfinite must be 'skip' or 'raise'"):
        strategy(on_nonfinite="ignore")


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_run_stopped_by_an_error_rolls_the_round_back_and_its_exception_checkpoint_resumes_exactly(
    tmp_path, runner
):
    """The 6th step of round 1 raises (on_client_error='raise'; several clients have trained in the round
    by then): the run stops with the round rolled back in memory (every client holds what round 0
    left, the body is round 0's), Lightning's OnExceptionCheckpoint holds that state, and resuming it
    (the fault gone) gives the parameters and the history of a run that never had the fault."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    torch.manual_seed(0)
    init = RaisingInRoundOne()
    dm = tiny_datamodule(num_clients=5, seed=3)

    def trainer(rounds, **kwargs):
        return quiet_trainer(max_epochs=rounds, limit_val_batches=None, **kwargs)

    after_round_0 = strategy(runner=runner)
    trainer(1, strategy=after_round_0).fit(copy.deepcopy(init), datamodule=dm)

    faulty = copy.deepcopy(init)
    faulty.faults = {(-1, -1): "on_train_batch_start"}
    s = strategy(runner=runner)
    saver = OnExceptionCheckpoint(dirpath=str(tmp_path))
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer(4, strategy=s, callbacks=[saver], enable_checkpointing=True).fit(faulty, datamodule=dm)
    assert not s.federation.round_open and s.federation.round_index == 0
    for cid in range(5):  # rolled back: what round 0 left, for the clients stored in round 1 too
        for name, value in after_round_0.client_tensors(cid).items():
            assert torch.equal(s.client_tensors(cid)[name], value), (cid, name)
    for name, value in after_round_0.global_tensors().items():
        assert torch.equal(s.global_tensors()[name], value)

    resumed_model, resumed = copy.deepcopy(init), strategy(runner=runner)
    trainer(4, strategy=resumed).fit(
        resumed_model, datamodule=dm, ckpt_path=str(tmp_path / "on_exception.ckpt")
    )
    clean_model, clean = copy.deepcopy(init), strategy(runner=runner)
    trainer(4, strategy=clean).fit(clean_model, datamodule=dm)
    assert_same_run(resumed_model, resumed, clean_model, clean)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_run_resumed_mid_round_that_fails_in_that_round_rolls_back_to_the_rounds_start(tmp_path, runner):
    """A mid-round checkpoint holds what the open round may change as it was at the round's start, so a run
    resumed from it (at round 1's 3rd step) that fails later in round 1 rolls the whole round back, and its
    exception checkpoint resumes to the parameters and the history of a run that never failed."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    torch.manual_seed(0)
    init = RaisingInRoundOne()
    dm = tiny_datamodule(num_clients=5, seed=3)

    def fit(model, rounds=4, ckpt_path=None, callbacks=()):
        s = strategy(runner=runner)
        trainer = quiet_trainer(
            max_epochs=rounds,
            limit_val_batches=None,
            strategy=s,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        s.steps = trainer.global_step
        return s

    round_0_steps = fit(copy.deepcopy(init), rounds=1).steps  # Lightning steps: lockstep steps on the engine
    saver = ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(copy.deepcopy(init), rounds=2, callbacks=[saver])
    mid = tmp_path / "mid" / f"step={round_0_steps + 3}.ckpt"
    assert torch.load(mid, weights_only=True)[CHECKPOINT_KEY]["round"]["open"]

    faulty = copy.deepcopy(init)
    faulty.faults = {(-1, -1): "on_train_batch_start"}
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(faulty, ckpt_path=mid, callbacks=[OnExceptionCheckpoint(dirpath=str(tmp_path))])
    resumed_model = copy.deepcopy(init)
    resumed = fit(resumed_model, ckpt_path=str(tmp_path / "on_exception.ckpt"))
    clean_model = copy.deepcopy(init)
    clean = fit(clean_model)
    assert_same_run(resumed_model, resumed, clean_model, clean)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_non_finite_outputs_in_evaluation_are_reported_as_nan_for_their_clients(runner):
    """Client 1's test inputs hold a NaN: its accuracy is NaN (not argmax's class 0 counted as a guess),
    the other clients' are numbers, the summary over clients is NaN, and a warning names the client."""
    dm = tiny_datamodule(num_clients=5, seed=3)
    dm.setup()
    train, test = [], []
    for cid in range(5):
        for split, out in (("train", train), ("test", test)):
            data = dm.client_data(cid, split)
            x, y = (t[data.indices].clone() for t in data.dataset.tensors)
            if split == "test" and cid == 1:
                x[0, 0] = float("nan")
            out.append(TensorDataset(x, y))
    data = FederatedDataModule.from_client_datasets(train, test, batch_size=8)
    s = strategy(runner=runner)
    trainer = quiet_trainer(strategy=s, max_epochs=1)
    with pytest.warns(UserWarning, match=r"val: the model's outputs are not finite for clients \[1\]"):
        trainer.fit(FaultyNet(), datamodule=data)
    accuracy = s.client_metrics["val"].per_client("val/acc")
    assert accuracy[1] != accuracy[1]
    assert all(accuracy[c] == accuracy[c] for c in (0, 2, 3, 4))
    assert s.history[-1]["val/acc"] != s.history[-1]["val/acc"]


def test_a_minus_infinite_score_rules_its_class_out_while_nan_or_plus_infinity_leaves_no_class():
    """Per sample: -inf scores mask classes (the argmax over the rest counts; the cross-entropy of a masked true
    class is +inf); a NaN or +inf score, or -inf for every class, names no class (accuracy NaN)."""
    from lightning_fedrep.evaluation.metrics import headline_sums

    inf, nan = float("inf"), float("nan")
    output = torch.tensor([[-inf, 2.0, 1.0], [3.0, -inf, 1.0], [-inf, -inf, 0.0], [-inf, -inf, 0.0]])
    target = torch.tensor([1, 0, 2, 1])
    sums = headline_sums(output, target)
    assert (
        sums["acc"].item() == 3.0
    )  # samples 0-2 right (class 2 the only one left for sample 2), sample 3 wrong
    assert math.isinf(sums["loss"].item())  # sample 3's true class is masked
    for broken in ([nan, 1.0, 0.0], [inf, 1.0, 0.0], [-inf, -inf, -inf]):
        assert math.isnan(headline_sums(torch.tensor([broken]), torch.tensor([1]))["acc"].item())
