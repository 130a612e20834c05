"""The built-in algorithms as classes (``federation/algorithms/{fedrep,fedper,lg_fedavg,fedavg,local}.py``)
and the refusal of the removed v1 ``Algorithm.aggregate(global_state, average)``.

The built-ins are checked against their definitions from before they became classes, restated here as
literals (names, registry order, shares, descriptions, repr, default phases); that they train as the
papers say is ``test_golden.py``'s (a plain PyTorch loop per algorithm), and that an algorithm's own server
step runs through the round is ``test_federation.py``'s ``ServerMomentum``.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import lightning_fedrep
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.epochs import default_phases
from lightning_fedrep.federation.api.registry import ALGORITHMS

OLD_BUILT_INS = [
    (
        "fedrep",
        "FedRep",
        {"body"},
        "FedRep: head epochs with the body frozen, then body epochs with the head frozen; "
        "the body is averaged, heads stay local.",
        "FedRep(name='fedrep', shares=['body'])",
    ),
    (
        "fedper",
        "FedPer",
        {"body"},
        "FedPer: head and body trained jointly; the body is averaged.",
        "Algorithm(name='fedper', shares=['body'])",
    ),
    (
        "lg_fedavg",
        "LGFedAvg",
        {"head"},
        "LG-FedAvg: trained jointly; the head part is averaged, the representation stays local.",
        "Algorithm(name='lg_fedavg', shares=['head'])",
    ),
    (
        "fedavg",
        "FedAvg",
        {"body", "head"},
        "FedAvg: one global model, everything averaged.",
        "Algorithm(name='fedavg', shares=['body', 'head'])",
    ),
    (
        "local",
        "Local",
        set(),
        "Local Only: no communication, every client trains alone.",
        "Algorithm(name='local', shares=[])",
    ),
]
"""(name, class, shares, description, repr) of each built-in as ``algorithms.py`` (now ``federation/api/``) registered it before."""

OLD_ORDER = ["fedrep", "fedper", "lg_fedavg", "fedavg", "local", "ditto", "fedprox", "scaffold"]


def test_built_ins_are_classes_identical_to_the_old_instances():
    """Catches a built-in that changed in the move: its name, shares, description or repr (e.g. FedPer's repr
    becoming ``FedPer(...)``), its default phases (e.g. FedRep's body phase first), or a class that is not the
    registered instance's type or not exported by the package."""
    for name, cls_name, shares, description, text in OLD_BUILT_INS:
        cls = getattr(lightning_fedrep, cls_name)
        assert cls.__module__ == f"lightning_fedrep.federation.algorithms.{name}"
        registered = ALGORITHMS[name]
        assert type(registered) is cls and issubclass(cls, Algorithm)
        for algorithm in (registered, cls()):
            assert (algorithm.name, set(algorithm.shares), algorithm.description) == (
                name,
                shares,
                description,
            )
            assert repr(algorithm) == text
            joint = (Phase("all", epochs=3),)
            split = (Phase("head", epochs=7), Phase("body", epochs=2))
            epochs = {"head_epochs": 7, "body_epochs": 2, "local_epochs": 3}
            assert default_phases(algorithm, epochs) == (split if name == "fedrep" else joint)


def test_registry_order_is_unchanged_in_a_fresh_process():
    """Catches the registration order changing (``StrategyRegistry`` listing, the command's help), e.g. the
    built-ins imported after Ditto, and ``import lightning_fedrep.federation.api.registry`` alone not registering
    them all (a circular import would fail here, in a fresh interpreter, too)."""
    code = (
        "import lightning_fedrep.federation.api.registry as a; print(','.join(a.ALGORITHMS))\n"
        "from lightning.pytorch.strategies import StrategyRegistry as R\n"
        "print(','.join(n for n in R.available_strategies() if n.split('_ddp')[0] in a.ALGORITHMS))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, strategies = out.split()
    assert names.split(",")[: len(OLD_ORDER)] == OLD_ORDER
    strategies = strategies.split(",")
    assert [n for n in strategies if not n.endswith("_ddp")][: len(OLD_ORDER)] == OLD_ORDER
    assert [n for n in strategies if n.endswith("_ddp")][: len(OLD_ORDER)] == [f"{n}_ddp" for n in OLD_ORDER]
    assert list(ALGORITHMS)[: len(OLD_ORDER)] == OLD_ORDER  # and in this process


def test_a_v1_aggregate_override_is_refused_at_construction_naming_the_port():
    """Catches a v1 ``aggregate(global_state, average)`` override that constructs (it would then fail, or
    compute a wrong number, only when the first round closes): the ``_refuse_v1_aggregate(self)`` call removed
    from ``Algorithm.__init__``, or a message that does not name the class, the removed form and the one-line
    port of the default body."""

    class MeanV1(Algorithm):
        def __init__(self) -> None:
            super().__init__("mean_v1", {"body"}, "v1 mean")

        def aggregate(self, global_state, average):
            return average.mean(global_state)

    with pytest.raises(TypeError) as refused:
        MeanV1()
    message = str(refused.value)
    assert message.startswith("MeanV1.aggregate(global_state, average) is the removed v1 server step: ")
    assert "write aggregate(self, server, results, failures) -> (ServerState, metrics) instead" in message
    assert "`return server.replace(shared=results.reduced), {}`" in message


def test_an_aggregate_that_cannot_take_the_three_arguments_is_refused_whatever_its_names():
    """Catches a refusal that reads parameter names only: an override taking two arguments under other names,
    or only ``(server, results)``, must be refused at construction, naming its own parameters."""

    class TwoNames(Algorithm):
        def aggregate(self, state, mean):
            return state

    class NoFailures(Algorithm):
        def aggregate(self, server, results):
            return server, {}

    with pytest.raises(TypeError, match=r"^TwoNames\.aggregate\(state, mean\) cannot take the server step's"):
        TwoNames("two", {"body"}, "two names")
    with pytest.raises(TypeError, match=r"^NoFailures\.aggregate\(server, results\) cannot take"):
        NoFailures("no_failures", {"body"}, "no failures")


def test_no_refusal_for_the_server_step_its_variants_built_ins_or_no_override():
    """Catches a refusal of a valid server step: ``(server, results, failures)``, other names, ``*args``, an
    algorithm that does not override ``aggregate``, or any registered algorithm (the built-ins, Ditto, FedProx,
    SCAFFOLD, ...), and a warning still raised for any of them."""

    class MeanV2(Algorithm):
        def aggregate(self, server, results, failures):
            return server.replace(shared=dict(results.reduced)), {}

    class OtherNames(Algorithm):
        def aggregate(self, state, reduced, faults=()):
            return state, {}

    class Forwarding(Algorithm):
        def aggregate(self, *args, **kwargs):
            return super().aggregate(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MeanV2("mean_v2", {"body"}, "v2 mean")
        OtherNames("other", {"body"}, "other names")
        Forwarding("forwarding", {"body"}, "forwarding")
        Algorithm("plain", {"body"}, "no override")
        for algorithm in list(ALGORITHMS.values()):
            type(algorithm)()
