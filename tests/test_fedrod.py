"""FedRoD (``lightning_fedrep.federation.algorithms.fedrod``) against a plain PyTorch loop restating the rule of
PFLlib's ``clientrod.py`` (the authors' own repository releases no code): per batch, with ``f = body(x)`` and
``z_g = classifier(f)``, (a) the model takes its optimizer step (SGD, momentum 0.5, weight decay) on the balanced
softmax ``CE(z_g + log n, y)`` (``n``: the client's training label counts, ``log 0 = -inf``), (b) the client's
personalized head ``(W_p, b_p)`` takes a plain SGD step on ``CE(z_g.detach() + W_p f.detach() + b_p, y)``; the
server takes the sample-weighted mean of the whole model; personalized heads start as copies of the initial
classifier; evaluation scores ``z_g + z_p``. Rows in the loader's shuffle order
(``tests.fixtures.client_batches``)."""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import DirichletPartitioner, FederatedDataModule, FederatedStrategy, FedRoD
from lightning_fedrep.federation.algorithms.fedrod import client_label_counts
from lightning_fedrep.federation.api.objective import StepView, pure_loss
from lightning_fedrep.federation.module.split import ParameterSplit
from tests.fixtures import client_batches, quiet_trainer, reference_clients, tiny_datasets
from tests.test_ditto import _xy
from tests.test_engine_equivalence import LossNet

NUM_CLIENTS, PER_ROUND, SEED, ROUNDS, LOCAL_EPOCHS, DATA_SEED, CLASSES = 3, 2, 4, 2, 2, 3, 4
HEAD = ("classifier.weight", "classifier.bias")


def datamodule(batch_size=256):
    """Clients of unequal sizes and skewed labels (Dirichlet 0.3: some client lacks a class); ``batch_size=64``
    gives them several steps of different counts (lockstep lanes that idle) and padded last batches."""
    train, test = tiny_datasets(seed=DATA_SEED)
    partitioner = DirichletPartitioner(NUM_CLIENTS, alpha=0.3, min_samples_per_client=60)
    return FederatedDataModule(train, test, partitioner=partitioner, batch_size=batch_size, seed=DATA_SEED)


def _features(model, x):
    return model.body(x)


def _local(init, w, head, batches, counts):
    """The client's steps, PFLlib's order: the generic step through the module's optimizer, then the
    personalized head by plain SGD on the pre-step features and generic logits."""
    model = copy.deepcopy(init)
    model.load_state_dict(w, strict=False)
    optimizer = model.configure_optimizers()
    lr = optimizer.param_groups[0]["lr"]
    head = {n: t.clone() for n, t in head.items()}
    for x, y in batches:
        n = torch.bincount(y, minlength=CLASSES).float() if counts is None else counts  # None: the batch's
        log_n = n.log()  # -inf for an absent class, as PFLlib
        rep = _features(model, x)
        out_g = model.classifier(rep)
        optimizer.zero_grad()
        F.cross_entropy(out_g + log_n, y).backward()
        optimizer.step()
        wp, bp = (head[n].clone().requires_grad_() for n in HEAD)
        loss = F.cross_entropy(out_g.detach() + F.linear(rep.detach(), wp, bp), y)
        gw, gb = torch.autograd.grad(loss, [wp, bp])
        head = {HEAD[0]: head[HEAD[0]] - lr * gw, HEAD[1]: head[HEAD[1]] - lr * gb}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, head


def plain_fedrod(init, dm, batch_counts=False):
    """The global model and every client's personalized head; ``batch_counts``: ``n`` counts each batch's
    labels (``label_counts=None``), else the client's training set."""
    w = {n: p.detach().clone() for n, p in init.named_parameters()}
    heads = {c: {n: w[n].clone() for n in HEAD} for c in range(NUM_CLIENTS)}
    counts = {c: torch.bincount(_xy(dm, c)[1], minlength=CLASSES).float() for c in range(NUM_CLIENTS)}
    if batch_counts:
        counts = dict.fromkeys(counts)
    for r in range(ROUNDS):
        total, weight = {n: torch.zeros_like(t) for n, t in w.items()}, 0
        for client in reference_clients(NUM_CLIENTS, PER_ROUND, SEED, r):
            size = len(dm.client_data(client))
            steps = LOCAL_EPOCHS * math.ceil(size / dm.batch_size)
            batches = list(client_batches(dm, DATA_SEED, r, client, steps))
            trained, heads[client] = _local(init, w, heads[client], batches, counts[client])
            for n in w:
                total[n] += size * trained[n]
            weight += size
        w = {n: t / weight for n, t in total.items()}
    return w, heads


