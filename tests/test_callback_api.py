"""The callback and algorithm API: composable round plans, events, recorded columns, a new algorithm
without touching the strategy, one personalized-model path, and callbacks that use only the
documented surface."""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.nn import functional as F

from lightning_fedrep import (
    Algorithm,
    FederatedCallback,
    FederatedStrategy,
    Federation,
    HeadFineTuning,
    LossTerm,
    Objective,
    personalized_state_dict,
)
from lightning_fedrep.callbacks.participation import AdaptiveParticipation, FixedExponential
from tests.fixtures import (
    MarkedTinyNet,
    TinyNet,
    client_batches,
    quiet_trainer,
    reference_clients,
    tiny_datamodule,
)

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fedrep"


class KeepEven(FederatedCallback):
    """Keeps the even-numbered clients of a federated round."""

    def configure_round(self, trainer, plan):
        return plan.replace(clients=[c for c in plan.spec.clients if c % 2 == 0]) if plan.federated else plan


class FirstTwo(FederatedCallback):
    """Keeps the first two clients of whatever it is given."""

    def configure_round(self, trainer, plan):
        return plan.replace(clients=plan.spec.clients[:2]) if plan.federated else plan


class Trained(FederatedCallback):
    def __init__(self):
        self.clients: dict[int, list[int]] = {}

    def on_client_start(self, trainer, pl_module, client):
        self.clients.setdefault(trainer.current_epoch, []).append(client)


def test_two_callbacks_that_change_the_plan_compose_in_callback_order():
    pools = {r: reference_clients(8, 6, 3, r) for r in range(3)}
    for order, expected in (
        ("even-then-two", {r: [c for c in p if c % 2 == 0][:2] for r, p in pools.items()}),
        ("two-then-even", {r: [c for c in p[:2] if c % 2 == 0] for r, p in pools.items()}),
    ):
        trained = Trained()
        callbacks = [KeepEven(), FirstTwo()] if order == "even-then-two" else [FirstTwo(), KeepEven()]
        strategy = FederatedStrategy(head="classifier", clients_per_round=6, head_epochs=1, seed=3)
        trainer = quiet_trainer(
            strategy=strategy, max_epochs=3, limit_val_batches=0, callbacks=[*callbacks, trained]
        )
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())
        expected = {r: c for r, c in expected.items() if c}
        assert {r: strategy.round_plan(r).clients for r in expected} == expected, order
        assert trained.clients == expected, order


def test_participation_and_fine_tuning_compose():
    """SRPFL narrows the federated rounds; the fine-tuning round still takes every client, whichever
    callback comes first."""
    for first_participation in (True, False):
        participation = AdaptiveParticipation(2, 1, latency=FixedExponential(seed=4), measure=False)
        finetune = HeadFineTuning(epochs=1)
        trained = Trained()
        callbacks = [participation, finetune] if first_participation else [finetune, participation]
        strategy = FederatedStrategy(head="classifier", clients_per_round=1.0, head_epochs=1, seed=0)
        trainer = quiet_trainer(
            strategy=strategy, max_epochs=2, limit_val_batches=0, callbacks=[*callbacks, trained]
        )
        trainer.fit(TinyNet(), datamodule=tiny_datamodule())
        assert [len(trained.clients[r]) for r in range(3)] == [2, 4, 8]
        assert (
            trained.clients[0] == participation.decisions[0]
            and trained.clients[1] == participation.decisions[1]
        )
        assert not strategy.round_plan(2).federated and strategy.round_plan(2).prefix == "finetune/"


