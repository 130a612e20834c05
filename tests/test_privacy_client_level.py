"""Client-level DP (``FederatedStrategy(privacy=ClientLevelDP(...))``): the mechanism against closed forms.

The server step is ``start + (sum_i clip_C(upload_i - start) + N(0, (z C)^2 I)) / m`` over the shared tensors,
``m`` the planned cohort. Each test compares with a hand computation: the noise's std ``z C / m`` on a large body
with learning rate 0, the clip on every intercepted upload, the plain uniform mean without noise, the quantile
adaptive clipping settles on, the same noise after a mid-round resume and across a split over processes.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.federation.api.aggregation import ClientUpdate
from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.state import FederationConfig
from lightning_fedrep.privacy import AdaptiveClipping, ClientLevelDP, ClippedNoisyMean
from lightning_fedrep.privacy.clipping import update_noise_multiplier
from tests.fixtures import TinyNet, quiet_trainer, tiny_datamodule

try:
    import dp_accounting  # noqa: F401
    import opacus  # noqa: F401

    EXTRA = True
except ImportError:
    EXTRA = False
"""Whether the ``privacy`` extra (Opacus, dp-accounting) is installed: the accounting tests need it."""


def dp(**kwargs) -> ClientLevelDP:
    """``ClientLevelDP`` without accounting (the mechanism's tests; the ``privacy`` extra may be missing)."""
    return ClientLevelDP(**{"accountant": None, **kwargs})


WIDE = 400
"""The wide body's hidden width: 6*400 + 400 + 400*300 + 300 = 123,100 body parameters."""


class WideNet(TinyNet):
    """A body of 123,100 parameters (enough to measure a noise std within 1%) and the 4-class head."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr=lr, momentum=0.0, weight_decay=0.0)
        self.body = nn.Sequential(nn.Linear(6, WIDE), nn.ReLU(), nn.Linear(WIDE, 300), nn.ReLU())
        self.classifier = nn.Linear(300, 4)


def fit(
    model, privacy=None, rounds=1, clients=4, weighting="uniform", algorithm="fedrep", batch_size=8, **kw
):
    strategy = FederatedStrategy(
        head="classifier",
        algorithm=algorithm,
        clients_per_round=clients,
        head_epochs=1,
        weighting=weighting,
        privacy=privacy,
        seed=3,
        **kw,
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(model, datamodule=tiny_datamodule(num_clients=8, seed=1, batch_size=batch_size))
    return strategy


def rows(strategy) -> list[dict]:
    """Every round's history row (validated or not)."""
    return strategy.federation.history.rows


def body(strategy) -> dict[str, torch.Tensor]:
    return strategy.federation.global_tensors()


def test_with_learning_rate_zero_the_body_moves_by_noise_of_std_z_clip_over_m_and_no_head_changes():
    """With lr 0 every upload equals the round's start, so the new body is start + N(0, (z C / m)^2) per
    coordinate: over 123,100 coordinates the empirical std is within 1.5% of z C / m (its own sampling error is
    about 0.2%), the mean within a few standard errors of 0; every client's head is its initial one."""
    torch.manual_seed(0)
    model = WideNet(lr=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    z, clip, m = 1.3, 0.7, 4
    strategy = fit(model, dp(clip=clip, noise_multiplier=z), clients=m)
    moved = torch.cat([(t - start[n]).reshape(-1).double() for n, t in body(strategy).items()])
    assert moved.numel() == 123_100
    expected = z * clip / m
    assert moved.std().item() == pytest.approx(expected, rel=0.015)
    assert abs(moved.mean().item()) < 5 * expected / math.sqrt(moved.numel())
    for client in range(8):
        for name, value in strategy.federation.client_tensors(client).items():
            torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    assert rows(strategy)[0]["privacy/clip"] == clip


def test_every_upload_is_clipped_and_no_head_reaches_the_server(monkeypatch):
    """Intercepts what the aggregator receives: the uploads hold exactly the body's names (never the head's)
    and every clipped delta's flat norm is at most the clip, while the raw updates were larger (clipping
    bit)."""
    seen_names, raw, clipped = [], [], []
    original = ClippedNoisyMean.clipped_delta

    def spy(self, update):
        seen_names.append(set(update.upload))
        deltas, norm = original(self, update)
        raw.append(float(norm))
        clipped.append(float(torch.linalg.vector_norm(torch.stack([d.norm() for d in deltas]))))
        return deltas, norm

    monkeypatch.setattr(ClippedNoisyMean, "clipped_delta", spy)
    clip = 0.01
    strategy = fit(TinyNet(lr=0.2), dp(clip=clip, noise_multiplier=0.5), rounds=2)
    body_names = {n for n in strategy.federation.shared_names}
    assert body_names and not any(n.startswith("classifier") for n in body_names)
    assert len(seen_names) == 8 and all(names == body_names for names in seen_names)
    assert all(norm <= clip + 1e-6 for norm in clipped)
    assert max(raw) > clip  # the updates were clipped, not merely small


def test_without_noise_and_with_a_large_clip_it_is_the_plain_uniform_mean():
    """z = 0 and a clip no update reaches: the run equals the same run without privacy under uniform
    weights (start + mean of deltas = mean of uploads, up to float32 rounding)."""
    torch.manual_seed(0)
    a = TinyNet()
    b = TinyNet()
    b.load_state_dict(a.state_dict())
    private = fit(a, dp(clip=1e6, noise_multiplier=0.0), rounds=3)
    plain = fit(b, None, rounds=3)
    for name, value in body(plain).items():
        torch.testing.assert_close(body(private)[name], value, rtol=1e-5, atol=1e-6)


def updates(values: list[dict[str, torch.Tensor]], round_index: int = 0) -> list[ClientUpdate]:
    return [ClientUpdate(c, round_index, 1.0, 10, 1, v) for c, v in enumerate(values)]


def test_the_mean_divides_by_the_planned_cohort_and_integer_buffers_keep_their_start():
    """Against the closed form with hand-made uploads: new = start + sum_i clip(d_i) / m with m the planned
    cohort (5, of which 3 arrived: a failed client still counts), clip(d) = d min(1, C/|d|) over both float
    tensors together; the integer buffer is not released (keeps its start)."""
    start = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5]), "n": torch.tensor(7)}
    deltas = [torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.1, 0.2, -0.2]), torch.tensor([0.0, -6.0, 8.0])]
    uploads = [
        {"w": start["w"] + d[:2], "b": start["b"] + d[2:], "n": torch.tensor(9 + i)}
        for i, d in enumerate(deltas)
    ]
    clip = 1.0
    aggregator = dp(clip=clip, noise_multiplier=0.0).aggregator(start, 0, 0)
    aggregator.expect(5)
    for update in updates(uploads):
        aggregator.add(update)
    expected = sum(d * min(1.0, clip / d.norm().item()) for d in deltas) / 5
    result = aggregator.result()
    torch.testing.assert_close(result["w"], start["w"] + expected[:2])
    torch.testing.assert_close(result["b"], start["b"] + expected[2:])
    assert result["n"].item() == 7 and result["n"].dtype == torch.int64


