"""FedCP (``lightning_fedrep.federation.algorithms.fedcp``) against a plain PyTorch loop restating the rule of the
authors' ``clientcp.py``/``servercp.py`` (github.com/TsingZ0/FedCP) with the paper's current global head and
policy network for every client: per batch, ``rep = body(x)``, ``(pm, gm) = gumbel_softmax(CPN(rep * c))``
(``c``: the normalized rows' sum of the client's head weight at its round start),
``loss = CE(classifier(rep * pm) + h_g(rep * gm), y) + lamda * MMD(rep, body_g(x))``; the module's optimizer
steps the body and the personalized head, plain SGD the CPN (an ``nn.Sequential(Linear, LayerNorm, ReLU)``); the
server takes the sample-weighted means of the bodies, CPNs and ``0.5 h_p + 0.5 h_g``. The Gumbel noise is the
documented counter-based hash, restated here with numpy's uint64; the initial CPN and noise key are read from
the strategy at fit start. Rows in the loader's shuffle order (``tests.fixtures.client_batches``)."""

import copy
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FedCP, FederatedDataModule, FederatedStrategy
from lightning_fedrep.federation.api.declared import ServerTensors
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import DeclaredNet, LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, D, LR = 3, 2, 4, 3, 2, 3, 8, 0.5
HEAD = ("classifier.weight", "classifier.bias")
CPN = ("linear.weight", "linear.bias", "norm.weight", "norm.bias")
M32 = np.uint64(0xFFFFFFFF)


def datamodule(batch_size=256):
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _mix(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x45D9F3B)) & M32
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x45D9F3B)) & M32
    return h ^ (h >> np.uint64(16))


def noise(key, round_index, client, step, rows):
    """The README's noise: 32-bit hashes of (key, round, client, step), then of each (row, channel, unit)."""
    h = _mix(np.uint64(key) & M32)
    for part in (round_index, client, step):
        h = _mix(h ^ _mix((np.uint64(part) + np.uint64(0x9E3779B9)) & M32))
    index = np.arange(rows * 2 * D, dtype=np.uint64).reshape(rows, 2, D)
    h = _mix(h ^ _mix((index + np.uint64(0x7F4A7C15)) & M32))
    u = torch.from_numpy(((h >> np.uint64(8)).astype(np.float64) + 0.5) * 2.0**-24).float()
    return -torch.log(-torch.log(u))


def _head(model):
    """The head's parameter names (the ``classifier``'s, one or more ``nn.Linear``)."""
    return tuple(n for n, _ in model.named_parameters() if n.startswith("classifier."))


def _context(head):
    """The official ``set_head_g``: the rows' sum of the product of the head's weights, last to first."""
    weights = [t for n, t in head.items() if n.endswith("weight")]
    product = weights[-1]
    for w in weights[-2::-1]:
        product = product @ w
    return F.normalize(product.sum(0, keepdim=True), p=2, dim=1)


def _head_g(model, hg, features):
    """The global head: the module's ``classifier`` run on ``hg``'s values."""
    values = {n[len("classifier.") :]: t for n, t in hg.items()}
    return torch.func.functional_call(model.classifier, values, (features,))


def _cpn(values):
    cpn = nn.Sequential(nn.Linear(D, 2 * D), nn.LayerNorm(2 * D), nn.ReLU())
    with torch.no_grad():
        for (_, p), k in zip(cpn.named_parameters(), CPN):
            p.copy_(values[k])
    return cpn


def _mmd(x, y):
    """The official ``MMD(x, y, 'rbf')``."""
    xx, yy, zz = x @ x.t(), y @ y.t(), x @ y.t()
    rx, ry = xx.diag().unsqueeze(0).expand_as(xx), yy.diag().unsqueeze(0).expand_as(yy)
    dxx, dyy, dxy = rx.t() + rx - 2.0 * xx, ry.t() + ry - 2.0 * yy, rx.t() + ry - 2.0 * zz
    XX, YY, XY = torch.zeros_like(xx), torch.zeros_like(xx), torch.zeros_like(xx)
    for a in (10, 15, 20, 50):
        XX += torch.exp(-0.5 * dxx / a)
        YY += torch.exp(-0.5 * dyy / a)
        XY += torch.exp(-0.5 * dxy / a)
    return torch.mean(XX + YY - 2.0 * XY)


