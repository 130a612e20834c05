"""lightning_fedrep: personalized federated learning as a drop-in PyTorch Lightning strategy.

Importing the package registers one strategy name per algorithm with Lightning (``"fedrep"``,
``"fedper"``, ``"lg_fedavg"``, ``"fedavg"``, ``"local"``), so ``Trainer(strategy="fedrep")`` works for
a module that marks its own head (``fedrep_head = "classifier"``), and one per algorithm on several
processes (``"fedrep_ddp"``, ...: ``Trainer(strategy="fedrep_ddp", devices=2)``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedrep.algorithms import ALGORITHMS, Algorithm, FedRep, Phase, register_algorithm
from lightning_fedrep.callbacks import (
    AdaptiveParticipation,
    FederatedProgressBar,
    FineTunedEvaluation,
    HeadFineTuning,
    NeuralCollapse,
    OrthonormalBody,
    RunSummary,
)
from lightning_fedrep.data.module import FederatedDataModule
from lightning_fedrep.data.partition import (
    ClientSplit,
    DirichletPartitioner,
    IIDPartitioner,
    NaturalPartitioner,
    Partitioner,
    ShardPartitioner,
)
from lightning_fedrep.distributed import FederatedDDPStrategy
from lightning_fedrep.export import personalized_state_dict
from lightning_fedrep.federation import (
    ClientFault,
    ClientFaultError,
    ClientFaultWarning,
    ClientResult,
    Federation,
    RoundResult,
)
from lightning_fedrep.hooks import FederatedCallback, LiveStep, VectorizedLossTerm
from lightning_fedrep.participation import (
    DynamicExponential,
    FixedExponential,
    LatencyModel,
    TwoClassExponential,
)
from lightning_fedrep.plan import ClientWork, RoundPlan, RoundSpec, StepLocation
from lightning_fedrep.split import ParameterSplit, SplitError, resolve_split
from lightning_fedrep.strategy import CHECKPOINT_KEY, FederatedStrategy, FedRepStrategy

__all__ = [
    "ALGORITHMS",
    "AdaptiveParticipation",
    "Algorithm",
    "CHECKPOINT_KEY",
    "ClientFault",
    "ClientFaultError",
    "ClientFaultWarning",
    "ClientResult",
    "ClientSplit",
    "ClientWork",
    "DirichletPartitioner",
    "DynamicExponential",
    "FedRep",
    "FedRepStrategy",
    "FederatedCallback",
    "FederatedDDPStrategy",
    "FederatedDataModule",
    "FederatedProgressBar",
    "FederatedStrategy",
    "Federation",
    "FixedExponential",
    "FineTunedEvaluation",
    "HeadFineTuning",
    "IIDPartitioner",
    "LatencyModel",
    "LiveStep",
    "NaturalPartitioner",
    "NeuralCollapse",
    "OrthonormalBody",
    "ParameterSplit",
    "Partitioner",
    "Phase",
    "RoundPlan",
    "RoundResult",
    "RoundSpec",
    "RunSummary",
    "ShardPartitioner",
    "SplitError",
    "StepLocation",
    "TwoClassExponential",
    "VectorizedLossTerm",
    "personalized_state_dict",
    "register_algorithm",
    "resolve_split",
]

FederatedStrategy.register_strategies(StrategyRegistry)
FederatedDDPStrategy.register_strategies(StrategyRegistry)
