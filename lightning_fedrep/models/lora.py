"""LoRA adapters as the personal part: named splits of a ``peft`` model, and a client's adapter out.

A ``peft`` LoRA model has three kinds of parameters: the frozen base (``requires_grad=False``), the
adapters (``...lora_A.<adapter>.weight`` and ``...lora_B.<adapter>.weight``) and the layers peft trains in
full (``modules_to_save``: the classification layer of a ``SEQ_CLS`` model). :func:`lora_split` names the
common ways to personalize them and gives the strategy's ``head=``, ``allow_frozen=True`` and the
algorithm; the frozen base is never stacked per client nor stored per client (it belongs to no group).
:func:`save_peft_adapter` writes one client's adapter as a folder ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

__all__ = ["LORA_SPLITS", "LoRASplit", "lora_split", "save_peft_adapter"]

LORA_A = r"\.lora_A\."
LORA_B = r"\.lora_B\."
CLASSIFIER = r"\.modules_to_save\."


@dataclass(frozen=True)
class LoRASplit:
    """What a LoRA split shares and keeps per client, as the strategy's arguments.

    Attributes:
        name: the split's name in ``LORA_SPLITS``.
        algorithm: the federated algorithm that runs it (a registered name).
        head: the personal parameters (a regex over parameter names), or ``None`` when the algorithm keeps
            everything local (``"local"``).
        description: one line for documentation and reports.
    """

    name: str
    algorithm: str
    head: re.Pattern | None
    description: str

    def strategy_kwargs(self) -> dict[str, Any]:
        """``FederatedStrategy(**split.strategy_kwargs(), ...)``: ``algorithm``, ``head`` and
        ``allow_frozen=True`` (the frozen base is neither trained, shared nor personal)."""
        kwargs: dict[str, Any] = {"algorithm": self.algorithm, "allow_frozen": True}
        if self.head is not None:
            kwargs["head"] = self.head
        return kwargs

    def personal(self, module: nn.Module) -> list[str]:
        """The trainable parameter names of ``module`` that this split keeps per client."""
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        return trainable if self.head is None else [n for n in trainable if self.head.search(n)]


LORA_SPLITS: dict[str, LoRASplit] = {
    split.name: split
    for split in (
        LoRASplit(
            "fedsa",
            "fedper",
            re.compile(f"{LORA_B}|{CLASSIFIER}"),
            "FedSA-LoRA: B matrices and the classifier personal, A matrices shared; both train every local epoch",
        ),
        LoRASplit(
            "adapters",
            "fedper",
            re.compile(f"{LORA_A}|{LORA_B}"),
            "personal adapters (A and B), shared classifier; both train every local epoch",
        ),
        LoRASplit(
            "local",
            "local",
            None,
            "fully local adapters and classifier: nothing shared, each client fine-tunes its own (Local Only)",
        ),
        LoRASplit(
            "fedrep",
            "fedrep",
            re.compile(CLASSIFIER),
            "FedRep on adapters: the classifier personal and trained first (head epochs), then the shared "
            "adapters (body epochs)",
        ),
    )
}
"""The named LoRA splits (see :func:`lora_split`)."""


def lora_split(scheme: str, module: nn.Module | None = None) -> LoRASplit:
    """The named LoRA split ``scheme`` (one of ``LORA_SPLITS``), checked against ``module`` if given.

    * ``"fedsa"`` (FedSA-LoRA): ``lora_B`` and the classifier (``modules_to_save``) personal, ``lora_A``
      shared; FedPer's schedule (all of them train each local epoch).
    * ``"adapters"``: ``lora_A`` and ``lora_B`` personal, the classifier shared; FedPer's schedule.
    * ``"local"``: adapters and classifier personal, nothing shared (algorithm ``"local"``).
    * ``"fedrep"``: the classifier personal and trained first with the adapters fixed (``head_epochs``), then
      the shared adapters with the classifier fixed (``body_epochs``): FedRep with the adapters as its body.

    Use it as ``FederatedStrategy(**lora_split("fedsa").strategy_kwargs(), ...)``; any algorithm that takes
    ``head=`` runs the same selection (e.g. ``"fedrep"`` with the FedSA head).

    Raises:
        ValueError: ``scheme`` is not a known name, or ``module`` has no LoRA adapters, or the split
            selects none of its parameters, or leaves nothing to share.
    """
    if scheme not in LORA_SPLITS:
        raise ValueError(f"lora_split(scheme=...) must be one of {sorted(LORA_SPLITS)}, got {scheme!r}.")
    split = LORA_SPLITS[scheme]
    if module is not None:
        _check_module(split, module)
    return split


def _check_module(split: LoRASplit, module: nn.Module) -> None:
    """``module`` has LoRA adapters, and the split selects some of its trainable parameters but not all."""
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if not any(re.search(LORA_A, n) for n in trainable):
        raise ValueError(
            f"lora_split({split.name!r}, module): the module has no trainable LoRA adapters (no parameter "
            "named '...lora_A...'); wrap it with peft.get_peft_model(model, LoraConfig(...)), e.g. "
            "HFSequenceClassifier(..., lora_r=8)."
        )
    personal = split.personal(module)
    if not personal:
        raise ValueError(
            f"lora_split({split.name!r}, module) selects no parameter: the module has no classifier in peft's "
            "modules_to_save (LoraConfig(task_type='SEQ_CLS') or modules_to_save=[...]); choose 'adapters'."
        )
    if split.head is not None and len(personal) == len(trainable):
        raise ValueError(
            f"lora_split({split.name!r}, module) makes every trainable parameter personal, nothing is shared; "
            "use lora_split('local') for fully local adapters."
        )


def _peft_model(module: nn.Module) -> nn.Module:
    """The one ``peft.PeftModel`` in ``module`` (``module`` itself or a submodule)."""
    from peft import PeftModel

    found = [m for m in module.modules() if isinstance(m, PeftModel)]
    if len(found) != 1:
        raise ValueError(
            f"save_peft_adapter(module, ...) needs a module holding exactly one peft model, found {len(found)} "
            "(build it with peft.get_peft_model, e.g. HFSequenceClassifier(..., lora_r=8))."
        )
    return found[0]


def save_peft_adapter(
    module: nn.Module,
    folder: str | Path,
    state_dict: Mapping[str, Tensor] | None = None,
    base_folder: str | Path | None = None,
) -> Path:
    """Write a personalized model's adapter as a folder ``PeftModel.from_pretrained(base, folder)`` loads.

    ``module`` is a client's personalized model (``strategy.client_model(client)``), or the user's module
    with ``state_dict`` the client's personalized ``state_dict`` (``strategy.client_state_dict(client)``, or
    :func:`~lightning_fedrep.personalized_state_dict` of a checkpoint), loaded into a copy first. The folder
    holds ``adapter_config.json`` and the adapter weights: the client's personal tensors and the shared ones
    (e.g. its own B matrices and classifier with the global A matrices), never the frozen base.

    ``base_folder``, when given, also receives the frozen base model (``save_pretrained``, without adapters),
    the ``base`` to load the adapter onto when the model was built from a config rather than a hub name;
    the adapter's ``base_model_name_or_path`` then names that folder. It is the same for every client.

    Returns the adapter folder.
    """
    if state_dict is not None:
        module = copy.deepcopy(module)
        module.load_state_dict(dict(state_dict))
    peft_model = _peft_model(module)
    folder = Path(folder)
    if base_folder is None:
        peft_model.save_pretrained(folder)
        return folder
    copy.deepcopy(peft_model).unload().save_pretrained(base_folder)
    configs = list(peft_model.peft_config.values())
    named = [config.base_model_name_or_path for config in configs]
    try:
        for config in configs:
            config.base_model_name_or_path = str(base_folder)
        peft_model.save_pretrained(folder)
    finally:
        for config, name in zip(configs, named):
            config.base_model_name_or_path = name
    return folder
