"""lightning_fedrep: personalized federated learning as a drop-in PyTorch Lightning strategy.

Importing the package registers the strategy names ``"fedrep"``, ``"fedper"``, ``"lg_fedavg"``,
``"fedavg"`` and ``"local"`` with Lightning, so ``Trainer(strategy="fedrep")`` works for a module
that marks its own head (``fedrep_head = "classifier"``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedrep.algorithms import ALGORITHMS, Algorithm, Phase
from lightning_fedrep.data.loaders import ClientData, EvalLoader, RoundLoader
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.export import personalized_state_dict
from lightning_fedrep.plan import RoundPlan, sample_clients
from lightning_fedrep.split import ParameterSplit, SplitError, resolve_split
from lightning_fedrep.strategy import CHECKPOINT_KEY, FedRepStrategy

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CHECKPOINT_KEY",
    "ClientData",
    "EvalLoader",
    "FedRepStrategy",
    "FederatedDataModule",
    "ParameterSplit",
    "Phase",
    "RoundLoader",
    "RoundPlan",
    "SplitError",
    "personalized_state_dict",
    "resolve_split",
    "sample_clients",
]

for _name, _algorithm in ALGORITHMS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, FedRepStrategy, description=_algorithm.description, algorithm=_name)
