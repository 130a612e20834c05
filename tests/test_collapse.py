"""FLUTE: the NC regulariser R and metrics (closed forms), the NeuralCollapse callback against a plain
PyTorch step, its mechanism on class-shard data, and linear FLUTE (digest §9 E1, E2, E3)."""

import copy
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from benchmarks.flute.linear_flute import (
    empirical_rank_k_fit,
    flute_regularizer,
    flute_regularizer_grad,
    linear_flute,
    make_linear_flute_problem,
)
from lightning_fedrep import FederatedDataModule, FedRepStrategy, Phase
from lightning_fedrep.callbacks import NeuralCollapse
from lightning_fedrep.callbacks.neural_collapse_metrics import (
    class_masks,
    etf_target,
    global_nc2,
    local_nc2,
    nc1,
    nc3,
    nc_regularizer,
    server_nc_step,
)
from lightning_fedrep.data.partition import ShardPartitioner
from lightning_fedrep.models import MLPClassifier
from tests.fixtures import MarkedTinyNet, TinyNet, quiet_trainer, tiny_datamodule


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread avoids oversubscribing the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- independent reference of R (numpy)
def target_np(mask, simplex):
    k = len(mask)
    return (np.eye(k) - np.ones((k, k)) / simplex) * np.outer(mask, mask) / np.sqrt(simplex - 1)


def r_np(w, mask, simplex=None):
    """R(W) = ||W W^T/||W W^T||_F - T||_F, straight from the formula (eq. 52 / the code's r1)."""
    g = w @ w.T
    return np.linalg.norm(g / np.linalg.norm(g) - target_np(mask, simplex or len(mask)))


def r_grad_np(w, mask):
    """Hand-derived gradient: with G = WW^T, n = ||G||, A = G/n - T, R = ||A||:
    dR/dW = 2 B W, B = (A/n - <A,G> G/n^3) / R."""
    g = w @ w.T
    n = np.linalg.norm(g)
    a = g / n - target_np(mask, len(mask))
    r = np.linalg.norm(a)
    b = (a / n - np.sum(a * g) * g / n**3) / r
    return 2 * b @ w


def closed_form_r_min(k, s):
    """min_W R = 1 - ||T||_F with ||T||_F^2 = S((K-1)^2 + S - 1) / (K^2 (K-1))  (digest §4.2)."""
    return 1 - math.sqrt(s * ((k - 1) ** 2 + s - 1) / (k**2 * (k - 1)))


def test_r_min_closed_form_k10_s2():
    assert closed_form_r_min(10, 2) == pytest.approx(0.573125, abs=1e-6)
    mask = torch.zeros(10, dtype=torch.float64)
    mask[[3, 7]] = 1
    assert float(torch.linalg.matrix_norm(etf_target(mask))) == pytest.approx(0.42687, abs=1e-5)
    # the minimiser: zero rows for absent classes, present rows with Gram ∝ I_S - 11^T/K (cosine -1/(K-1))
    gram = torch.eye(2, dtype=torch.float64) - 1 / 10
    w = torch.zeros(10, 16, dtype=torch.float64)
    w[[3, 7], :2] = torch.linalg.cholesky(gram)
    assert float(nc_regularizer(w, mask)) == pytest.approx(0.573125, abs=1e-6)