def _local(init, w, head, hg, cpn_values, key, r, client, batches, lamda):
    model = copy.deepcopy(init)
    model.load_state_dict({**w, **head}, strict=False)
    base = copy.deepcopy(model.body)  # phi_g: the round-start global extractor, frozen
    optimizer = model.configure_optimizers()
    lr = optimizer.param_groups[0]["lr"]
    cpn = _cpn(cpn_values)
    context = _context(head)
    for step, (x, y) in enumerate(batches):
        rep = model.body(x)
        z = cpn(rep * context).view(x.shape[0], 2, -1)
        gate = torch.softmax(z + noise(key, r, client, step, x.shape[0]), dim=1)
        pm, gm = gate[:, 0], gate[:, 1]
        out = model.classifier(rep * pm) + _head_g(model, hg, rep * gm)
        loss = F.cross_entropy(out, y) + lamda * _mmd(rep, base(x).detach())
        optimizer.zero_grad()
        cpn.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for p in cpn.parameters():
                p -= lr * p.grad
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trained, {k: p.detach().clone() for k, p in zip(CPN, cpn.parameters())}


def plain_fedcp(init, dm, start, lamda=0.0):
    """The global body, CPN and head, and every client's personalized head (``start``: the server tensors at
    fit start)."""
    names = _head(init)
    w = {n: p.detach().clone() for n, p in init.named_parameters() if n not in names}
    heads = {c: {n: init.get_parameter(n).detach().clone() for n in names} for c in range(NUM_CLIENTS)}
    cpn = {k: start[f"cpn.{k}"] for k in CPN}
    hg = {n: start[f"hg.{n}"] for n in names}
    key = int(start["noise_key"])
    for r in range(ROUNDS):
        sums = {
            n: torch.zeros_like(t) for n, t in {**w, **{f"cpn.{k}": v for k, v in cpn.items()}, **hg}.items()
        }
        weight = 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            size = len(dm.client_data(client))
            steps = LOCAL_EPOCHS * math.ceil(size / dm.batch_size)
            batches = list(client_batches(dm, DATA_SEED, r, client, steps))
            trained, new_cpn = _local(init, w, heads[client], hg, cpn, key, r, client, batches, lamda)
            heads[client] = {n: trained[n] for n in names}
            upload = {
                **{n: trained[n] for n in w},
                **{f"cpn.{k}": v for k, v in new_cpn.items()},
                **{n: 0.5 * trained[n] + 0.5 * hg[n] for n in names},
            }
            for n in sums:
                sums[n] += size * upload[n]
            weight += size
        mean = {n: t / weight for n, t in sums.items()}
        w = {n: mean[n] for n in w}
        cpn = {k: mean[f"cpn.{k}"] for k in CPN}
        hg = {n: mean[n] for n in names}
    return w, heads, cpn, hg


class Start(Callback):
    """Keeps the strategy's server tensors at fit start (the initial CPN and head, the noise key)."""

    def on_train_start(self, trainer, module):
        self.server = {n: t.clone() for n, t in trainer.strategy.federation.server_tensors.items()}


def fit(algorithm, runner="auto", batch_size=256, model=None, callbacks=(), rounds=ROUNDS, **strategy_args):
    torch.manual_seed(0)
    init = model or DeclaredNet(lr=LR)  # a large lr: the heads part and the CPN moves within three rounds
    strategy_args.setdefault("head", "classifier")
    strategy_args.setdefault("seed", SEED)
    if strategy_args.setdefault("local_epochs", LOCAL_EPOCHS) is None:
        del strategy_args["local_epochs"]
    dm = datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=PER_ROUND,
        runner=runner,
        **strategy_args,
    )
    start = Start()
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, callbacks=[start, *callbacks]
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model, start.server


def _assert_equal(strategy, w, heads, cpn, hg):
    got = strategy.global_tensors()
    server = strategy.federation.server_tensors
    for name, value in {
        **w,
        **{f"cpn.{k}": v for k, v in cpn.items()},
        **{f"hg.{n}": v for n, v in hg.items()},
    }.items():
        torch.testing.assert_close(server.get(name, got.get(name)), value, rtol=1e-5, atol=1e-6, msg=name)
    for client in range(NUM_CLIENTS):
        local = dict(zip(strategy.federation.local_names, strategy.federation.store.get(client)))
        for name in heads[client]:
            torch.testing.assert_close(
                local[name], heads[client][name], rtol=1e-5, atol=1e-6, msg=(client, name)
            )