class Events(FederatedCallback, Callback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_round_start(self, trainer, pl_module, plan):
        self.events.append(("round_start", plan.round, tuple(plan.clients)))

    def on_client_start(self, trainer, pl_module, client):
        assert trainer.strategy.current_client == client
        self.events.append(("client_start", client))

    def on_client_end(self, trainer, pl_module, result):
        assert trainer.strategy.current_client is None
        self.events.append(("client_end", result.client, result.steps))

    def on_round_end(self, trainer, pl_module, result):
        self.events.append(
            ("round_end", result.round, result.aggregated, tuple(c.client for c in result.clients))
        )
        self.record(trainer, **{"events/clients": float(len(result.clients))})

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.events.append(("validation",))


def test_events_come_in_order_with_each_clients_steps_and_record_adds_history_columns():
    events = Events()
    strategy = FederatedStrategy(head="classifier", clients_per_round=3, head_epochs=1, body_epochs=1, seed=2)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, callbacks=[events])
    trainer.fit(TinyNet(), datamodule=tiny_datamodule())
    expected = []
    for r in range(2):
        plan = strategy.round_plan(r)
        expected.append(("round_start", r, tuple(plan.clients)))
        for work in plan.work:
            expected += [("client_start", work.client), ("client_end", work.client, work.steps)]
        expected += [("round_end", r, True, tuple(plan.clients)), ("validation",)]
    assert events.events == expected
    assert [h["events/clients"] for h in strategy.history] == [3.0, 3.0]
    assert strategy.results()["final"]["events/clients"] == 3.0
    assert "events/clients" not in strategy.results()["last10"]  # recorded columns are not averaged


class FedProx(Algorithm):
    """FedProx (Li et al., 2020): FedAvg whose local loss adds (mu/2) ||w - w_global||^2."""

    def __init__(self, mu: float):
        super().__init__("fedprox", {"body", "head"}, "FedProx: FedAvg with a proximal term")
        self.mu = mu

    def objective(self, phase):
        def proximal(view):
            return self.mu / 2 * sum((w - view.server[n]).pow(2).sum() for n, w in view.trained.items())

        return Objective(terms=(LossTerm(proximal, "proximal term"),))


def plain_fedprox(init, dm, rounds, per_round, seed, mu):
    global_state = {k: v.clone() for k, v in init.state_dict().items()}
    for r in range(rounds):
        total, weight = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}, 0.0
        for cid in reference_clients(dm.num_clients, per_round, seed, r):
            model = copy.deepcopy(init)
            model.load_state_dict(global_state)
            opt = model.configure_optimizers()
            steps = math.ceil(dm.client_num_samples(cid) / dm.batch_size)
            for x, y in client_batches(dm, dm.seed, r, cid, steps):
                opt.zero_grad()
                prox = sum((p - global_state[n]).pow(2).sum() for n, p in model.named_parameters())
                (F.cross_entropy(model(x), y) + mu / 2 * prox).backward()
                opt.step()
            n_i = float(dm.client_num_samples(cid))
            for k, v in model.state_dict().items():
                total[k] += v.double() * n_i
            weight += n_i
        global_state = {k: (v / weight).float() for k, v in total.items()}
    return global_state


def test_a_new_algorithm_with_a_loss_term_runs_without_touching_the_strategy():
    torch.manual_seed(0)
    init = TinyNet()
    dm = tiny_datamodule(num_clients=6, seed=3)
    dm.setup()
    strategy = FederatedStrategy(algorithm=FedProx(mu=0.5), clients_per_round=3, seed=4)
    model = copy.deepcopy(init)
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(model, datamodule=dm)
    expected = plain_fedprox(init, dm, 3, 3, 4, mu=0.5)
    without_prox = plain_fedprox(init, dm, 3, 3, 4, mu=0.0)
    for name, value in expected.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(expected[k], without_prox[k], atol=1e-4) for k in expected)