def test_r_optimum_by_descent_zeroes_absent_rows():
    """Minimising R from a random W reaches 1 - ||T||_F and drives the absent classes' rows to 0."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(10, dtype=torch.float64)
    mask[[1, 4]] = 1
    w = torch.randn(10, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.LBFGS(
        [w], max_iter=150, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        value = nc_regularizer(w / w.norm(), mask)  # R is scale-invariant: descend on the sphere
        value.backward()
        return value

    opt.step(closure)
    assert float(nc_regularizer(w.detach(), mask)) == pytest.approx(closed_form_r_min(10, 2), abs=1e-6)
    rows = w.detach().norm(dim=1)
    assert float(rows[mask == 0].max()) < 0.02 * float(rows[mask == 1].min())
    present = w.detach()[mask == 1]
    cosine = F.cosine_similarity(present[0], present[1], dim=0)
    assert float(cosine) == pytest.approx(-1 / 9, abs=0.02)  # global ETF angle, not the local -1/(S-1)


def test_r_scale_invariance_and_exact_etf():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 64, generator=g, dtype=torch.float64)
    mask = torch.zeros(10, dtype=torch.float64)
    mask[[0, 5]] = 1
    assert float(nc_regularizer(3.7 * w, mask)) == pytest.approx(float(nc_regularizer(w, mask)), rel=1e-12)
    # exact K-simplex ETF rows with every class present: R = 0 (and unchanged by scaling)
    p, _ = torch.linalg.qr(torch.randn(64, 10, generator=g, dtype=torch.float64))
    etf = (p @ (torch.eye(10, dtype=torch.float64) - 1 / 10)).T * math.sqrt(10 / 9)
    ones = torch.ones(10, dtype=torch.float64)
    assert float(nc_regularizer(etf, ones)) < 1e-12
    assert float(nc_regularizer(3.7 * etf, ones)) < 1e-12
    # local NC2 = 0 for an exact S-ETF on the present classes (S = 3, K = 10)
    local = torch.zeros(10, 64, dtype=torch.float64)
    present = [2, 6, 9]
    local[present] = (p[:, :3] @ (torch.eye(3, dtype=torch.float64) - 1 / 3)).T
    mask3 = torch.zeros(10, dtype=torch.float64)
    mask3[present] = 1
    assert float(local_nc2(local[None], mask3[None])) < 1e-12
    assert float(global_nc2(local[None], mask3[None])) > 0.3


def test_r_matches_reference_and_its_gradient():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(10, 16, generator=g, dtype=torch.float64)
    mask = np.zeros(10)
    mask[[2, 3, 8]] = 1
    wt = w.clone().requires_grad_(True)
    value = nc_regularizer(wt, torch.tensor(mask))
    (grad,) = torch.autograd.grad(value, wt)
    assert float(value.detach()) == pytest.approx(r_np(w.numpy(), mask), rel=1e-12)
    np.testing.assert_allclose(grad.numpy(), r_grad_np(w.numpy(), mask), rtol=1e-9, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: nc_regularizer(x, torch.tensor(mask)), (wt,))
    # batched = per client
    heads = torch.randn(4, 10, 16, generator=g, dtype=torch.float64)
    masks = class_masks(
        [torch.tensor([0, 1]), torch.tensor([2, 2, 5]), torch.tensor([9, 3]), torch.arange(10)], 10
    )
    batched = nc_regularizer(heads, masks.double())
    expected = [r_np(h.numpy(), m.numpy()) for h, m in zip(heads, masks)]
    np.testing.assert_allclose(batched.numpy(), expected, rtol=1e-12)
    local = [r_np(h.numpy(), m.numpy(), int(m.sum())) for h, m in zip(heads, masks)]
    assert float(local_nc2(heads, masks.double())) == pytest.approx(np.mean(local), rel=1e-12)


def test_server_step_is_one_gd_step_on_the_mean_r():
    g = torch.Generator().manual_seed(3)
    heads = torch.randn(5, 10, 16, generator=g, dtype=torch.float64)
    masks = class_masks([torch.randperm(10, generator=g)[:2] for _ in range(5)], 10).double()
    new = server_nc_step(heads, masks, lr=0.5)
    for i in range(5):
        expected = heads[i].numpy() - 0.5 / 5 * r_grad_np(heads[i].numpy(), masks[i].numpy())
        np.testing.assert_allclose(new[i].numpy(), expected, rtol=1e-10)
    assert float(nc_regularizer(new, masks).mean()) < float(nc_regularizer(heads, masks).mean())
    paper = server_nc_step(heads, masks, lr=0.5, normalizer=50)  # the paper's 1/N
    np.testing.assert_allclose((heads - paper).numpy(), ((heads - new) / 10).numpy(), rtol=1e-10)


def test_nc1_and_nc3_closed_forms():
    # two classes in 1-D: means ±a, two samples a ± s each, so Σ_W = s^2, Σ_B = a^2, NC1 = s^2/(2a^2)
    a, s = 2.0, 0.5
    feats = torch.tensor([[-a - s], [-a + s], [a - s], [a + s]])
    labels = torch.tensor([0, 0, 1, 1])
    assert float(nc1(feats, labels)) == pytest.approx(s**2 / (2 * a**2), rel=1e-12)
    assert float(nc1(torch.tensor([[-a], [-a], [a], [a]]), labels)) == pytest.approx(0, abs=1e-12)
    # NC3: heads equal to (a multiple of) the centred class means -> 0; their negation -> 4
    g = torch.Generator().manual_seed(4)
    means = torch.randn(4, 8, generator=g, dtype=torch.float64)
    y = torch.arange(4).repeat_interleave(5)
    x = means[y] + 0.1 * torch.randn(20, 8, generator=g, dtype=torch.float64)
    mu = torch.stack([x[y == c].mean(0) for c in range(4)])
    centred = mu - mu.mean(0)
    masks = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.float64)
    heads = torch.stack([2.0 * centred, 0.5 * centred])
    assert float(nc3(heads, masks, x, y)) == pytest.approx(0, abs=1e-12)
    assert float(nc3(-heads, masks, x, y)) == pytest.approx(4, abs=1e-12)


# ---------------------------------------------------------------- the callback vs a plain PyTorch step
def r_torch_reference(w, mask):
    """R written out again (not the library's): used inside the plain-PyTorch reference step."""
    k = mask.shape[0]
    target = (torch.eye(k) - torch.ones(k, k) / k) * torch.outer(mask, mask) / math.sqrt(k - 1)
    gram = w @ w.T
    return torch.sqrt(((gram / torch.sqrt((gram**2).sum()) - target) ** 2).sum())


@pytest.mark.parametrize("schedule", ["all", "head_then_body"])
def test_penalties_and_server_step_match_plain_pytorch(schedule):
    """One round, two participants, full batch, plain SGD: the strategy + NeuralCollapse give the same
    weights as a hand-written step on CE + λR + μ||W||^2 (+ ν||φ||^2 when the body trains) per client,
    the sample-weighted mean of the two bodies, then the server step ``W_i - lr/|S_t| ∇R(W_i)`` (the
    official ``ServerUpdateNC2``: the mean of R over the participants). Catches a server step that sums
    R over the participants instead of averaging it (``normalizer = 1`` in ``_apply_server_step``), which
    a one-participant round cannot tell apart."""
    lam, mu, nu, server_lr = 0.3, 0.01, 0.002, 0.5
    torch.manual_seed(0)
    model = MarkedTinyNet(lr=0.1, momentum=0.0, weight_decay=0.0)
    init = copy.deepcopy(model)
    dm = tiny_datamodule(num_clients=8, classes_per_client=2, batch_size=64)
    phases = (
        [Phase("all", steps=1)] if schedule == "all" else [Phase("head", steps=1), Phase("body", steps=1)]
    )
    strategy = FedRepStrategy(phases=phases, clients_per_round=2, seed=3)
    callback = NeuralCollapse(lam=lam, mu=mu, nu=nu, server_step=True, server_lr=server_lr, log_metrics=False)
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0, callbacks=[callback]).fit(
        model, datamodule=dm
    )
    participants = list(strategy.round_plan(0).clients)
    assert len(participants) == 2
    head = ["classifier.weight", "classifier.bias"]

    def local_training(client):
        reference = copy.deepcopy(init)
        data = dm.client_data(client)
        x, y = data.dataset.tensors[0][data.indices], data.dataset.tensors[1][data.indices]
        mask = torch.zeros(4)
        mask[y.unique()] = 1
        assert torch.equal(callback.masks[client], mask)
        params = dict(reference.named_parameters())
        for trains in ["all"] if schedule == "all" else ["head", "body"]:
            loss = F.cross_entropy(reference(x), y)
            w = params["classifier.weight"]
            loss = loss + lam * r_torch_reference(w, mask) + mu * (w**2).sum()
            if trains != "head":
                loss = loss + nu * (reference.body(x) ** 2).sum()
            names = [n for n in params if (n in head) == (trains == "head") or trains == "all"]
            grads = torch.autograd.grad(loss, [params[n] for n in names])
            with torch.no_grad():
                for n, g in zip(names, grads):
                    params[n] -= 0.1 * g
        return reference, mask, len(y)

    trained = {c: local_training(c) for c in participants}
    total = sum(n for _, _, n in trained.values())
    for name, value in strategy.global_tensors().items():  # the bodies' sample-weighted mean
        expected = sum(
            dict(ref.named_parameters())[name].detach() * n / total for ref, _, n in trained.values()
        )
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)

    def server_step(w, mask):  # one GD step on (1/|S_t|) Σ_i R(W_i): R is separable, so lr/|S_t| per head
        w = w.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(r_torch_reference(w, mask), w)
        return w.detach() - server_lr / len(participants) * g

    for client, (reference, mask, _) in trained.items():
        got = strategy.client_tensors(client)
        expected_head = server_step(reference.classifier.weight, mask)
        torch.testing.assert_close(got["classifier.weight"], expected_head, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(  # biases are not part of the server step
            got["classifier.bias"], reference.classifier.bias.detach(), rtol=1e-5, atol=1e-6
        )
    for c in set(range(8)) - set(participants):  # heads of clients that did not participate: the init
        for name in head:
            torch.testing.assert_close(
                strategy.client_tensors(c)[name], dict(init.named_parameters())[name].detach(), rtol=0, atol=0
            )
    assert callback.server_round == 0

    # a run resumed from a checkpoint saved between validation and the server step catches the step up
    state = callback.state_dict()
    assert state["server_round"] == 0
    state["server_round"] = -1
    callback.load_state_dict(state)
    before = {c: strategy.client_tensors(c)["classifier.weight"] for c in participants}
    callback.on_train_epoch_start(SimpleNamespace(current_epoch=1, strategy=strategy), model)
    for client, (_, mask, _) in trained.items():
        torch.testing.assert_close(
            strategy.client_tensors(client)["classifier.weight"],
            server_step(before[client], mask),
            rtol=1e-5,
            atol=1e-6,
        )
    assert callback.server_round == 0


# ---------------------------------------------------------------- mechanism on class-shard data
def gaussian_mixture(seed=0, classes=10, dim=32, train=400, test=500, noise=2.0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=g)

    def draw(n):
        y = torch.arange(classes).repeat_interleave(n // classes)
        return TensorDataset(means[y] + noise * torch.randn(len(y), dim, generator=g), y)

    return draw(train), draw(test)


def run_mixture(callback, phases, rounds=20, seed=0):
    torch.manual_seed(seed)
    train, test = gaussian_mixture(seed)
    dm = FederatedDataModule(train, test, partitioner=ShardPartitioner(10, 2), batch_size=10, seed=seed)
    model = MLPClassifier(in_features=32, hidden=64, features=16, num_classes=10, lr=0.05)
    strategy = FedRepStrategy(phases=phases, clients_per_round=0.5, seed=seed)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, callbacks=[callback], check_val_every_n_epoch=rounds
    )
    trainer.fit(model, datamodule=dm)
    return strategy.results()["final"]["val/acc"], trainer


def test_mechanism_penalties_lower_global_nc2_without_hurting_accuracy():
    """Digest §9 E8 (reduced): 10 clients with 2 of 10 Gaussian-mixture classes each, 20 rounds, half
    participate. Measured (seed 0): Global NC2 0.638 (FLUTE) vs 0.755 (same schedule, penalties off) vs
    0.752 (FedRep, 1 head + 1 body epoch); accuracy 0.888 vs 0.872 vs 0.874 (500 test samples)."""
    flute = NeuralCollapse(server_step=True)
    off = NeuralCollapse(lam=0, mu=0, nu=0)
    fedrep = NeuralCollapse(lam=0, mu=0, nu=0, feature_metrics=False)
    acc_flute, trainer = run_mixture(flute, [Phase("all", epochs=1)])
    _, _ = run_mixture(off, [Phase("all", epochs=1)])
    acc_fedrep, _ = run_mixture(fedrep, [Phase("head", epochs=1), Phase("body", epochs=1)])

    final = {
        name: cb.history[-1]["nc/global_nc2"]
        for name, cb in (("flute", flute), ("off", off), ("fedrep", fedrep))
    }
    assert final["flute"] < final["off"] - 0.05, final
    assert final["flute"] < final["fedrep"] - 0.05, final
    assert flute.history[0]["nc/global_nc2"] > final["flute"] + 0.1  # it falls over the rounds
    assert flute.history[-1]["nc/local_nc2"] < off.history[-1]["nc/local_nc2"]
    assert acc_flute >= acc_fedrep - 0.04, (acc_flute, acc_fedrep)
    assert len(flute.history) == 20
    logged = trainer.callback_metrics
    for key in ("nc/global_nc2", "nc/local_nc2", "nc/nc1", "nc/nc3"):
        assert math.isfinite(float(logged[key]))
    assert float(logged["nc/global_nc2"]) == pytest.approx(final["flute"], rel=1e-5)


def test_masks_come_from_the_data_and_bad_classifier_is_refused():
    torch.manual_seed(0)
    dm = tiny_datamodule(num_clients=4, classes_per_client=2, batch_size=60)
    callback = NeuralCollapse(log_metrics=False)
    strategy = FedRepStrategy(phases=[Phase("all", steps=1)], clients_per_round=1.0)
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0, callbacks=[callback]).fit(
        MarkedTinyNet(), datamodule=dm
    )
    for c in range(4):
        data = dm.client_data(c)
        assert set(torch.nonzero(callback.masks[c]).flatten().tolist()) == set(
            data.dataset.tensors[1][data.indices].unique().tolist()
        )
    assert callback.weight_name == "classifier.weight"
    # FedAvg on an unmarked module: no head to find the classifier in, so ask for it by name
    with pytest.raises(ValueError, match="classifier="):
        quiet_trainer(
            strategy=FedRepStrategy(algorithm="fedavg"), max_epochs=1, callbacks=[NeuralCollapse()]
        ).fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4))
    with pytest.raises(TypeError, match="nn.Linear"):
        quiet_trainer(
            strategy=FedRepStrategy(algorithm="fedavg"),
            max_epochs=1,
            callbacks=[NeuralCollapse(classifier="body")],
        ).fit(TinyNet(), datamodule=tiny_datamodule(num_clients=4))


