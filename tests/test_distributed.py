"""The federated strategy on 2 CPU processes (gloo) against the same federation on 1 process.

Every run is ``tests/scripts/federated_run.py`` started as a subprocess with a timeout (Lightning's
launcher re-runs the script for rank 1; it must never re-run pytest), in its own session so that a
run that hangs is killed — it and its rank-1 child, nothing else — by its process-group id. Each rank
writes what it holds after the fit; the tests compare the global body and every client's head of the
2-process runs with the 1-process run of the same plan (uneven client sizes, so ranks idle), resume
across world sizes, and show that a dead rank or disagreeing ranks end the run with an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.scripts.launcher import run_script

REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPT = REPOSITORY / "tests" / "scripts" / "federated_run.py"
TIMEOUT = 240  # seconds per run; one run takes ~10 s on 2 idle cores


def run(out: Path, *args: str, timeout: float = TIMEOUT) -> tuple[int, str]:
    """Run the script (1 or 2 processes); its return code and its output (both ranks')."""
    return run_script(SCRIPT, ["--out", str(out), *args], out.parent, timeout)


def fit(out: Path, *args: str) -> list[dict]:
    """A run that must succeed: what each rank held after it."""
    code, output = run(out, *args)
    assert code == 0, output[-6000:]
    world = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(world)]


ENGINE_ATOL = 1e-7
"""How far the vectorized runner's tensors on 2 processes may be from one process's (its lockstep groups
differ, so float32 sums round differently: 6e-8 measured); the sequential path is compared exactly."""


def assert_same_federation(expected: dict, actual: dict, atol: float = 0.0) -> None:
    """The same global tensors, client tensors, history and per-client accuracy: bit-identical with
    ``atol=0`` (the sequential path), else tensors within ``atol`` and the history's losses within 1e-5."""
    assert actual["global"].keys() == expected["global"].keys()
    for name, tensor in expected["global"].items():
        torch.testing.assert_close(actual["global"][name], tensor, atol=atol, rtol=0.0)
    assert actual["clients"].keys() == expected["clients"].keys()
    for client, tensors in expected["clients"].items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(actual["clients"][client][name], tensor, atol=atol, rtol=0.0)
    assert [row["round"] for row in actual["history"]] == [row["round"] for row in expected["history"]]
    if atol == 0.0:
        assert actual["history"] == expected["history"]
        assert actual["val_acc"] == expected["val_acc"]
        return
    for got, want in zip(actual["history"], expected["history"]):
        assert got["val/acc"] == pytest.approx(want["val/acc"], abs=1e-9)
        assert got["val/loss"] == pytest.approx(want["val/loss"], abs=1e-5)
    assert actual["val_acc"] == pytest.approx(expected["val_acc"], abs=1e-9)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def fedrep_reference(runs) -> dict:
    """FedRep, 4 rounds, on one process (the plain strategy)."""
    (single,) = fit(runs / "fedrep_one", "--devices", "1", "--rounds", "4")
    return single


@pytest.fixture(scope="module")
def engine_two(runs) -> list[dict]:
    """FedRep, 4 rounds, on the vectorized runner on two processes (what each rank held)."""
    return fit(runs / "fedrep_two", "--devices", "2", "--rounds", "4", "--runner", "vectorized")


def test_two_processes_on_the_engine_equal_one_process(engine_two, fedrep_reference):
    """FedRep on the vectorized runner, clients dealt to 2 ranks (lockstep schedules of unequal length,
    so one rank idles): the body, every head and the personalized accuracy equal one process's."""
    ranks = engine_two
    for held in ranks:  # every rank holds the whole federation
        assert held["world_size"] == 2
        assert_same_federation(fedrep_reference, held, atol=ENGINE_ATOL)
    assert ranks[0]["global_step"] < fedrep_reference["global_step"]  # each rank ran only its share


