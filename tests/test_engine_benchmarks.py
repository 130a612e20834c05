"""The engine benchmarks compare the same computation (checked here at a tiny size; no timing
assertions) and run end to end at a reduced size."""

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "engine"), str(BENCHMARKS)]

import auto_choice  # noqa: E402
import cifar_round  # noqa: E402
import compiled_head_phase  # noqa: E402
import device_check  # noqa: E402
import evaluation  # noqa: E402
import first_round  # noqa: E402
import official_round  # noqa: E402
import overhead  # noqa: E402
import scaling  # noqa: E402
import store_memory  # noqa: E402

from lightning_fedrep.data.digits import DigitsDataModule  # noqa: E402


def assert_tensors_close(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys() and expected
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_cifar_round_plain_fast_loop_sequential_and_vectorized_are_one_computation():
    out = cifar_round.compare(cifar_round.Workload(clients=3, samples=20, head_epochs=2))
    plain_body, plain_heads = out["plain"]
    for engine in ("sequential", "vectorized"):
        body, heads = out[engine]
        assert_tensors_close(plain_body, body)
        torch.testing.assert_close(heads, plain_heads, atol=1e-5, rtol=1e-4)
    # the official-style loop trains the same model the same way (its own shuffling): the body moved
    official = cifar_round.official_style(
        cifar_round.Workload(clients=3, samples=20, head_epochs=2),
        cifar_round.make_data(cifar_round.Workload(clients=3, samples=20, head_epochs=2)),
    )
    start = cifar_round.initial_model(cifar_round.Workload()).state_dict()
    assert official.keys() == plain_body.keys()
    assert all(not torch.equal(official[n], start[n]) for n in official)


def test_overhead_plain_vectorized_loop_is_the_engines_computation():
    dm = DigitsDataModule(num_clients=20, classes_per_client=2, batch_size=10, seed=0)
    dm.setup()
    _, plain_body = overhead.plain_vectorized_loop(dm, 2)
    _, _, engine = overhead.strategy_fit(dm, 2, "vectorized")
    _, _, sequential = overhead.strategy_fit(dm, 2, "sequential")
    assert engine.runner_report.runner == "vectorized" and sequential.runner_report.runner == "sequential"
    shared = {n: t for n, t in engine.global_tensors().items()}
    assert_tensors_close(plain_body, {n: shared[n] for n in plain_body})
    assert_tensors_close(plain_body, {n: sequential.global_tensors()[n] for n in plain_body})


@pytest.mark.parametrize("algorithm", ["fedrep", "fedavg"])
def test_scaling_variants_are_one_computation(algorithm):
    out = scaling.compare(5, algorithm)
    assert_tensors_close(out["plain"], out["sequential"])
    assert_tensors_close(out["plain"], out["vectorized"])


def test_evaluation_variants_give_the_same_per_client_metrics():
    per_batch, batched = evaluation.compare(30)
    assert per_batch.keys() == batched.keys() == set(range(30))
    for client, value in per_batch.items():
        assert batched[client] == pytest.approx(value, abs=1e-6)


def test_store_memory_fills_one_head_per_client():
    template = [torch.zeros(10, 64), torch.zeros(10)]
    store = store_memory.filled_store(5, template)
    assert sorted(store.local) == list(range(5))
    assert float(store.get(3)[0][0, 0]) == 3.0


@pytest.mark.parametrize(
    "module,argv,expected",
    [
        (cifar_round, ["--small"], "(d)/(e)  vectorized / floor"),
        (scaling, ["--small"], "cross-device"),
        (evaluation, ["--small"], "speed-up"),
        (store_memory, ["--small"], "full copies"),
        (device_check, ["--device", "cpu"], "all rows agree"),
        (compiled_head_phase, ["--small", "--rounds", "2", "--repeats", "1"], "compiled fits compiled : yes"),
    ],
    ids=["cifar_round", "scaling", "evaluation", "store_memory", "device_check", "compiled_head_phase"],
)
def test_benchmark_runs_at_a_reduced_size(module, argv, expected, capsys):
    module.main(argv)
    assert expected in capsys.readouterr().out


def test_auto_choice_runs_and_reports_each_runs_path():
    """``benchmarks/engine/auto_choice.py`` at a reduced size: every row names the path ``auto`` took in each
    run and compares it with the paired vectorized run (a smoke check of the script, not of its timings)."""
    rows = auto_choice.main(["--small", "--models", "mlp", "--runs", "1", "--threads", "1"])
    assert [(r["model"], r["algorithm"]) for r in rows] == [("mlp", "fedavg"), ("mlp", "fedrep")]
    for row in rows:
        assert len(row["auto"]) == len(row["ratios"]) == 1
        assert set(row["paths"]) <= {"seq", "lock", "lock/1"}


def test_first_round_times_each_fit_from_its_start_and_reports_autos_timing():
    """``benchmarks/engine/first_round.py`` at a reduced size: a row per fit (``auto``, then the references),
    its first round (from the call of ``Trainer.fit``: longer than its epoch), the later rounds' median, the
    ratio, the path and ``auto``'s timing line (a smoke check of the script, not of its timings)."""
    rows = first_round.main(["--small", "--model", "mlp", "--threads", "1"])
    assert [r["runner"] for r in rows] == ["auto", "sequential", "vectorized"]
    for row in rows:
        assert row["first"] > 0 and row["later"] > 0
        assert row["ratio"] == pytest.approx(row["first"] / row["later"])
        assert row["path"] in {"seq", "lock", "lock/1"}
    assert rows[0]["timing"].startswith("(one step of 10 clients measured")
    assert [r["path"] for r in rows[1:]] == ["seq", "lock"] and rows[1]["timing"] == ""


def test_official_round_names_the_argument_when_the_checkout_is_not_the_official_repository(tmp_path):
    """``official_round.py`` runs the real official code from a checkout the user passes (the suite has none:
    no network); a folder without ``main_fedrep.py`` is refused naming ``--official``."""
    with pytest.raises(SystemExit, match="--official .*not a checkout of github.com/lgcollins/FedRep"):
        official_round.load_official(tmp_path)