def class_means_np(h, y):
    classes = np.unique(y)
    return classes, np.stack([h[y == c].mean(0) for c in classes])


def nc1_np(h, y):
    """NC1 (Papyan et al. 2020): ``tr(Σ_W Σ_B^+) / C``, Σ_W the within-class covariance over all samples,
    Σ_B the covariance of the C class means around their mean."""
    classes, means = class_means_np(h, y)
    within = h - means[np.searchsorted(classes, y)]
    sigma_w = within.T @ within / len(h)
    between = means - means.mean(0)
    sigma_b = between.T @ between / len(classes)
    return float(np.trace(sigma_w @ np.linalg.pinv(sigma_b, rcond=1e-10, hermitian=True)) / len(classes))


def nc3_np(heads, masks, h, y):
    """NC3 (self-duality), per client: ``||W_i/||W_i||_F - M_i/||M_i||_F||_F^2`` over the client's classes,
    ``M_i`` the globally centred class means; the mean over clients."""
    classes, means = class_means_np(h, y)
    centred = means - means.mean(0)
    values = []
    for w, mask in zip(heads, masks):
        rows = [i for i, c in enumerate(classes) if mask[c] > 0]
        a, b = w[classes[rows]], centred[rows]
        values.append(np.sum((a / np.linalg.norm(a) - b / np.linalg.norm(b)) ** 2))
    return float(np.mean(values))