def lognormal_round(mechanism, round_index, m, sigma, generator, dim=8):
    """One round driven by hand: m clients whose update norms are lognormal(0, sigma), random directions."""
    start = {"w": torch.zeros(dim)}
    aggregator = mechanism.aggregator(start, round_index, 11)
    aggregator.expect(m)
    norms = torch.exp(sigma * torch.randn(m, generator=generator, dtype=torch.float64))
    for client, norm in enumerate(norms):
        direction = torch.randn(dim, generator=generator)
        upload = {"w": (direction / direction.norm() * norm).float()}
        aggregator.add(ClientUpdate(client, round_index, 1.0, 10, 1, upload))
    aggregator.result()
    return mechanism.after_round(aggregator, round_index, 10 * m)


@pytest.mark.parametrize("quantile", [0.3, 0.8])
def test_adaptive_clipping_tracks_its_target_quantile_of_lognormal_norms(quantile):
    """Update norms lognormal(0, 0.5): the clip, started 10x below the median, settles at the distribution's
    target quantile exp(0.5 * Phi^-1(q)) (0.769 for q = 0.3, 1.523 for 0.8): the mean of log C over the last
    150 of 400 rounds is within 0.08 of log(quantile)."""
    sigma, m = 0.5, 100
    target = math.exp(sigma * torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(quantile)).item())
    mechanism = dp(
        clip=0.1, noise_multiplier=1.0, adaptive=AdaptiveClipping(target_quantile=quantile, learning_rate=0.2)
    )
    generator = torch.Generator().manual_seed(0)
    clips = [lognormal_round(mechanism, r, m, sigma, generator)["privacy/clip"] for r in range(400)]
    settled = sum(math.log(c) for c in clips[-150:]) / 150
    assert abs(settled - math.log(target)) < 0.08, (clips[-5:], target)
    assert clips[0] == 0.1