@pytest.mark.parametrize("lamda", [0.0, 0.5])
def test_fedcp_equals_a_plain_loop(lamda):
    """Golden test (full-batch clients, two local epochs, two of three clients per round, three rounds): the
    global body, CPN and head, and every client's personalized head. Fails if the gate draws no noise
    (``softmax(z / tau)`` in training), if a client's later rounds start from its own stale CPN instead of the
    global one (``if view.round == 0 and view.step == 0``), if the context is not normalized
    (``c = context.detach()[None]``), if the upload is the trained CPN's start (``source = server``) or the head
    alone (``1.0 * end.end[n]``), or if the noise's units are numbered in another order."""
    strategy, init, dm, trainer, model, start = fit(FedCP(lamda=lamda), runner="sequential")
    expected = plain_fedcp(init, dm, start, lamda)
    assert min((expected[2][k] - start[f"cpn.{k}"]).abs().max() for k in CPN) > 1e-3  # the CPN trained
    _assert_equal(strategy, *expected)


def test_the_lockstep_runner_equals_the_plain_loop():
    """The rule inside the lockstep runner's ``vmap`` on zero-padded batches of 64 (unequal step counts, idle
    lanes), with the MMD term. Fails if the MMD averages over the padded rows too (``total.mean()``) or the
    stale-CPN bug above."""
    strategy, init, dm, trainer, model, start = fit(FedCP(lamda=0.5), runner="vectorized", batch_size=64)
    assert strategy.runner_report.runner == "vectorized"
    _assert_equal(strategy, *plain_fedcp(init, dm, start, 0.5))


def _plain_logits(init, w, head, cpn, hg, x):
    """The scored model, plainly: the global body, the client's head, the global CPN and head, noise-free."""
    net = copy.deepcopy(init)
    net.load_state_dict({**w, **head}, strict=False)
    with torch.no_grad():
        rep = net.body(x)
        context = _context(head)
        gate = torch.softmax(_cpn(cpn)(rep * context).view(x.shape[0], 2, -1), dim=1)
        return net.classifier(rep * gate[:, 0]) + _head_g(net, hg, rep * gate[:, 1])


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_evaluation_scores_the_noise_free_two_head_prediction(runner):
    """The logged test accuracy and ``strategy.client_model(c)(x)`` are the plain FedCP prediction
    ``classifier_c(rep * pm) + h_g(rep * gm)`` with the global body, CPN and ``h_g``, the client's head and its
    context, and the noise-free gate. Fails if evaluation draws Gumbel noise (``_gate(..., gumbel_noise(...))``
    in ``fedcp_forward``), drops the global head (``return module.forward_head(rep * pm)``), or normalizes no
    context (``gate_in = rep``)."""
    strategy, init, dm, trainer, model, start = fit(FedCP(lamda=0.0), runner=runner)
    w, heads, cpn, hg = plain_fedcp(init, dm, start, 0.0)
    accuracies = []
    for client in range(NUM_CLIENTS):
        x, y = _xy(dm, client, "test")
        logits = _plain_logits(init, w, heads[client], cpn, hg, x)
        with torch.no_grad():
            torch.testing.assert_close(strategy.client_model(client)(x), logits, rtol=1e-5, atol=1e-5)
        accuracies.append((logits.argmax(1) == y).double().mean().item())
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_the_gumbel_noise_is_standard_gumbel_and_keyed_by_every_counter():
    """The training noise (``gumbel_noise``) has the standard Gumbel's mean (Euler's gamma) and variance
    (pi^2 / 6) and changes with each of key, round, client, step. Fails if the noise is ``-log(u)``
    (exponential) or ``u`` itself, or a counter is dropped from the hash."""
    from lightning_fedrep.federation.algorithms.fedcp import gumbel_noise

    key, client = torch.tensor(12345), torch.tensor(1)
    g = gumbel_noise(key, 2, client, 3, 4000, D).double()
    assert g.shape == (4000, 2, D)
    assert abs(g.mean().item() - 0.5772156649) < 0.02
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05
    torch.testing.assert_close(g.float(), noise(12345, 2, 1, 3, 4000))
    others = [
        gumbel_noise(torch.tensor(12346), 2, client, 3, 4000, D),
        gumbel_noise(key, 3, client, 3, 4000, D),
        gumbel_noise(key, 2, torch.tensor(2), 3, 4000, D),
        gumbel_noise(key, 2, client, 4, 4000, D),
    ]
    for other in others:
        assert (other.double() - g).abs().mean() > 0.5