class MapStyleImages(torch.utils.data.Dataset):
    """A torchvision-like data set: ``targets`` list, ``(tensor, int)`` items (no TensorDataset fast path)."""

    def __init__(self, x, y):
        self.x, self.targets = x, y.tolist()

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.x[i], self.targets[i]


def test_metrics_on_a_map_style_dataset_match_the_formulas():
    """Masks from ``targets``, features through a DataLoader: the logged metrics equal the formulas applied
    to each client's model (global body + its head) on its samples, restated here with numpy (NC1, NC3:
    ``nc1_np``/``nc3_np``, Papyan et al.'s definitions the FLUTE paper's App. B.3 cites). Catches an NC1
    not divided by the number of classes (``return torch.trace(sigma_w @ pinv)`` in ``collapse.nc1``) and
    an NC3 on uncentred class means (``centred = means`` in ``collapse.nc3``)."""
    train, test = gaussian_mixture(seed=1, train=200, test=100)
    dm = FederatedDataModule(
        MapStyleImages(*train.tensors),
        MapStyleImages(*test.tensors),
        partitioner=ShardPartitioner(5, 2),
        batch_size=10,
    )
    torch.manual_seed(1)
    model = MLPClassifier(in_features=32, hidden=64, features=16, num_classes=10, lr=0.05)
    callback = NeuralCollapse(server_step=True, metrics_samples=1000)  # >= a client's 40 samples: all of them
    strategy = FedRepStrategy(phases=[Phase("all", epochs=1)], clients_per_round=0.6)
    quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0, callbacks=[callback]).fit(
        model, datamodule=dm
    )
    heads, masks, feats, labels = [], [], [], []
    for c in range(5):
        data = dm.client_data(c)
        masks.append(class_masks([torch.tensor(data.dataset.targets)[data.indices]], 10)[0])
        client = copy.deepcopy(model)
        client.load_state_dict(strategy.client_state_dict(c))
        client.eval()
        index = data.indices
        x = data.dataset.x[index]
        with torch.no_grad():
            feats.append(client.body(x).double())
        labels.append(torch.tensor(data.dataset.targets)[index])
        heads.append(client.classifier.weight.detach().double())
    heads, masks = torch.stack(heads), torch.stack(masks).double()
    feats, labels = torch.cat(feats), torch.cat(labels)
    expected = {
        "nc/global_nc2": np.mean([r_np(h.numpy(), m.numpy()) for h, m in zip(heads, masks)]),
        "nc/local_nc2": np.mean([r_np(h.numpy(), m.numpy(), int(m.sum())) for h, m in zip(heads, masks)]),
        "nc/nc1": nc1_np(feats.numpy(), labels.numpy()),
        "nc/nc3": nc3_np(heads.numpy(), masks.numpy(), feats.numpy(), labels.numpy()),
    }
    got = callback.history[-1]
    assert got["round"] == 1
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