def test_the_noise_is_the_same_across_processes_and_after_a_mid_round_checkpoint():
    """The round's clients split over two 'processes' (two aggregators whose flat sums are added, as the
    all-reduce does) give the one-process result; an aggregator restored from a mid-round state_dict gives the
    uninterrupted one bit for bit (the noise is seeded by the seed and the round, not the global RNG)."""
    g = torch.Generator().manual_seed(1)
    start = {"w": torch.randn(1000, generator=g), "v": torch.randn(30, generator=g)}
    values = [{n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in start.items()} for _ in range(6)]
    mechanism = dp(clip=0.5, noise_multiplier=2.0, adaptive=AdaptiveClipping(count_noise_std=3.0))

    def aggregator():
        made = mechanism.aggregator(start, 4, 9)
        made.expect(8)
        return made

    one = aggregator()
    for update in updates(values, 4):
        one.add(update)
    expected = one.result()

    class Sum:
        def __init__(self, other):
            self.other = other

        def all_reduce_sum(self, flat):
            return flat + self.other.flat()

    first, second = aggregator(), aggregator()
    for update in updates(values, 4)[:4]:
        first.add(update)
    for update in updates(values, 4)[4:]:
        second.add(update)
    first.reduce(Sum(second))
    for name, value in first.result().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    assert first.unclipped_fraction == pytest.approx(one.unclipped_fraction)

    torch.manual_seed(123)  # the global RNG plays no part
    interrupted = aggregator()
    for update in updates(values, 4)[:3]:
        interrupted.add(update)
    resumed = aggregator()
    resumed.load_state_dict(interrupted.state_dict())
    for update in updates(values, 4)[3:]:
        resumed.add(update)
    for name, value in resumed.result().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_a_run_resumed_from_a_mid_round_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Adaptive clipping and noise through a whole fit: resuming from a mid-round checkpoint gives the
    uninterrupted run's bodies bit for bit, its clips and (with the privacy extra) its ε (the clip, the accountant
    and the open round's clipped sums are in the checkpoint)."""

    def run(root, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        strategy = FederatedStrategy(
            head="classifier",
            clients_per_round=3,
            head_epochs=1,
            weighting="uniform",
            seed=5,
            privacy=ClientLevelDP(
                clip=0.05,
                noise_multiplier=0.3,
                adaptive=AdaptiveClipping(count_noise_std=2.0),
                accountant="rdp" if EXTRA else None,
            ),
            runner="sequential",
        )
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=3,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            default_root_dir=root,
            limit_val_batches=0,
        )
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=6, seed=1), ckpt_path=ckpt_path)
        return strategy

    full = run(tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first = run(tmp_path / "a", callbacks=[saver])
    ends = set(torch.tensor([first.round_plan(r).length for r in range(3)]).cumsum(0).tolist())
    steps = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ck").glob("step=*.ckpt"))
    mid = [s for s in steps if s not in ends and s > min(ends)]
    assert mid, (steps, ends)
    resumed = run(tmp_path / "b", ckpt_path=tmp_path / "ck" / f"step={mid[0]}.ckpt")
    for x, y in zip(full.federation.global_state, resumed.federation.global_state):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    clips = [row["privacy/clip"] for row in rows(full)]
    assert clips == [row["privacy/clip"] for row in rows(resumed)]
    if (
        EXTRA
    ):  # the accountant's state is in the checkpoint: the resumed run reports the uninterrupted run's ε
        epsilons = [row["privacy/epsilon"] for row in rows(full)]
        assert epsilons == [row["privacy/epsilon"] for row in rows(resumed)]
        assert epsilons == sorted(epsilons) and epsilons[0] > 0
    assert len(set(clips)) == 3  # the clip moved every round


ACCEPTED = {
    "fedrep",
    "fedper",
    "fedavg",
    "lg_fedavg",
    "fedprox",
    "ditto",
    "apfl",
    "per_fedavg",
    "hf_maml",
    "fedrod",
    "fedbabu",
    "fedbn",
    "fedala",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "pfedme",
}
"""Built-ins whose server step reads only ``results.reduced`` with the default aggregator: FedRep, FedPer (body),
FedAvg (everything), LG-FedAvg (head) upload their shared tensors' end values; FedProx adds a local proximal
term; Ditto and APFL keep their personal model in a client slot and upload the global model's shared tensors;
Per-FedAvg and HF-MAML change only the local steps; FedRoD's personal head is a client tensor (never uploaded);
FedBABU uploads its body (trained with the head frozen); FedBN everything but its BatchNorm layers (kept local);
FedALA uploads its end model (its blend of the global model into the client's start is the client's own work);
FedAdam, FedYogi and FedAdagrad are FedAvg whose server optimizer steps from the private mean
(``tests/test_fedopt.py``); pFedMe keeps its personalized model in a client slot, uploads its local model and
mixes the (private) mean into the previous global model."""

REFUSED = {
    "local": "shares nothing",  # nothing to privatize
    "scaffold": "chooses its own aggregator",  # uploads control-variate changes dc.* beside the model
    "fedcp": "chooses its own aggregator",  # uploads its CPN and a blend of the global head (hg.*)
    "feddbe": "chooses its own aggregator",  # uploads each client's feature running mean (r_bar's source)
    "gpfl": "chooses its own aggregator",  # uploads its GCE and CoV beside the body
    "fedas": "chooses its own aggregator",  # weights each client by its Fisher trace, uploaded beside the body
    "l2gd": "chooses its own aggregator",  # an unweighted mean of its personal slot's values of its own
    "fed_mtl": "chooses its own aggregator",  # Stacked: every client's flattened weights kept apart
    "fedcac": "chooses its own aggregator",  # Stacked: every client's model and critical masks kept apart
    "fedpac": "chooses its own aggregator",  # Stacked: heads, statistics and prototypes beside the body
    "fedproto": "chooses its own aggregator",  # Stacked: every client's local class prototypes (nothing shared)
}
"""Built-ins the mechanism refuses, and why (from reading each module's ``aggregator`` and ``finish_client``)."""


BUILT_IN = sorted(n for n, a in ALGORITHMS.items() if type(a).__module__.startswith("lightning_fedrep."))
"""The package's own algorithms (other test modules register theirs in the same registry when collected)."""


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_registered_algorithm_is_accepted_or_refused_naming_why(name):
    """Every registered algorithm is in exactly one of the two tables above, and the mechanism agrees with
    it (a new algorithm must be classified here)."""
    assert (name in ACCEPTED) != (name in REFUSED), f"classify {name!r} in ACCEPTED or REFUSED"
    algorithm = ALGORITHMS[name]
    config = FederationConfig(
        phases=algorithm.default_phases(**dict.fromkeys(algorithm.epochs, 1)), weighting="uniform"
    )
    mechanism = dp(clip=1.0, noise_multiplier=1.0)
    if name in ACCEPTED:
        mechanism.check(algorithm, config)
    else:
        with pytest.raises(ValueError, match=REFUSED[name]) as refused:
            mechanism.check(algorithm, config)
        assert type(algorithm).__name__ in str(refused.value)


def test_sample_weighting_is_refused_at_construction():
    with pytest.raises(ValueError, match="weighting='uniform'"):
        FederatedStrategy(head="classifier", privacy=dp(clip=1.0, noise_multiplier=1.0))
    with pytest.raises(ValueError, match="chooses its own aggregator"):
        FederatedStrategy(
            algorithm="scaffold", weighting="uniform", privacy=dp(clip=1.0, noise_multiplier=1.0)
        )
    with pytest.raises(TypeError, match="privacy must be a mechanism"):
        FederatedStrategy(head="classifier", weighting="uniform", privacy="dp")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"clip": 1.0}, ValueError, "exactly one of noise_multiplier= .* and target_epsilon="),
        ({"clip": 1.0, "noise_multiplier": 1.0, "target_epsilon": 1.0}, ValueError, "exactly one of"),
        (
            {"clip": 0.0, "noise_multiplier": 1.0},
            ValueError,
            r"ClientLevelDP\(clip=...\) must be a number > 0",
        ),
        (
            {"clip": 1.0, "noise_multiplier": -1.0},
            ValueError,
            r"noise_multiplier=...\) must be a number >= 0",
        ),
        (
            {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1.0},
            ValueError,
            r"delta=...\) must be a number in \(0, 1\)",
        ),
        ({"clip": 1.0, "noise_multiplier": 1.0, "adaptive": 0.5}, TypeError, "must be an AdaptiveClipping"),
        (
            {"clip": 1.0, "noise_multiplier": 2.0, "adaptive": AdaptiveClipping(count_noise_std=0.2)},
            ValueError,
            r"count's noise must have std > 1 / \(2 \* noise_multiplier\) = 0.25",
        ),
        ({"clip": 1.0, "target_epsilon": 1.0}, ValueError, r"pass rounds= \(the Trainer's max_epochs\)"),
        (
            {"clip": 1.0, "target_epsilon": 1.0, "rounds": 5, "accountant": None},
            ValueError,
            "solves the noise for a number of rounds with an accountant",
        ),
        ({"clip": 1.0, "noise_multiplier": 0.0}, ValueError, "its epsilon is infinite"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "accountant": "gdp"}, ValueError, "accountant"),
        (
            {"clip": 1.0, "noise_multiplier": 1.0, "rounds": 0},
            ValueError,
            r"rounds=...\) must be an integer >= 1",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, message):
    if "accountant" not in kwargs and "noise_multiplier" in kwargs and kwargs.get("noise_multiplier") != 0.0:
        kwargs = {**kwargs, "accountant": None}  # the refusal comes before any accountant is built
    with pytest.raises(error, match=message):
        ClientLevelDP(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_quantile": 1.0}, r"target_quantile=...\) must be a number in \(0, 1\)"),
        ({"learning_rate": 0.0}, r"learning_rate=...\) must be a number > 0"),
        ({"count_noise_std": -1.0}, r"count_noise_std=...\) must be a number > 0"),
    ],
)
def test_bad_adaptive_clipping_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveClipping(**kwargs)