@pytest.mark.parametrize("mode", ["head", "full"])
def test_live_and_checkpoint_personalized_models_agree_after_fine_tuning(tmp_path, mode):
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    strategy = FederatedStrategy(algorithm="fedavg", head="classifier", clients_per_round=4, seed=1)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[HeadFineTuning(epochs=1, mode=mode), saver],
    )
    trainer.fit(MarkedTinyNet(), datamodule=tiny_datamodule())
    global_weight = strategy.global_tensors()["body.0.weight"]
    for client in range(strategy.num_clients):
        live = strategy.client_state_dict(client)
        exported = personalized_state_dict(saver.last_model_path, client)
        assert live.keys() == exported.keys()
        for name in live:
            torch.testing.assert_close(exported[name], live[name], rtol=0, atol=0)
        assert torch.equal(live["body.0.weight"], global_weight) == (mode == "head")


# ------------------------------------------------------------------------------------------ lint
DOCUMENTED_ATTRIBUTES = {
    "FederatedStrategy": {"client_metrics", "algorithm", "federation", "config"},
    "Federation": {"history", "algorithm", "layout", "config", "round_index", "round_open", "live_phase"},
}


def _public_documented(cls: type, name: str) -> bool:
    if name.startswith("_"):
        return False
    if name in DOCUMENTED_ATTRIBUTES[cls.__name__]:
        return True
    member = getattr(cls, name, None)
    return member is not None and bool(getattr(member, "__doc__", None))


def _callback_sources() -> list[Path]:
    return sorted((PACKAGE / "callbacks").glob("*.py")) + sorted((PACKAGE / "participation").glob("*.py"))


def api_problems(source: str, filename: str) -> list[str]:
    """Private reads of other objects, direct ``trainer.strategy`` access, and strategy/federation
    members that are not public and documented, in one callback module's source."""
    problems = []
    tree = ast.parse(source)
    for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        handles: dict[str, type] = {}
        own = {"self", "cls", "callback"}  # the callback itself (``callback``: its closures, copies of it)
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                copies_self = (
                    ast.unparse(func) in ("copy.copy", "copy.deepcopy")
                    and ast.unparse(node.value.args[0]) == "self"
                )
                own |= {t.id for t in node.targets if isinstance(t, ast.Name) and copies_self}
                if isinstance(func, ast.Attribute) and func.attr in ("strategy", "federation"):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            handles[target.id] = FederatedStrategy if func.attr == "strategy" else Federation
        for node in ast.walk(function):
            if not isinstance(node, ast.Attribute):
                continue
            owner, where = node.value, f"{filename}:{node.lineno}"
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(owner, ast.Name) and owner.id in own):
                    problems.append(f"{where} reads private .{node.attr}")
            if node.attr == "strategy" and isinstance(owner, ast.Name) and owner.id == "trainer":
                problems.append(f"{where} reaches trainer.strategy (use self.strategy(trainer))")
            cls = None
            if isinstance(owner, ast.Name) and owner.id in handles:
                cls = handles[owner.id]
            elif isinstance(owner, ast.Call) and isinstance(owner.func, ast.Attribute):
                cls = {"strategy": FederatedStrategy, "federation": Federation}.get(owner.func.attr)
            if cls is not None and not _public_documented(cls, node.attr):
                problems.append(f"{where} uses {cls.__name__}.{node.attr}, not public and documented")
    return sorted(set(problems))


def test_callbacks_touch_only_public_documented_attributes():
    """No callback reads a private attribute of another object, reaches ``trainer.strategy`` directly, or
    uses a strategy/federation member that is not public and documented."""
    problems = [p for path in _callback_sources() for p in api_problems(path.read_text(), path.name)]
    assert not problems, "\n".join(problems)


def test_the_api_check_catches_each_kind_of_violation():
    bad = (
        "def on_fit_start(self, trainer, pl_module):\n"
        "    federation = self.federation(trainer)\n"
        "    federation.store.local.clear()\n"
        "    trainer.strategy.history\n"
        "    return pl_module._private\n"
    )
    assert api_problems(bad, "bad.py") == [
        "bad.py:3 uses Federation.store, not public and documented",
        "bad.py:4 reaches trainer.strategy (use self.strategy(trainer))",
        "bad.py:5 reads private ._private",
    ]