# ---------------------------------------------------------------- linear FLUTE
def test_linear_regularizer_gradients_and_balanced_identity():
    g = torch.Generator().manual_seed(5)
    u = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    for lam, mu, c in ((1.0, 1.0, 0.125), (0.5, 1.0, 0.125), (2.0, 0.3, 1.0)):
        gu, gv = torch.autograd.grad(flute_regularizer(u, v, lam, mu, c), (u, v))
        cu, cv = flute_regularizer_grad(u.detach(), v.detach(), lam, mu, c)
        torch.testing.assert_close(cu, gu, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cv, gv, rtol=1e-10, atol=1e-10)
    balanced = 0.125 * ((u.T @ u - v @ v.T) ** 2).sum()
    torch.testing.assert_close(flute_regularizer(u, v), balanced)  # λ = μ: the balancing penalty


def test_linear_client_gradients_match_autograd_on_the_samples():
    from benchmarks.flute.linear_flute import client_gradients

    problem = make_linear_flute_problem(dim=6, num_clients=4, samples_per_client=20, seed=1)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    gu, gv = client_gradients(problem, u.detach(), v.detach())
    for i in range(4):
        loss = ((problem.y[i] - problem.x[i] @ u @ v[:, i]) ** 2).sum() / (2 * 20)
        au, av = torch.autograd.grad(loss, (u, v))
        torch.testing.assert_close(gu[i], au)
        torch.testing.assert_close(gv[:, i], av[:, i])