def test_the_update_noise_multiplier_folds_in_the_count_noise():
    """Andrew et al.: z_update = (z^-2 - (2 sigma_b)^-2)^-1/2; the default count noise is the cohort / 20, and a
    cohort too small for it is refused when the round opens."""
    assert update_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 0.01) ** -0.5)
    assert update_noise_multiplier(0.0, 5.0) == 0.0
    aggregator = dp(clip=1.0, noise_multiplier=1.0, adaptive=AdaptiveClipping()).aggregator(
        {"w": torch.zeros(3)}, 0, 0
    )
    aggregator.expect(100)
    assert aggregator.update_noise_multiplier() == pytest.approx((1 - 0.01) ** -0.5)
    with pytest.raises(ValueError, match="leaves the update no budget"):
        aggregator.expect(10)  # count noise std 0.5 <= 1 / (2 z)


def test_an_upload_beyond_the_shared_tensors_is_refused():
    aggregator = dp(clip=1.0, noise_multiplier=1.0).aggregator({"w": torch.zeros(3)}, 0, 0)
    aggregator.expect(2)
    with pytest.raises(ValueError, match=r"uploaded \['dc.w'\], which are not shared tensors"):
        aggregator.add(ClientUpdate(0, 0, 1.0, 10, 1, {"w": torch.ones(3), "dc.w": torch.ones(3)}))