def test_the_policy_network_starts_at_nn_linear_default_drawn_from_the_strategy_seed():
    """The initial CPN: ``Linear`` weight and bias in ``U(-1/sqrt(d), 1/sqrt(d))`` (``nn.Linear``'s default, not
    all in a narrower band), ``LayerNorm`` ones and zeros, ``h_g`` the module's head; the same on a second fit
    with the same seed, different with another seed. Fails if the init ignores the generator (every seed
    alike) or uses ``1/d`` as the bound."""
    first = fit(FedCP(), runner="sequential", rounds=1)[-1]
    again = fit(FedCP(), runner="sequential", rounds=1)[-1]
    other = fit(FedCP(), runner="sequential", rounds=1, seed=SEED + 1)[-1]
    bound = 1 / math.sqrt(D)
    for key in ("linear.weight", "linear.bias"):
        value = first[f"cpn.{key}"]
        assert value.abs().max() <= bound and value.abs().max() > 0.8 * bound, key
        torch.testing.assert_close(again[f"cpn.{key}"], value, rtol=0, atol=0)
        assert not torch.equal(other[f"cpn.{key}"], value)
    assert first["cpn.linear.weight"].shape == (2 * D, D)
    torch.testing.assert_close(first["cpn.norm.weight"], torch.ones(2 * D))
    torch.testing.assert_close(first["cpn.norm.bias"], torch.zeros(2 * D))
    torch.manual_seed(0)
    init = DeclaredNet(lr=LR)
    for name in HEAD:
        torch.testing.assert_close(first[f"hg.{name}"], init.get_parameter(name).detach())
    assert first["noise_key"] != other["noise_key"]


def test_a_callable_init_and_shapes_of_declared_tensors():
    """``ClientTensors``/``ServerTensors`` with ``shapes=callable(groups)`` and ``init=callable(name, template,
    generator)``: the shapes come from the groups' shapes, the generator is seeded from the seed and the name
    (same seed: same values; another seed or name: others), and a value of another shape is refused naming the
    declaration. Fails if the generator is not reseeded per name (two names draw one stream)."""
    from lightning_fedrep.federation.api.declared import declared_names, declared_templates

    groups = {"head": {"fc.weight": torch.zeros(3, 5)}, "body": {}}
    spec = ServerTensors("z", shapes=lambda g: {"a": (g["head"]["fc.weight"][1],), "b": (5,)}, init=_uniform)
    first, again, other = (declared_templates([spec], groups, seed) for seed in (1, 1, 2))
    assert list(first) == ["z.a", "z.b"] == declared_names([spec], groups)
    assert first["z.a"].shape == (5,)
    torch.testing.assert_close(first["z.a"], again["z.a"], rtol=0, atol=0)
    assert not torch.equal(first["z.a"], other["z.a"]) and not torch.equal(first["z.a"], first["z.b"])
    bad = ServerTensors("z", shapes=(2,), init=lambda name, template, generator: torch.zeros(3))
    with pytest.raises(ValueError, match=r"'z'.*shape \(2,\)"):
        declared_templates([bad], groups, 0)


def _uniform(name, template, generator):
    return torch.rand(template.shape, generator=generator)