def test_linear_flute_converges_from_random_init_to_the_rank_k_floor():
    """Digest §9 E1 (k = 3): from ε = 1e-3, FLUTE reaches the statistical floor ||Θ̂ - Θ_k||^2/N of the
    empirical rank-k optimum Θ̂ (found independently by alternating least squares), after a warm-up."""
    problem = make_linear_flute_problem(dim=30, num_clients=50, samples_per_client=300, noise_std=0.1, seed=0)
    optimum = empirical_rank_k_fit(problem, 3)
    theta_k = problem.best_rank(3)
    floor = float((optimum - theta_k).square().sum() / 50)
    result = linear_flute(problem, rank=3, rounds=250)
    assert result.errors[0] > 100 * floor  # starts far away (4.1 vs floor 0.027)
    assert result.errors[-1] == pytest.approx(floor, rel=1e-3)
    assert float(torch.linalg.matrix_norm(result.u @ result.v - optimum)) < 1e-3 * float(
        torch.linalg.matrix_norm(optimum)
    )
    # balanced factors at the optimum (U^T U = V V^T), as the λ = μ penalty demands
    utu, vvt = result.u.T @ result.u, result.v @ result.v.T
    assert float(torch.linalg.matrix_norm(utu - vvt)) < 1e-3 * float(torch.linalg.matrix_norm(utu))
    assert result.settled()
    # the unknown aggregation: with the mean of the U gradients, U moves N times slower (E1b)
    slow = linear_flute(problem, rank=3, rounds=250, aggregate="mean")
    assert slow.errors[-1] > 5 * floor  # measured 0.236 vs floor 0.027