class BatchNormNet(TinyNet):
    """TinyNet with a BatchNorm in its body (trained on whole-client batches: one batch per client)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU()
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_shared_batchnorm_statistics_are_privatized_and_its_counter_is_not_released():
    """buffers='shared': the running statistics move with the (clipped, noised) body; num_batches_tracked is not
    released, so the global counter stays at its initial 0 while every client's training counted batches."""
    strategy = fit(
        BatchNormNet(),
        dp(clip=0.5, noise_multiplier=0.1),
        rounds=2,
        buffers="shared",
        batch_size=1000,
    )
    shared = body(strategy)
    assert "body.1.running_mean" in shared and "body.1.num_batches_tracked" in shared
    assert shared["body.1.num_batches_tracked"].item() == 0
    assert not torch.equal(shared["body.1.running_mean"], torch.zeros(12))


def test_a_recipe_gives_the_mechanism_as_a_class_path(tmp_path, monkeypatch):
    """The command builds ``privacy`` (and its adaptive clipping) from a recipe's class_path/init_args."""
    from tests.test_cli import run_cli, write_recipe

    monkeypatch.chdir(tmp_path)
    privacy = {
        "class_path": "lightning_fedrep.privacy.ClientLevelDP",
        "init_args": {
            "clip": 0.5,
            "noise_multiplier": 0.8,
            "accountant": None,
            "adaptive": {
                "class_path": "lightning_fedrep.privacy.AdaptiveClipping",
                "init_args": {"target_quantile": 0.7, "count_noise_std": 2.0},
            },
        },
    }
    recipe = write_recipe(tmp_path, privacy=privacy, weighting="uniform")
    cli = run_cli("fit", "--config", str(recipe), "--trainer.fast_dev_run=true")
    mechanism = cli.trainer.strategy.config.privacy
    assert isinstance(mechanism, ClientLevelDP) and mechanism.noise_multiplier == 0.8
    assert mechanism.adaptive.target_quantile == 0.7
    assert "privacy/clip" in cli.trainer.strategy.federation.history.rows[0]