def fit(algorithm, runner="auto", batch_size=256, model=None, callbacks=(), **strategy_args):
    torch.manual_seed(0)
    init = model or LossNet()
    strategy_args.setdefault("head", "classifier")
    dm = datamodule(batch_size)
    strategy = FederatedStrategy(
        algorithm=algorithm,
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner=runner,
        **strategy_args,
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0, callbacks=list(callbacks)
    )
    model = copy.deepcopy(init)
    trainer.fit(model, datamodule=dm)
    dm.setup()
    return strategy, init, dm, trainer, model


def _assert_equal(strategy, w, heads):
    for name, value in w.items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for client in range(NUM_CLIENTS):
        for name in HEAD:
            got = strategy.federation.store.client_state(client)[f"phead.{name}"]
            torch.testing.assert_close(got, heads[client][name], rtol=1e-5, atol=1e-6, msg=(client, name))


def test_the_data_has_a_client_without_some_class():
    """The golden tests exercise the balanced softmax's absent classes (``log 0``)."""
    dm = datamodule()
    dm.setup()
    assert (client_label_counts(dm, CLASSES) == 0).any()


@pytest.mark.parametrize("counts", ["data", "batch", "table"])
def test_fedrod_equals_a_plain_loop(counts):
    """Golden test (full-batch clients, so the batch's label counts are the client's, whichever ``label_counts``):
    the global model and every client's personalized head. Fails without the balanced softmax's shift
    (``generic`` returning ``loss(full, ...)``), if the personalized head's gradient is taken at ``W_p`` alone
    (``summed = personal``), or if the personalized head is never written (``client_state={}``)."""
    dm = datamodule()
    dm.setup()
    label_counts = client_label_counts(dm, CLASSES) if counts == "table" else counts
    strategy, init, dm, *_ = fit(FedRoD(label_counts=label_counts), runner="sequential")
    _assert_equal(strategy, *plain_fedrod(init, dm))


@pytest.mark.parametrize("counts", ["data", "batch"])
def test_the_lockstep_runner_equals_the_plain_loop(counts):
    """The rule inside the lockstep runner's ``vmap`` on zero-padded batches of 64 (unequal step counts), with
    each client's training label counts read from the data at set-up (``view.client`` indexes the table) or each
    batch's (its real rows). Fails if the table row is not the client's (``[0]`` for ``[view.client]``), if the
    set-up reads another split (``"test"`` in ``client_label_counts``), or if the batch counts include the padded
    rows (``rows if view.mask is None else ...`` replaced by ``rows``)."""
    lockstep, init, dm, *_ = fit(FedRoD(label_counts=counts), runner="vectorized", batch_size=64)
    assert lockstep.runner_report.runner == "vectorized"
    _assert_equal(lockstep, *plain_fedrod(init, dm, batch_counts=counts == "batch"))


def test_evaluation_scores_the_summed_logits_of_both_heads():
    """The logged test accuracy and ``client_state_dict`` are the plain two-head model's: ``argmax(z_g + z_p)``
    with the global model and the client's personalized head. Fails if the mixture scores the personalized
    head alone (``{n: p ...}``) or the global model alone (``mix`` returning ``{}``)."""
    strategy, init, dm, trainer, model = fit(FedRoD())
    w, heads = plain_fedrod(init, dm)
    accuracies = []
    for client in range(NUM_CLIENTS):
        net = copy.deepcopy(init)
        net.load_state_dict(w, strict=False)
        x, y = _xy(dm, client, "test")
        with torch.no_grad():
            rep = net.body(x)
            logits = net.classifier(rep) + F.linear(rep, *(heads[client][n] for n in HEAD))
        accuracies.append((logits.argmax(1) == y).double().mean().item())
        scored = strategy.client_state_dict(client)
        for n in HEAD:
            expected = w[n] + heads[client][n]
            torch.testing.assert_close(scored[n], expected, rtol=1e-5, atol=1e-6, msg=(client, n))
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert abs(metrics["test/acc"] - sum(accuracies) / NUM_CLIENTS) < 1e-6


def test_fedrod_by_name_reads_the_label_counts_from_the_data():
    from lightning_fedrep.federation.api.registry import ALGORITHMS

    algorithm = ALGORITHMS["fedrod"]
    assert isinstance(algorithm, FedRoD) and algorithm.label_counts == "data" and algorithm.needs_split


@pytest.mark.parametrize(
    "counts, error",
    [
        ([[1.0, 2.0]], TypeError),
        (None, TypeError),
        (torch.ones(3), TypeError),
        (torch.tensor([[1.0, -1.0]]), ValueError),
        ("labels", ValueError),
    ],
)
def test_bad_label_counts_name_the_argument(counts, error):
    with pytest.raises(error, match="label_counts"):
        FedRoD(label_counts=counts)


