"""The federation core without a Trainer: plan, layout, server average, client store, and the
``Federation`` round state machine driven by hand against an independent plain-PyTorch round."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lightning_fedrep.federation as federation_module
from lightning_fedrep.federation import Federation, FederationConfig
from lightning_fedrep.federation.api.aggregation import WeightedAverage
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.epochs import default_phases
from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.module.split import SplitError, resolve_layout
from lightning_fedrep.federation.plan import plan_round
from lightning_fedrep.federation.store import ClientStore

HEAD = ("head.weight", "head.bias")


class Net(nn.Module):
    def __init__(self, batch_norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(4, 6)] + ([nn.BatchNorm1d(6)] if batch_norm else []) + [nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


def client_data(client: int, num_batches: int, batch_size: int = 5):
    g = torch.Generator().manual_seed(100 + client)
    return [
        (torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g))
        for _ in range(num_batches)
    ]


def make_federation(module, algorithm="fedrep", phases=None, keep=False, sizes=(10, 20, 15)):
    algo = ALGORITHMS[algorithm]
    phases = phases or default_phases(algo, {"head_epochs": 2, "body_epochs": 1, "local_epochs": 1})
    layout = resolve_layout(module, "head", shares=algo.shares, needs_head=True)
    config = FederationConfig(
        phases=tuple(phases), clients_per_round=1.0, client_optimizer_state="keep" if keep else "reset"
    )
    fed = Federation(algo, layout, config)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)
    fed.attach(module, [optimizer])
    fed.initialize(torch.device("cpu"))
    fed.bind_data(sizes, batch_size=5)
    return fed, optimizer


def drive_round(fed, module, optimizer, round_index, stop_after=None):
    """What the strategy does each Lightning step, written out."""
    plan = fed.plan(round_index)
    if not fed.round_open:
        fed.open_round(plan)
    batches = {w.client: iter(client_data(w.client + 10 * round_index, w.steps)) for w in plan.work}
    for step in range(plan.length if stop_after is None else stop_after):
        location = plan.locate(step)
        if location.client != fed.live_client:
            fed.finish_client()
            fed.load_client(location.client)
        fed.begin_step(location)
        x, y = next(batches[location.client])
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        fed.end_step()
    return None if stop_after is not None else fed.close_round()


def plain_round(init: nn.Module, global_state, heads, plan, round_index, weights):
    """FedRep's round by hand: per client a copy with the global body and its head, fresh SGD, the
    phases with the other part frozen; the body averaged with the clients' weights."""
    total, weight = None, 0.0
    for work in plan.work:
        model = copy.deepcopy(init)
        state = dict(global_state)
        state.update(heads.get(work.client, {k: init.state_dict()[k] for k in HEAD}))
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        batches = iter(client_data(work.client + 10 * round_index, work.steps))
        for part, steps in work.phases:
            for name, p in model.named_parameters():
                p.requires_grad_(part == "all" or (name in HEAD) == (part == "head"))
                p.grad = None
            for _ in range(steps):
                x, y = next(batches)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        heads[work.client] = {k: v.clone() for k, v in model.state_dict().items() if k in HEAD}
        body = {k: v.double() * weights[work.client] for k, v in model.state_dict().items() if k not in HEAD}
        total = body if total is None else {k: total[k] + body[k] for k in body}
        weight += weights[work.client]
    return {k: (v / weight).float() for k, v in total.items()}, heads


# ---------------------------------------------------------------------------------------------- plan
def test_plan_turns_epochs_into_steps_and_locates_each_step():
    plan = plan_round(3, [2, 0], (Phase("head", epochs=2), Phase("body", steps=1)), [7, 9, 10], batch_size=4)
    assert [(w.client, w.phases) for w in plan.work] == [
        (2, (("head", 6), ("body", 1))),
        (0, (("head", 4), ("body", 1))),
    ]
    assert plan.length == 12 and plan.clients == [2, 0] and plan.federated
    location = plan.locate(7)
    assert (location.client, location.part, location.client_step, location.first_of_client) == (
        0,
        "head",
        0,
        True,
    )
    assert plan.locate(11).last_of_round and plan.locate(11).part == "body"
    with pytest.raises(IndexError):
        plan.locate(12)