needs_extra = pytest.mark.skipif(
    not EXTRA, reason="the privacy extra (Opacus, dp-accounting) is not installed"
)


@needs_extra
def test_a_target_epsilon_is_met_over_the_planned_rounds_and_epsilon_is_reported_every_round():
    """ε 4 at δ 1e-5 over 3 rounds of 4 of 8 clients: the noise multiplier is the accountant's own solution for
    fixed-size sampling without replacement (population 8, rate 1/2, 3 steps), every round's privacy/epsilon is
    what an accountant stepped by hand reports, and the last one is at most (and close to) the target."""
    from lightning_fedrep.privacy import PrivacyAccountant

    strategy = fit(TinyNet(), ClientLevelDP(clip=0.1, target_epsilon=4.0, rounds=3), rounds=3)
    reference = PrivacyAccountant("rdp", "without_replacement", population=8)
    sigma = reference.noise_multiplier_for(4.0, 1e-5, 0.5, 3)
    history = rows(strategy)
    assert [row["privacy/noise_multiplier"] for row in history] == [sigma] * 3
    for row in history:
        reference.step(noise_multiplier=sigma, sample_rate=0.5)
        assert row["privacy/epsilon"] == pytest.approx(reference.epsilon(1e-5), rel=1e-12)
    assert 3.9 < history[-1]["privacy/epsilon"] <= 4.0


@needs_extra
def test_rounds_on_every_client_are_the_gaussian_mechanism_and_a_round_beyond_the_budget_is_refused():
    """Every client every round: no sampling, accounted as Poisson at rate 1 (add/remove one client, CENTAUR's
    and Opacus's count); a third round under rounds=2 is refused before it trains."""
    from lightning_fedrep.privacy import PrivacyAccountant

    mechanism = ClientLevelDP(clip=0.1, noise_multiplier=2.0, rounds=2, accountant="pld")
    with pytest.raises(RuntimeError, match="budget covers 2 rounds"):
        fit(TinyNet(), mechanism, rounds=3, clients=8)
    reference = PrivacyAccountant("pld", "poisson")
    reference.step(noise_multiplier=2.0, sample_rate=1.0, steps=2)
    assert mechanism.budget.accountant.epsilon(1e-5) == pytest.approx(reference.epsilon(1e-5))
    with pytest.raises(ValueError, match="cannot account rounds of 4 of 8 clients"):
        fit(TinyNet(), ClientLevelDP(clip=0.1, noise_multiplier=2.0, accountant="pld"))