@pytest.mark.parametrize("runner", ["sequential", "vectorized"])
@pytest.mark.parametrize(
    "shape, message", [((NUM_CLIENTS, 3), r"3 columns.*4 classes"), ((2, CLASSES), r"2 rows.*3 clients")]
)
def test_label_counts_of_another_shape_are_refused(shape, message, runner):
    with pytest.raises(ValueError, match=rf"label_counts.*{message}"):
        fit(FedRoD(label_counts=torch.ones(shape)), runner=runner)


class TwoLayerHead(LossNet):
    """A head of two linear layers (``head="top"``), which FedRoD refuses."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Identity()
        self.top = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, CLASSES))

    def forward(self, x):
        return self.top(self.body(x))


class BiaslessHead(LossNet):
    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(8, CLASSES, bias=False)


@pytest.mark.parametrize("model, head", [(TwoLayerHead, "top"), (BiaslessHead, "classifier")])
def test_a_head_that_is_not_one_linear_layer_with_a_bias_is_refused_at_setup(model, head):
    """Refused before any step (``RefuseAtStep`` would see a step). Fails without ``FedRoD.setup``'s check (or
    if the strategy does not call ``algorithm.setup``)."""
    with pytest.raises(ValueError, match="one linear layer with a bias"):
        fit(FedRoD(), runner="sequential", model=model(), head=head, callbacks=[RefuseAtStep()])


class RefuseAtStep(Callback):
    def on_train_batch_start(self, *args):
        raise AssertionError("a step ran before the refusal")


def test_label_counts_from_the_data_need_a_federated_data_module():
    module = LossNet()
    split = ParameterSplit(head=HEAD, body=tuple(n for n, _ in module.named_parameters() if n not in HEAD))
    with pytest.raises(ValueError, match=r"label_counts='data'.*FederatedDataModule"):
        FedRoD().setup(module, split, None)


def test_a_module_without_a_head_split_is_refused_at_setup():
    """FedRoD needs the head (``needs_split``): without ``head=`` nor ``fedrep_head`` the set-up refuses."""
    from lightning_fedrep.federation.module.split import SplitError

    with pytest.raises(SplitError, match="head="):
        fit(FedRoD(), runner="sequential", head=None)


def test_a_padded_row_labelled_with_an_absent_class_changes_nothing():
    """The step rule on a batch with a masked-out row (lockstep padding) labelled with a class the client lacks
    equals the rule on the real rows alone (every row real). Fails if an absent class's ``log n`` is ``-inf``
    (``ABSENT = float("-inf")``: the padded row's loss is ``inf * 0 = NaN``)."""
    torch.manual_seed(0)
    module = LossNet()
    tensors = {n: p.detach() for n, p in module.named_parameters()}
    state = {f"phead.{n}": tensors[n].clone() for n in HEAD}
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 1, 0, 3])  # class 3 only on the padded row
    counts = torch.tensor([[2.0, 2.0, 0.0, 0.0]])

    def run(rows, mask):
        view = StepView(
            tensors, tensors, {}, torch.tensor(0), "all", 0, 0, lr=0.1, mask=mask, client_state=state
        )
        loss = pure_loss(module, lambda z, t: F.cross_entropy(z, t, reduction="none"))
        return FedRoD(label_counts=counts)._step(loss, view, x[rows], y[rows])

    padded, real = run(slice(None), torch.tensor([1.0, 1, 1, 1, 0])), run(slice(0, 4), None)
    torch.testing.assert_close(padded.loss, real.loss)
    for got, expected in ((padded.grads, real.grads), (padded.client_state, real.client_state)):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], msg=name)


def test_fedrod_on_two_processes_equals_the_same_run_on_one(tmp_path_factory):
    """FedRoD (``tests/scripts/algorithms_run.py``), 2 rounds, every client: the global model, every client's
    personalized head (written by the step rule at every step), the label counts read at set-up on each process
    and the validation accuracy scored on the two heads, on 2 processes, equal the 1-process run. Fails when a
    client's personalized head stays on the rank that trained it, or a rank reads another client's counts."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # one 2-process launch shared with other test files
    single = singles["fedrod"]
    assert len({float(sum(t.sum() for t in tensors.values())) for tensors in single["declared"].values()}) > 1
    for held in (rank["fedrod"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)
        for client, tensors in single["declared"].items():
            for name, value in tensors.items():
                torch.testing.assert_close(held["declared"][client][name], value, rtol=1e-6, atol=1e-7)