def test_plan_replace_rederives_steps():
    plan = plan_round(0, [0, 1, 2], (Phase("all", epochs=1),), [5, 10, 15], batch_size=5)
    narrowed = plan.replace(clients=[2])
    assert narrowed.clients == [2] and narrowed.length == 3 and narrowed.round == 0
    finetune = plan.replace(
        clients=range(3), phases=[{"train": "head", "steps": 2}], aggregate=False, prefix="ft/"
    )
    assert finetune.length == 6 and not finetune.federated and finetune.prefix == "ft/"
    with pytest.raises(ValueError, match="names clients \\[3\\]"):
        plan.replace(clients=[3])
    with pytest.raises(ValueError, match="twice"):
        plan.replace(clients=[1, 1])


# ---------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize(
    "algorithm,shared,local",
    [
        ("fedrep", {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"}, set(HEAD)),
        ("lg_fedavg", set(HEAD), {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"}),
        ("fedavg", {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias", *HEAD}, set()),
        ("local", set(), {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias", *HEAD}),
    ],
)
def test_layout_follows_what_the_algorithm_shares_with_buffers_beside_the_body(algorithm, shared, local):
    module = Net(batch_norm=True)
    algo = ALGORITHMS[algorithm]
    layout = resolve_layout(module, "head", shares=algo.shares, needs_head=algo.needs_split)
    buffers = {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
    params = {n for n, _ in module.named_parameters()}
    assert set(layout.shared) & params == shared and set(layout.local) & params == local
    assert buffers <= (set(layout.shared) if "body" in algo.shares else set(layout.local))


def test_layout_errors_name_the_module_parameters():
    with pytest.raises(SplitError, match="Did you mean 'head'"):
        resolve_layout(Net(), "haed", shares=frozenset({"body"}), needs_head=True)
    with pytest.raises(SplitError, match="No head is marked"):
        resolve_layout(Net(), None, shares=frozenset({"body"}), needs_head=True)
    layout = resolve_layout(Net(), None, shares=frozenset({"body", "head"}), needs_head=False)
    assert layout.split.head == () and layout.local == ()


# ---------------------------------------------------------------------------------------------- server
def test_weighted_average_is_float64_and_rounds_integer_tensors():
    like = [torch.zeros(3), torch.zeros((), dtype=torch.long)]
    average = WeightedAverage(like)
    average.add([torch.tensor([1.0, 2.0, 3.0]), torch.tensor(3)], weight=1.0)
    average.add([torch.tensor([4.0, 5.0, 6.0]), torch.tensor(6)], weight=2.0)
    mean = average.mean(like)
    torch.testing.assert_close(mean[0], torch.tensor([3.0, 4.0, 5.0]))
    assert mean[1].dtype == torch.long and mean[1].item() == 5
    with pytest.raises(ValueError, match="positive"):
        average.add(like, weight=0.0)


# ---------------------------------------------------------------------------------------------- client store
def test_client_store_keeps_copies_and_reads_the_template_for_new_clients():
    template = [torch.zeros(2)]
    store = ClientStore(template)
    assert store.get(5) is store.template
    value = torch.ones(2)
    store.put(5, [value])
    value.add_(1)
    torch.testing.assert_close(store.get(5)[0], torch.ones(2))
    store.finetuned[5] = {"body.w": torch.full((2,), 7.0)}
    assert set(store.personal(5, ["head.w"])) == {"head.w", "body.w"}
    restored = ClientStore([])
    restored.load_state_dict(store.state_dict())
    torch.testing.assert_close(restored.personal(5, ["head.w"])["body.w"], torch.full((2,), 7.0))
    torch.testing.assert_close(restored.get(0)[0], torch.zeros(2))


# ---------------------------------------------------------------------------------------------- federation
def test_federation_round_matches_a_plain_fedrep_round():
    module = Net()
    init = copy.deepcopy(module)
    fed, optimizer = make_federation(module)
    global_state = {k: v.clone() for k, v in init.state_dict().items() if k not in HEAD}
    heads: dict = {}
    for r in range(2):
        plan = fed.plan(r)
        result = drive_round(fed, module, optimizer, r)
        assert result.aggregated and [c.client for c in result.clients] == [0, 1, 2]
        assert [c.steps for c in result.clients] == [w.steps for w in plan.work]
        global_state, heads = plain_round(init, global_state, heads, plan, r, {0: 10.0, 1: 20.0, 2: 15.0})
        for name, value in fed.global_tensors().items():
            torch.testing.assert_close(value, global_state[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(module.body[0].weight, global_state["body.0.weight"], rtol=1e-5, atol=1e-6)
        for client, head in heads.items():
            for name in HEAD:
                torch.testing.assert_close(fed.client_tensors(client)[name], head[name], rtol=1e-5, atol=1e-6)


def test_optimizer_state_is_reset_or_kept_for_the_local_part_only():
    for keep in (False, True):
        module = Net()
        fed, optimizer = make_federation(module, keep=keep)
        drive_round(fed, module, optimizer, 0)
        assert bool(fed.store.optimizer_states) == keep
        if keep:
            kept = fed.store.optimizer_states[1][0]
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named = {id(p): n for n, p in module.named_parameters()}
            assert {named[id(params[i])] for i in kept} == set(HEAD)
        fed.open_round(fed.plan(1))
        fed.load_client(1)
        restored = {n for n, p in module.named_parameters() if p in optimizer.state}
        assert restored == (set(HEAD) if keep else set())


def test_evaluation_mid_round_evaluates_the_global_body_and_restores_training():
    module = Net()
    fed, optimizer = make_federation(module)
    drive_round(fed, module, optimizer, 0)
    drive_round(fed, module, optimizer, 1, stop_after=3)
    live = {k: v.clone() for k, v in module.state_dict().items()}
    fed.begin_evaluation()
    fed.evaluate_client(2)
    torch.testing.assert_close(module.body[0].weight, fed.global_view()["body.0.weight"])
    torch.testing.assert_close(module.head.weight, fed.client_tensors(2)["head.weight"])
    fed.end_evaluation()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, live[name], rtol=0, atol=0)


def test_state_dict_mid_round_resumes_exactly():
    """A federation saved mid-round (with the live optimizer's state, which Lightning saves) and
    restored into a fresh module finishes the round exactly as the uninterrupted one."""
    module = Net()
    fed, optimizer = make_federation(module, keep=True)
    drive_round(fed, module, optimizer, 0)
    drive_round(fed, module, optimizer, 1, stop_after=4)
    state = copy.deepcopy(fed.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    plan = fed.plan(1)
    finish_round(fed, module, optimizer, plan, start=4)

    module2 = Net()
    fed2, optimizer2 = make_federation(module2, keep=True)
    fed2.load_state_dict(state)
    optimizer2.load_state_dict(optimizer_state)
    fed2.restore_round(state)
    assert (
        fed2.round_open
        and fed2.live_client == plan.locate(3).client
        and fed2.live_phase == plan.locate(3).part
    )
    finish_round(fed2, module2, optimizer2, plan, start=4)
    for name, value in fed.global_tensors().items():
        torch.testing.assert_close(fed2.global_tensors()[name], value, rtol=0, atol=0)
    for client in range(3):
        for name, value in fed.client_tensors(client).items():
            torch.testing.assert_close(fed2.client_tensors(client)[name], value, rtol=0, atol=0)


def finish_round(fed, module, optimizer, plan, start):
    """Run steps ``start..`` of ``plan`` (the batches of the earlier steps are drawn and skipped)."""
    batches = {w.client: iter(client_data(w.client + 10 * plan.round, w.steps)) for w in plan.work}
    for step in range(plan.length):
        location = plan.locate(step)
        x, y = next(batches[location.client])
        if step < start:
            continue
        if location.client != fed.live_client:
            fed.finish_client()
            fed.load_client(location.client)
        fed.begin_step(location)
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        fed.end_step()
    return fed.close_round()


class FakeClock:
    """A step clock (``Federation.clock``) that reads ``now``; the test advances it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_client_timing_excludes_the_first_step_after_loading_and_the_last_of_the_round():
    clock = FakeClock()
    module = Net()
    fed, optimizer = make_federation(module, phases=(Phase("all", steps=3),))
    fed.timing, fed.clock = True, clock
    plan = fed.plan(0)
    fed.open_round(plan)
    results = []
    for step in range(plan.length):
        location = plan.locate(step)
        if location.client != fed.live_client:
            finished = fed.finish_client()
            results += [finished] if finished else []
            fed.load_client(location.client)
        fed.begin_step(location)
        clock.now += 1.0 + location.client  # every step of client c costs c + 1 seconds
        fed.end_step()
    result = fed.close_round()
    assert [(c.client, c.steps, c.timed_steps, c.seconds) for c in result.clients] == [
        (0, 3, 2, 2.0),
        (1, 3, 2, 4.0),
        (2, 3, 1, 3.0),  # its first step (loading) and the round's last step (aggregation) are not timed
    ]


class ServerMomentum(Algorithm):
    """FedAvgM: the server applies momentum to the averaged update (a stateful aggregate)."""

    def __init__(self, beta: float):
        super().__init__("fedavgm", {"body", "head"}, "FedAvg with server momentum")
        self.beta = beta
        self.velocity: dict[str, torch.Tensor] | None = None

    def aggregate(self, server, results, failures):
        update = {n: g - results.reduced[n] for n, g in server.shared.items()}
        self.velocity = (
            update
            if self.velocity is None
            else {n: self.beta * v + update[n] for n, v in self.velocity.items()}
        )
        return server.replace(shared={n: g - self.velocity[n] for n, g in server.shared.items()}), {}

    def state_dict(self):
        return {"velocity": self.velocity or {}}

    def load_state_dict(self, state):
        self.velocity = state["velocity"] or None


def test_an_algorithm_with_its_own_aggregation_and_state_needs_no_change_to_the_core():
    module = Net()
    algo = ServerMomentum(beta=0.9)
    layout = resolve_layout(module, None, shares=algo.shares, needs_head=algo.needs_split)
    fed = Federation(algo, layout, FederationConfig(phases=(Phase("all", steps=2),), clients_per_round=1.0))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    fed.attach(module, [optimizer])
    fed.initialize(torch.device("cpu"))
    fed.bind_data((10, 10), batch_size=5)
    plain = FederationOfMeans(module)
    for r in range(3):
        before = fed.global_tensors()
        drive_round(fed, module, optimizer, r)
        mean = plain.round_mean(before, r)
        update = {k: before[k] - mean[k] for k in before}
        plain.velocity = (
            update if plain.velocity is None else {k: 0.9 * plain.velocity[k] + update[k] for k in update}
        )
        for name, value in fed.global_tensors().items():
            torch.testing.assert_close(value, before[name] - plain.velocity[name], rtol=1e-5, atol=1e-6)
    assert (
        re.match("fedavgm", fed.state_dict()["algorithm"])
        and len(fed.state_dict()["algorithm_state"]["velocity"]) == 4
    )


class FederationOfMeans:
    """Independent reference for FedAvg's mean: each client trains a copy from the global state."""

    def __init__(self, module):
        self.init = copy.deepcopy(module)
        self.velocity = None

    def round_mean(self, global_state, r):
        models = []
        for client in (0, 1):
            model = copy.deepcopy(self.init)
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in client_data(client + 10 * r, 2):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            models.append(model.state_dict())
        return {k: (models[0][k] + models[1][k]) / 2 for k in global_state}


def test_the_core_imports_no_lightning():
    """``federation/`` and every package module it imports (transitively) import torch only."""
    import ast
    from pathlib import Path

    package = Path(federation_module.__file__).parent.parent
    seen, todo = set(), ["federation"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = package / f"{name.replace('.', '/')}.py"
        if not path.exists():
            path = package / name.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            for module in modules:
                assert not (
                    module == "lightning" or module.startswith(("lightning.", "pytorch_lightning"))
                ), f"{name}.py imports {module}"
                if module.startswith("lightning_fedrep."):
                    todo.append(module.removeprefix("lightning_fedrep."))
    assert {
        "federation",
        "federation.api.algorithm",
        "federation.plan",
        "federation.store",
        "federation.api.aggregation",
        "federation.module.split",
        "federation.history",
    } <= seen