def test_two_processes_draw_the_same_noise_and_equal_one(tmp_path_factory):
    """FedRep under client-level DP with adaptive clipping (``tests/scripts/algorithms_run.py``'s ``fedrep_dp``),
    2 rounds, every client: the body and every head on 2 gloo processes equal the 1-process run bit for bit, and
    the clip history too. Fails when a rank noises only its own clients' sums (before the all-reduce), draws from
    the global RNG, or divides by its own survivors."""
    from tests.scripts.algorithms_run import shared_runs
    from tests.test_distributed import assert_same_federation

    singles, ranks = shared_runs(tmp_path_factory)  # the 2-process launch shared with other test modules
    single = singles["fedrep_dp"]
    assert [row["privacy/clip"] for row in single["history"]][0] == 0.05
    for held in (rank["fedrep_dp"] for rank in ranks):
        assert held["world_size"] == 2
        assert_same_federation(single, held)


class LossNet(TinyNet):
    """TinyNet declaring its loss, so the vectorized runner may run it."""

    fedrep_loss = "cross_entropy"


def test_the_vectorized_runner_releases_what_the_sequential_runner_releases():
    """The vectorized runner hands its clients to the same aggregator: under noise and adaptive clipping, its body
    and clips equal the sequential runner's (up to float error in the local steps)."""
    runs = {}
    for runner in ("sequential", "vectorized"):
        torch.manual_seed(0)
        mechanism = dp(clip=0.05, noise_multiplier=0.5, adaptive=AdaptiveClipping(count_noise_std=1.0))
        runs[runner] = fit(LossNet(), mechanism, rounds=2, runner=runner)
    assert runs["vectorized"].runner_report.runner == "vectorized"
    for name, value in body(runs["sequential"]).items():
        torch.testing.assert_close(body(runs["vectorized"])[name], value, rtol=1e-5, atol=1e-6)
    clips = [[row["privacy/clip"] for row in rows(run)] for run in runs.values()]
    assert clips[0] == pytest.approx(clips[1], rel=1e-6)


def test_a_checkpoint_saved_without_a_mechanism_starts_it_fresh_with_a_warning():
    """Resuming a run saved without privacy under a mechanism: its earlier rounds were not private, and the
    warning says that no accountant counted them."""
    from lightning_fedrep.federation.state import FederationState

    with pytest.warns(UserWarning, match="saved without a privacy mechanism.*not private"):
        assert FederationState._privacy_state({}, "old.ckpt") == {}
    assert FederationState._privacy_state({"privacy": {"clip": 2.0}}, "new.ckpt") == {"clip": 2.0}


def test_a_checkpoint_saved_under_one_mechanism_is_refused_under_other_settings(tmp_path):
    """The mechanism's settings are part of the federation's fingerprint: resuming with another noise multiplier
    would continue the run (and its accountant) under a mechanism it was not started with."""
    from lightning_fedrep.federation import FederationMismatch

    def run(privacy, max_epochs, ckpt=None, **kwargs):
        strategy = FederatedStrategy(
            head="classifier", clients_per_round=4, head_epochs=1, weighting="uniform", privacy=privacy
        )
        trainer = quiet_trainer(strategy=strategy, max_epochs=max_epochs, limit_val_batches=0, **kwargs)
        trainer.fit(TinyNet(), datamodule=tiny_datamodule(num_clients=8, seed=1), ckpt_path=ckpt)

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, filename="{epoch}")
    run(dp(clip=0.1, noise_multiplier=0.3), 1, callbacks=[saver], enable_checkpointing=True)
    with pytest.raises(FederationMismatch, match=r"privacy 'ClientLevelDP\(clip=0.1, noise_multiplier=0.3"):
        run(dp(clip=0.1, noise_multiplier=0.5), 2, ckpt=tmp_path / "epoch=0.ckpt")