class LayerNormHead(DeclaredNet):
    """A head ending in a ``LayerNorm``, which FedCP refuses (the context is a product of linear weights)."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))


class NoLoss(DeclaredNet):
    fedrep_loss = None


class ScaledOutput(LossNet):
    """Its ``forward`` is not ``head(features(x))`` (the head's output is doubled) and it declares no split."""

    def forward(self, x):
        return 2 * self.classifier(self.body(x))


class RefuseAtStep(Callback):
    def on_train_batch_start(self, *args):
        raise AssertionError("a step ran before the refusal")


@pytest.mark.parametrize(
    "model, message",
    [
        (LayerNormHead, r"head.*nn\.Linear.*classifier\.1\.weight"),
        (
            ScaledOutput,
            "declares no forward_features/forward_head, and its forward is not its head 'classifier'",
        ),
        (NoLoss, "fedrep_loss"),
    ],
)
def test_a_module_fedcp_cannot_run_is_refused_at_setup(model, message):
    """Refused before any step: a head with a non-linear layer, a module that is not ``head(features(x))``
    (neither declared nor a head module called last), a module without ``fedrep_loss``. Fails without
    ``FedCP.setup``'s checks."""
    with pytest.raises(ValueError, match=message):
        fit(FedCP(), runner="sequential", model=model(), callbacks=[RefuseAtStep()])


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_forward_of_head_of_body_runs_as_the_declared_split(runner):
    """``LossNet`` declares no ``forward_features``/``forward_head``; its ``forward`` is ``classifier(body(x))``,
    which FedCP finds as the vectorized runner does. It trains (with the MMD term) and scores bit for bit as the
    same module with the split declared (``DeclaredNet``). Fails on the code before: refused at setup ("FedCP
    needs the module's declared feature split")."""
    runs = []
    for model_class in (LossNet, DeclaredNet):
        torch.manual_seed(0)
        runs.append(fit(FedCP(lamda=0.5), runner=runner, model=model_class(lr=LR)))
    (detected, _, dm, *_), (declared, *_) = runs
    assert detected.runner_report.runner == declared.runner_report.runner == runner
    assert detected.federation.server_tensors.keys() == declared.federation.server_tensors.keys()
    for name, value in declared.federation.server_tensors.items():
        assert torch.equal(detected.federation.server_tensors[name], value), name
    for name, value in declared.global_tensors().items():
        assert torch.equal(detected.global_tensors()[name], value), name
    for client in range(NUM_CLIENTS):
        assert all(
            map(torch.equal, detected.federation.store.get(client), declared.federation.store.get(client))
        )
        x, _ = _xy(dm, client, "test")
        with torch.no_grad():
            assert torch.equal(detected.client_model(client)(x), declared.client_model(client)(x)), client


@pytest.mark.parametrize("arguments", [{"lamda": -1.0}, {"tau": 0.0}, {"lamda": float("nan")}])
def test_bad_arguments_name_themselves(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        FedCP(**arguments)


def test_fedcp_by_name():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["fedcp"]
    assert isinstance(algorithm, FedCP) and algorithm.lamda == 5.0 and algorithm.shares == {"body"}


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Fit two rounds, save, resume to three: the server tensors (CPN, ``h_g``, the int64 noise key) and the
    global body equal the three-round run's. Fails if the checkpoint's declared names cannot be rebuilt
    (``shapes=callable`` given no tensor shapes in ``declared_names``) or the noise key is redrawn on resume."""
    full = fit(FedCP(), runner="sequential")[0]
    first, *_, trainer, _, _ = fit(FedCP(), runner="sequential", rounds=2)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    torch.manual_seed(0)
    strategy = FederatedStrategy(
        algorithm=FedCP(),
        clients_per_round=PER_ROUND,
        local_epochs=LOCAL_EPOCHS,
        head="classifier",
        seed=SEED,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        DeclaredNet(lr=LR), datamodule=datamodule(), ckpt_path=path
    )
    for name, value in full.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for name, value in full.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)


def test_phases_other_than_one_joint_phase_are_refused():
    """FedCP takes the global CPN at a client's first step of the round: a head phase then a body phase (the
    CPN would be reset between them on the lockstep runner) is refused when the round is planned, naming
    ``phases``. Fails without ``FedCP.configure_round``."""
    from lightning_fedrep import Phase

    with pytest.raises(ValueError, match=r"FedCP.*one phase per round, got phases="):
        fit(
            FedCP(),
            runner="sequential",
            local_epochs=None,
            phases=[Phase("head", epochs=1), Phase("body", epochs=1)],
            callbacks=[RefuseAtStep()],
        )


class TwoLayerHead(DeclaredNet):
    """A head of two ``nn.Linear`` layers: the context is the rows' sum of ``W_2 @ W_1``."""

    def __init__(self):
        super().__init__(lr=LR)
        self.classifier = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 4))


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
def test_a_head_of_two_linear_layers_equals_the_plain_loop(runner):
    """The context of a two-layer head is the official product of its weights (last to first), and the global
    head runs as the module's head. Fails if the context reads the last layer alone (``for w in []`` in
    ``_context``)."""
    torch.manual_seed(0)
    strategy, init, dm, trainer, model, start = fit(FedCP(lamda=0.0), runner=runner, model=TwoLayerHead())
    _assert_equal(strategy, *plain_fedcp(init, dm, start, 0.0))


def test_fedcp_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedCP (``tests/scripts/algorithms_run.py``, a module with a declared feature split), 2 rounds, every
    client: the global body, the server's policy network and global head, every client's head and declared
    tensors and the validation accuracy (scored through FedCP's own forward) on 2 processes equal the 1-process
    run. Fails when a process draws other Gumbel noise than the client's (the noise keyed by the rank), or
    when the uploads of another process's clients are left out of the policy network's mean."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedcp"]
    assert any(name.startswith("cpn.") for name in single["server"])
    for held in (rank["fedcp"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held, atol=1e-6)
        for name, value in single["server"].items():
            torch.testing.assert_close(held["server"][name], value, rtol=1e-6, atol=1e-7)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)
