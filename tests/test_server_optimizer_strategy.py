"""``FederatedStrategy(server_optimizer=...)``: a server optimizer composed with the strategy's algorithm from
its settings (a registered name or a ``ServerOptimizer``), so a recipe YAML can say FedRep + FedAdam.

The setting runs exactly what ``algorithm.with_server_optimizer(...)`` runs (same seed: every global tensor,
client and optimizer state equal bit for bit), and, by name on FedPer, what the plain FedOpt loop of
``tests/test_fedopt.py`` computes; through the command with a YAML config too (the digits recipe
``recipes/digits/fedrep_fedadam.yaml`` against the same run built in Python), resumed from a checkpoint to the
uninterrupted run's result; bad settings are refused at construction, naming the setting.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedrep import (
    CHECKPOINT_KEY,
    SERVER_OPTIMIZERS,
    FedAdagrad,
    FedAdam,
    FederatedDDPStrategy,
    FederatedStrategy,
    FedRep,
    FedYogi,
    register_server_optimizer,
)
from lightning_fedrep.app.cli import build_cli
from lightning_fedrep.data.digits import DigitsDataModule
from lightning_fedrep.models import MLPClassifier
from tests.fixtures import quiet_trainer
from tests.test_engine_equivalence import LossNet
from tests.test_fedopt import (
    HEAD,
    LOCAL_EPOCHS,
    PER_ROUND,
    SEED,
    assert_matches,
    full_batch_datamodule,
    plain_fedopt,
)

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits" / "fedrep_fedadam.yaml"


def fit_fedrep(rounds=3, trainer_kwargs=None, ckpt_path=None, **settings):
    """FedRep (2 head epochs, 1 body epoch, 4 of 6 clients a round) on the full-batch federation, from the same
    initial model every call; on the sequential runner (``"auto"`` chooses by a timing, and the runners agree
    to rounding only, while these comparisons are exact)."""
    torch.manual_seed(0)
    init = LossNet()
    strategy = FederatedStrategy(
        clients_per_round=PER_ROUND,
        seed=SEED,
        head_epochs=2,
        body_epochs=1,
        head="classifier",
        runner="sequential",
        **settings,
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, limit_val_batches=0, **(trainer_kwargs or {})
    )
    trainer.fit(copy.deepcopy(init), datamodule=full_batch_datamodule(), ckpt_path=ckpt_path)
    return strategy


def assert_same_run(a, b):
    """Every global tensor, every client's state and every server tensor (m, v, the step count) equal."""
    for name, value in a.global_tensors().items():
        torch.testing.assert_close(b.global_tensors()[name], value, rtol=0, atol=0, msg=name)
    assert a.federation.server_tensors.keys() == b.federation.server_tensors.keys()
    for name, value in a.federation.server_tensors.items():
        torch.testing.assert_close(b.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for client in range(6):
        for name, value in a.client_state_dict(client).items():
            torch.testing.assert_close(b.client_state_dict(client)[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "setting, optimizer",
    [(FedAdam(lr=0.05), FedAdam(lr=0.05)), ("fedyogi", FedYogi())],
    ids=["object", "name"],
)
def test_the_setting_runs_the_composed_algorithm(setting, optimizer):
    """``algorithm="fedrep", server_optimizer=...`` equals ``algorithm=FedRep().with_server_optimizer(...)``
    (a ServerOptimizer object, or a registered name standing for the optimizer with its defaults), and it is
    named as the composition is. Fails if the setting is ignored, attached to another algorithm or built with
    other settings than the name's."""
    composed = fit_fedrep(algorithm=FedRep().with_server_optimizer(optimizer))
    from_setting = fit_fedrep(algorithm="fedrep", server_optimizer=setting)
    assert from_setting.algorithm.name == composed.algorithm.name == f"fedrep_{optimizer.name}"
    assert repr(from_setting.algorithm.server_optimizer) == repr(optimizer)
    assert int(from_setting.federation.server_tensors["fedopt_steps"]) == 3
    assert_same_run(composed, from_setting)
    plain = fit_fedrep(algorithm="fedrep")
    assert any(
        not torch.equal(plain.global_tensors()[k], t) for k, t in from_setting.global_tensors().items()
    )


def test_fedper_with_fedadam_by_name_equals_the_plain_loop():
    """Against the independent reference: ``algorithm="fedper", server_optimizer="fedadam"`` gives the body,
    m and v of the plain FedOpt loop (FedAdam η 0.1, the paper's start) stepping only FedPer's shared body."""
    torch.manual_seed(0)
    init, dm = LossNet(), full_batch_datamodule()
    strategy = FederatedStrategy(
        algorithm="fedper",
        server_optimizer="fedadam",
        head="classifier",
        clients_per_round=PER_ROUND,
        seed=SEED,
        local_epochs=LOCAL_EPOCHS,
        runner="sequential",
    )
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(
        copy.deepcopy(init), datamodule=dm
    )
    dm.setup()
    body = [k for k in init.state_dict() if k not in HEAD]
    expected, m, v, _ = plain_fedopt(init, dm, "adam", shared=body)
    assert_matches(strategy, expected, m, v)


def test_the_users_algorithm_object_is_not_changed():
    fedrep = FedRep()
    strategy = FederatedStrategy(algorithm=fedrep, server_optimizer="fedadagrad", head="classifier")
    assert fedrep.server_optimizer is None and fedrep.name == "fedrep"
    assert type(strategy.algorithm) is FedRep and type(strategy.algorithm.server_optimizer) is FedAdagrad
    assert strategy.algorithm.server_optimizer is not SERVER_OPTIMIZERS["fedadagrad"]  # a copy per strategy
    ddp = FederatedDDPStrategy(algorithm="fedper", server_optimizer="fedyogi")
    assert ddp.algorithm.name == "fedper_fedyogi"


def test_a_mid_round_checkpoint_resumes_to_the_same_result(tmp_path):
    """FedRep with ``server_optimizer="fedadam"``, saved every 3 steps and resumed from the middle of round 1:
    the model, every client and m, v and the step count equal the uninterrupted run's (the optimizer's state
    travels in the checkpoint's server tensors, and the resumed strategy's composed name matches the saved)."""
    settings = dict(algorithm="fedrep", server_optimizer="fedadam")
    full = fit_fedrep(**settings)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit_fedrep(trainer_kwargs={"callbacks": [saver], "enable_checkpointing": True}, **settings)
    ckpt = tmp_path / "step=15.ckpt"  # round 1 (steps 12..23: four clients of three steps), mid-round
    saved = torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]
    assert saved["algorithm"] == "fedrep_fedadam" and saved["round"]["open"]
    assert int(saved["server"]["fedopt_steps"]) == 1
    resumed = fit_fedrep(ckpt_path=ckpt, **settings)
    assert_same_run(full, resumed)


@pytest.mark.parametrize(
    "settings, error, message",
    [
        (
            {"algorithm": "local", "server_optimizer": "fedadam"},
            ValueError,
            r"FederatedStrategy\(server_optimizer=...\): algorithm 'local' shares nothing",
        ),
        (
            {"algorithm": "fedadam", "server_optimizer": FedYogi()},
            ValueError,
            r"FederatedStrategy\(server_optimizer=...\): algorithm 'fedadam' already steps with FedAdam\(lr=0.1",
        ),
        (
            {"algorithm": FedRep().with_server_optimizer(FedAdam()), "server_optimizer": "fedadam"},
            ValueError,
            r"algorithm 'fedrep_fedadam' already steps with FedAdam",
        ),
        (
            {"algorithm": "fedrep", "server_optimizer": "adam"},
            ValueError,
            r"server_optimizer=...\): Unknown server optimizer 'adam'; choose one of \['fedadagrad', 'fedadam', 'fedyogi'\]",
        ),
        (
            {"algorithm": "fedrep", "server_optimizer": torch.optim.Adam},
            TypeError,
            r"FederatedStrategy\(server_optimizer=...\) takes a registered name .* or a ServerOptimizer",
        ),
    ],
    ids=["shares-nothing", "already-by-name", "already-composed", "unknown-name", "wrong-type"],
)
def test_bad_settings_are_refused_at_construction(settings, error, message):
    with pytest.raises(error, match=message):
        FederatedStrategy(head="classifier", **settings)


def test_register_server_optimizer_refuses_bad_input():
    with pytest.raises(TypeError, match="takes a ServerOptimizer"):
        register_server_optimizer("fedadam")
    with pytest.raises(ValueError, match="'fedadam' is registered already"):
        register_server_optimizer(FedAdam())


# ----------------------------------------------------------------------------- through the command


def digits_fit_in_python(rounds: int):
    """The recipe's run written in Python: the same model, data, strategy (with
    ``FedRep().with_server_optimizer(FedAdam(lr=0.01))``) and seed, both on the vectorized runner
    (``"auto"`` chooses by a timing)."""
    L.seed_everything(0)
    model = MLPClassifier(lr=0.05, momentum=0.5, weight_decay=1e-4)
    data = DigitsDataModule(num_clients=20, classes_per_client=2, batch_size=10, seed=0)
    strategy = FederatedStrategy(
        algorithm=FedRep().with_server_optimizer(FedAdam(lr=0.01)),
        clients_per_round=0.5,
        seed=0,
        head_epochs=5,
        body_epochs=1,
        runner="vectorized",
    )
    quiet_trainer(strategy=strategy, max_epochs=rounds).fit(model, datamodule=data)
    return strategy


def test_the_recipe_yaml_composes_fedrep_with_fedadam_and_resumes(tmp_path, monkeypatch):
    """``recipes/digits/fedrep_fedadam.yaml`` (``server_optimizer: {class_path: lightning_fedrep.FedAdam,
    init_args: {lr: 0.01}}``), 2 rounds through the command, equals the run built in Python; its summary
    names the algorithm ``fedrep_fedadam``; resumed from its ``last.ckpt`` for a third round it equals 3 rounds
    in one go."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    quiet = (
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        "--trainer.strategy.runner=vectorized",
    )
    cli = build_cli(["fit", "--config", str(RECIPE), "--trainer.max_epochs=2", *quiet])
    strategy = cli.trainer.strategy
    assert strategy.algorithm.name == "fedrep_fedadam"
    assert repr(strategy.algorithm.server_optimizer) == repr(FedAdam(lr=0.01))
    assert_same_run_on_digits(digits_fit_in_python(2), strategy)
    (summary,) = Path("runs/digits").rglob("summary.json")
    assert json.loads(summary.read_text())["algorithm"] == "fedrep_fedadam"
    (last,) = Path("runs/digits").rglob("last.ckpt")
    resumed = build_cli(
        ["fit", "--config", str(RECIPE), "--trainer.max_epochs=3", *quiet, f"--ckpt_path={last}"]
    )
    assert int(resumed.trainer.strategy.federation.server_tensors["fedopt_steps"]) == 3
    assert_same_run_on_digits(digits_fit_in_python(3), resumed.trainer.strategy)


def assert_same_run_on_digits(expected, strategy):
    for name, value in expected.global_tensors().items():
        torch.testing.assert_close(strategy.global_tensors()[name], value, rtol=0, atol=0, msg=name)
    for name, value in expected.federation.server_tensors.items():
        torch.testing.assert_close(strategy.federation.server_tensors[name], value, rtol=0, atol=0, msg=name)
    for client in range(20):
        for name, value in expected.client_state_dict(client).items():
            torch.testing.assert_close(
                strategy.client_state_dict(client)[name], value, rtol=0, atol=0, msg=name
            )


def test_a_short_name_on_the_command_line_and_a_bad_one_refused(tmp_path, monkeypatch, capsys):
    """``--trainer.strategy.server_optimizer=fedyogi`` attaches FedYogi with its defaults to the recipe's FedRep;
    an unknown name stops the command (exit 2) with the setting's error and the choices, leaving no run folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    recipe = str(RECIPE.with_name("fedrep.yaml"))
    args = ["fit", "--config", recipe, "--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false"]
    cli = build_cli([*args, "--trainer.strategy.server_optimizer=fedyogi"])
    assert cli.trainer.strategy.algorithm.name == "fedrep_fedyogi"
    assert repr(cli.trainer.strategy.algorithm.server_optimizer) == repr(FedYogi())
    runs = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        build_cli([*args, "--trainer.strategy.server_optimizer=adam"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "server_optimizer=...): Unknown server optimizer 'adam'" in err
    assert "choose one of ['fedadagrad', 'fedadam', 'fedyogi']" in err
    assert sorted(tmp_path.rglob("*")) == runs