def test_the_engines_train_loss_is_the_rounds_mean_over_every_rank(runs, engine_two):
    """The last round's ``train/loss`` on 2 processes is the mean over both ranks' clients (one process's value,
    the same losses to float error) on every rank. Fails if each rank logged its own clients' mean (no
    gathering in ``FederatedRun.log_round_loss``): the ranks' shares differ."""
    (single,) = fit(runs / "fedrep_engine_one", "--devices", "1", "--rounds", "4", "--runner", "vectorized")
    assert single["train_loss"] is not None
    for held in engine_two:
        assert held["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)


FEDAVG_FT = ("--algorithm", "fedavg", "--clients-per-round", "0.5", "--rounds", "3", "--finetune", "full")


@pytest.fixture(scope="module")
def fedavg_reference(runs) -> dict:
    """FedAvg with half the clients per round, then full fine-tuning, on one process."""
    (single,) = fit(runs / "fedavg_one", "--devices", "1", *FEDAVG_FT)
    assert "finetune" in single["results"]
    return single


@pytest.mark.parametrize("client_store", ["replicated", "sharded"])
def test_fedavg_with_partial_participation_and_fine_tuning_on_two_processes_equals_one(
    runs, fedavg_reference, client_store
):
    """FedAvg sampling half of the clients each round, then a full fine-tuning round of every client
    (sharded like a training round, nothing aggregated), sequential path: the same on 1 and 2 processes,
    whether every rank holds every client or each holds its own (and lends them to the rank training them)."""
    single = fedavg_reference
    ranks = fit(
        runs / f"fedavg_two_{client_store}", "--devices", "2", "--client-store", client_store, *FEDAVG_FT
    )
    if client_store == "sharded":
        assert [held["held"] for held in ranks] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for held in ranks:
        assert_same_federation(single, held)
        assert held["results"]["finetune"] == single["results"]["finetune"]
        # the fine-tuned models' per-client values, apart from the last federated round's ``val_acc``
        assert len(held["finetune_val_acc"]) == 8 and held["finetune_val_acc"] == single["finetune_val_acc"]
        # fine-tuned bodies differ per client: each rank received the others' fine-tuned tensors
        bodies = [held["clients"][c]["body.0.weight"] for c in held["clients"]]
        assert not torch.equal(bodies[0], bodies[1])


def test_a_two_process_checkpoint_resumes_on_one_process(runs, fedrep_reference):
    fit(runs / "two_first", "--devices", "2", "--rounds", "2", "--save", str(runs / "two.ckpt"))
    (resumed,) = fit(
        runs / "one_after_two", "--devices", "1", "--rounds", "4", "--resume", str(runs / "two.ckpt")
    )
    assert_same_federation(fedrep_reference, resumed)


def test_a_one_process_checkpoint_resumes_on_two_processes(runs, fedrep_reference):
    fit(runs / "one_first", "--devices", "1", "--rounds", "2", "--save", str(runs / "one.ckpt"))
    for held in fit(
        runs / "two_after_one", "--devices", "2", "--rounds", "4", "--resume", str(runs / "one.ckpt")
    ):
        assert_same_federation(fedrep_reference, held)


@pytest.mark.parametrize("engine,step", [("vectorized", 15), ("sequential", 20)])
def test_a_mid_round_checkpoint_resumes_on_as_many_processes_and_is_refused_on_others(
    runs, fedrep_reference, engine, step
):
    """Each rank's open round is saved (its clients finished in the round, its optimizer state, its
    RNG): resumed on 2 processes it continues exactly; on 1 process it is refused with the reason (a
    round-end checkpoint resumes anywhere). Sequential, step 20 of 42: each rank has finished clients
    that only it holds until the round closes."""
    out = runs / f"mid_{engine}"
    fit(out, "--devices", "2", "--rounds", "2", "--runner", engine, "--save-every", str(step))
    checkpoint = Path(f"{out}_ckpt") / f"step={step}.ckpt"  # rounds of 21 lockstep / 42 client steps
    saved = torch.load(checkpoint, weights_only=False)["lightning_fedrep"]
    assert saved["round"]["open"]
    if engine == "sequential":
        assert all(rank["records"] for rank in saved["ranks"])
    ranks = fit(
        runs / f"mid_resumed_{engine}",
        "--devices",
        "2",
        "--rounds",
        "4",
        "--runner",
        engine,
        "--resume",
        str(checkpoint),
    )
    for held in ranks:
        assert_same_federation(fedrep_reference, held, atol=ENGINE_ATOL if engine == "vectorized" else 0.0)
    if engine == "sequential":
        return
    code, output = run(
        runs / "mid_on_one",
        "--devices",
        "1",
        "--rounds",
        "4",
        "--runner",
        "vectorized",
        "--resume",
        str(checkpoint),
    )
    assert code != 0
    assert "saved inside round 0 by 2 process(es), but this run has 1" in output


def test_a_killed_rank_makes_the_other_fail_with_a_message(runs):
    """Rank 1 is killed (SIGKILL) as round 1 starts: rank 0 fails within the timeout, saying why. Either the
    federation's collective says so, or Lightning's launcher, whose child-process observer (polling every few
    seconds) may find the dead rank first and stop rank 0 with its own message naming it; never a hang."""
    code, output = run(
        runs / "killed", "--devices", "2", "--rounds", "3", "--kill-rank", "1", "--timeout", "30", timeout=120
    )
    assert code != 0
    ours = "another process of this federated run stopped" in output
    launchers = "terminated with code -9. Forcefully terminating all other processes" in output
    assert ours or launchers, output[-2000:]
    assert not Path(f"{runs / 'killed'}.rank0.pt").exists()


def test_ranks_that_disagree_on_the_plan_fail_together(runs):
    """A callback that plans differently on rank 1: both ranks stop at the round's first step with an
    error naming the disagreement (never a hang)."""
    code, output = run(runs / "disagree", "--devices", "2", "--rounds", "2", "--disagree", timeout=120)
    assert code != 0
    assert "The 2 processes disagree on the plan of round 0" in output


def test_latency_based_participation_agrees_across_ranks(runs):
    """SRPFL participation measures each client's step time on the rank that trains it; the round's
    results hold every rank's clients, so both ranks choose the same clients every round (a
    disagreement would stop the run) and end holding the same federation."""
    first, second = fit(runs / "adaptive", "--devices", "2", "--rounds", "4", "--adaptive")
    assert first["participants"] == second["participants"] == [2, 4, 8, 8]
    assert_same_federation(first, second, atol=0.0)


def test_the_throughput_benchmark_runs_end_to_end():
    """``benchmarks/distributed/throughput.py --small``: both process counts train and report their balance."""
    script = REPOSITORY / "benchmarks" / "distributed" / "throughput.py"
    process = subprocess.run(
        [sys.executable, str(script), "--small", "--timeout", "200"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    rows = [line.split() for line in process.stdout.splitlines() if line.strip()[:1] in ("1", "2")]
    assert [row[0] for row in rows] == ["1", "2"]
    assert rows[1][1] == "vectorized" and rows[1][4].endswith("x")


def test_a_sharded_store_trains_resumes_and_checkpoints_the_whole_federation(runs, fedrep_reference):
    """client_store='sharded': each rank holds only its clients (c % 2) and lends them for the round to
    the rank training them; a mid-round checkpoint (each rank's borrowed clients in its open round)
    resumes exactly on 2 processes, and the round-end checkpoint rank 0 wrote holds every client and
    resumes on 1 process."""
    out = runs / "sharded"
    sharded = ("--devices", "2", "--runner", "vectorized", "--client-store", "sharded")
    first = fit(out, *sharded, "--rounds", "2", "--save-every", "15", "--save", str(runs / "sharded.ckpt"))
    assert [held["held"] for held in first] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    saved = torch.load(runs / "sharded.ckpt", weights_only=False)["lightning_fedrep"]["clients"]
    assert sorted(saved["local"]) == list(range(8))
    middle = Path(f"{out}_ckpt") / "step=15.ckpt"
    for held in fit(runs / "sharded_mid", *sharded, "--rounds", "4", "--resume", str(middle)):
        assert held["held"] in ([0, 2, 4, 6], [1, 3, 5, 7])
        assert_same_federation(fedrep_reference, held, atol=ENGINE_ATOL)
    (one,) = fit(
        runs / "sharded_on_one", "--devices", "1", "--rounds", "4", "--resume", str(runs / "sharded.ckpt")
    )
    assert_same_federation(fedrep_reference, one, atol=ENGINE_ATOL)


def test_a_sharded_store_refuses_callbacks_that_read_every_client(runs):
    code, output = run(
        runs / "sharded_needy",
        "--devices",
        "2",
        "--client-store",
        "sharded",
        "--reads-every-client",
        timeout=120,
    )
    assert code != 0
    assert "ReadsEveryClient read(s) every client's state on every process" in output


def test_a_recipe_on_two_processes_through_the_command_writes_its_outputs_once(tmp_path):
    """The command of docs/distributed.md: a recipe run on 2 processes by naming the DDP class, W&B offline. One
    ``summary.json`` and one W&B run (rank 0's), every client in the per-client table."""
    command = [
        sys.executable,
        "-m",
        "lightning_fedrep.app.cli",
        "fit",
        "--config",
        str(REPOSITORY / "recipes" / "digits" / "fedrep.yaml"),
        "--trainer.strategy.class_path=lightning_fedrep.FederatedDDPStrategy",
        "--trainer.devices=2",
        "--trainer.max_epochs=3",
        "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "WANDB_MODE": "offline"}
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(process.communicate()[0][-4000:])
    assert process.returncode == 0, output[-6000:]
    summaries = list(tmp_path.rglob("summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["rounds_completed"] == 3
    assert len(summary["per_client"]["val"]["val/acc"]) == 20
    assert len(list((summaries[0].parent / "wandb").glob("offline-run-*"))) == 1
    assert (
        len(list((tmp_path / "runs" / "digits" / "digits-fedrep").iterdir())) == 1
    )  # both ranks: one folder
    assert output.count("Per-client val/acc (20 clients)") == 1


def test_every_rank_starts_from_rank_0s_module(runs, fedrep_reference):
    """Each rank initializes its module with another seed (no seed_everything shared): the strategy
    gives every rank rank 0's module before the federation takes its snapshot, so the run is the
    one-process run from rank 0's initialization."""
    for held in fit(runs / "unseeded", "--devices", "2", "--rounds", "4", "--seed-by-rank"):
        assert_same_federation(fedrep_reference, held)


def test_manual_optimization_on_several_processes_is_refused(runs):
    code, output = run(runs / "manual", "--devices", "2", "--manual", timeout=120)
    assert code != 0
    assert "FederatedDDPStrategy cannot run with manual optimization" in output
