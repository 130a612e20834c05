"""The strategies show the settings they take: ``inspect.signature``, ``help()`` and IDEs read the federated
settings (``head``, ``algorithm``, ...) and each strategy's own (``device``; the DDP strategy's process
settings), not ``(*args, device, **kwargs)``. LightningCLI reads the same signature (tests/test_cli.py)."""

from __future__ import annotations

import inspect
import pydoc

import pytest

from lightning_fedrep import FederatedDDPStrategy, FederatedStrategy, FedRepStrategy
from lightning_fedrep.session.session import FederatedSession

OWN_SETTINGS = {
    FederatedStrategy: ["device"],
    FederatedDDPStrategy: ["client_store", "timeout", "process_group_backend", "start_method"],
}


def federated_settings() -> dict[str, inspect.Parameter]:
    """The session's named parameters (the reference: the one place they are written)."""
    parameters = inspect.signature(FederatedSession.__init__).parameters.values()
    return {p.name: p for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD}


@pytest.mark.parametrize("cls", [FederatedStrategy, FederatedDDPStrategy], ids=lambda c: c.__name__)
def test_the_signature_names_every_setting_with_its_default(cls):
    """Fails with ``(*args, device=None, **kwargs)`` (the decorator ``takes_federated_settings`` removed)."""
    signature = inspect.signature(cls)
    reference = federated_settings()
    names = list(signature.parameters)
    assert names == [*reference, *OWN_SETTINGS[cls], "kwargs"]
    assert not any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    for name, expected in reference.items():
        assert signature.parameters[name].default == expected.default, name
    assert signature.parameters["head_epochs"].annotation is int  # annotations resolved, not strings
    for name in OWN_SETTINGS[cls]:
        assert signature.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_signature_is_what_the_constructor_accepts():
    """Arguments bound by the shown signature (positional settings too) build the strategy they describe."""
    bound = inspect.signature(FederatedStrategy).bind("classifier", "fedper", 3, local_epochs=2, device="cpu")
    strategy = FederatedStrategy(*bound.args, **bound.kwargs)
    assert strategy.head == "classifier" and strategy.algorithm.name == "fedper"
    assert strategy.config.clients_per_round == 3
    assert str(strategy.root_device) == "cpu"


def test_help_shows_the_settings_and_subclasses_keep_them():
    text = pydoc.render_doc(FedRepStrategy, renderer=pydoc.plaintext)
    assert "head_epochs: int = 10" in text and "device: str | torch.device | None = None" in text

    class MyStrategy(FederatedStrategy):
        pass

    assert list(inspect.signature(MyStrategy).parameters) == list(
        inspect.signature(FederatedStrategy).parameters
    )