def test_linear_flute_error_decreases_with_more_clients():
    """Digest §9 E2 (reduced to N = 25 vs 100): d = 30, M = 100, σ = 0.5, k = 3, s_i = √N·0.8^(i-1),
    η = 0.3/σ_1, 800 rounds. Measured: 0.0940 (N = 25) vs 0.0401 (N = 100)."""
    errors = {}
    for n in (25, 100):
        problem = make_linear_flute_problem(30, n, 100, 0.5, top_singular_value=math.sqrt(n), seed=0)
        result = linear_flute(problem, rank=3, rounds=800, lr=0.3 / math.sqrt(n))
        floor = float((empirical_rank_k_fit(problem, 3) - problem.best_rank(3)).square().sum() / n)
        assert result.errors[-1] == pytest.approx(floor, rel=1e-3)
        errors[n] = result.errors[-1]
    assert errors[100] < 0.7 * errors[25], errors


def test_linear_flute_lambda_above_mu_is_reported_unstable():
    """Digest §9 E3: λ > μ rewards growing UV; (3, 1) oscillates without settling, (1.5, 1) settles at a
    biased point; both are far from the λ = μ floor, and both warn."""
    problem = make_linear_flute_problem(dim=30, num_clients=50, samples_per_client=300, noise_std=0.1, seed=0)
    floor = linear_flute(problem, rank=3, rounds=300).errors[-1]
    with pytest.warns(UserWarning, match="lam=3.0 > mu=1.0"):
        wild = linear_flute(problem, rank=3, rounds=300, lam=3.0, mu=1.0)
    assert not wild.settled()
    assert min(wild.errors[-50:]) > 5 * floor
    with pytest.warns(UserWarning):
        biased = linear_flute(problem, rank=3, rounds=300, lam=1.5, mu=1.0)
    assert biased.errors[-1] > 5 * floor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_flute(problem, rank=3, rounds=1, lam=0.5, mu=1.0)  # λ < μ: no warning
