"""lightning_fedrep: personalized federated learning as a drop-in PyTorch Lightning strategy.

Importing the package registers one strategy name per algorithm with Lightning (``"fedrep"``,
``"fedper"``, ``"lg_fedavg"``, ``"fedavg"``, ``"local"``), so ``Trainer(strategy="fedrep")`` works for
a module that marks its own head (``fedrep_head = "classifier"``), and one per algorithm on several
processes (``"fedrep_ddp"``, ...: ``Trainer(strategy="fedrep_ddp", devices=2)``).
"""

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedrep.callbacks import (
    AdaptiveParticipation,
    FederatedProgressBar,
    FineTunedEvaluation,
    HeadFineTuning,
    NeuralCollapse,
    OrthonormalBody,
    RunSummary,
    ValidateAtRounds,
)
from lightning_fedrep.callbacks.participation import (
    DynamicExponential,
    FixedExponential,
    LatencyModel,
    TwoClassExponential,
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
from lightning_fedrep.data.pfllib import PFLlibPartitioner
from lightning_fedrep.federation import (
    ClientFault,
    ClientFaultError,
    ClientFaultWarning,
    ClientResult,
    Federation,
    RoundResult,
)
from lightning_fedrep.federation.algorithms import (  # registers every algorithm module, in order
    APFL,
    GPFL,
    HFMAML,
    L2GD,
    Ditto,
    FedAdagrad,
    FedAdam,
    FedALA,
    FedAS,
    FedAvg,
    FedBABU,
    FedBN,
    FedCAC,
    FedCP,
    FedDBE,
    FedMTL,
    FedOpt,
    FedPAC,
    FedPer,
    FedProto,
    FedProx,
    FedRep,
    FedRoD,
    FedYogi,
    LGFedAvg,
    Local,
    PerFedAvg,
    PFedMe,
    Scaffold,
)
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.objective import (
    GradTransform,
    LossTerm,
    Objective,
    ParamTransform,
    StepOutcome,
    StepRule,
    StepView,
)
from lightning_fedrep.federation.api.registry import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    on_register,
    register_algorithm,
    register_server_optimizer,
)
from lightning_fedrep.federation.api.scoring import EvaluationSpec
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer
from lightning_fedrep.federation.checkpoint.entry import CHECKPOINT_KEY
from lightning_fedrep.federation.checkpoint.export import personalized_state_dict
from lightning_fedrep.federation.module.split import ParameterSplit, SplitError, resolve_split
from lightning_fedrep.federation.plan import ClientWork, RoundPlan, RoundSpec, StepLocation
from lightning_fedrep.lightning.callback import FederatedCallback
from lightning_fedrep.lightning.ddp import FederatedDDPStrategy
from lightning_fedrep.lightning.strategy import FederatedStrategy, FedRepStrategy
from lightning_fedrep.runners.runner_report import RunnerReport
from lightning_fedrep.runners.settings import RunnerSettings

__all__ = [
    "ALGORITHMS",
    "APFL",
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
    "Ditto",
    "DynamicExponential",
    "EvaluationSpec",
    "FedALA",
    "FedAS",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedBABU",
    "FedBN",
    "FedCAC",
    "FedCP",
    "FedDBE",
    "FedMTL",
    "FedOpt",
    "FedPAC",
    "FedYogi",
    "FedPer",
    "FedProto",
    "FedProx",
    "Scaffold",
    "FedRep",
    "FedRepStrategy",
    "FedRoD",
    "GPFL",
    "FederatedCallback",
    "FederatedDDPStrategy",
    "FederatedDataModule",
    "FederatedProgressBar",
    "FederatedStrategy",
    "Federation",
    "FixedExponential",
    "FineTunedEvaluation",
    "HeadFineTuning",
    "HFMAML",
    "IIDPartitioner",
    "L2GD",
    "LatencyModel",
    "LGFedAvg",
    "Local",
    "GradTransform",
    "LossTerm",
    "Objective",
    "ParamTransform",
    "NaturalPartitioner",
    "NeuralCollapse",
    "OrthonormalBody",
    "ParameterSplit",
    "PFLlibPartitioner",
    "Partitioner",
    "PerFedAvg",
    "PFedMe",
    "Phase",
    "StepOutcome",
    "StepRule",
    "StepView",
    "RoundPlan",
    "RoundResult",
    "RoundSpec",
    "RunnerReport",
    "RunnerSettings",
    "RunSummary",
    "SERVER_OPTIMIZERS",
    "ServerOptimizer",
    "ShardPartitioner",
    "SplitError",
    "StepLocation",
    "TwoClassExponential",
    "ValidateAtRounds",
    "personalized_state_dict",
    "register_algorithm",
    "register_server_optimizer",
    "resolve_split",
]


def _register_strategy_names(algorithm: Algorithm | None = None) -> None:
    """Add every registered algorithm's strategy names to Lightning's registry (at import, and again for
    each ``register_algorithm`` after it); a name Lightning already gives another strategy is left to it."""
    if algorithm is not None:
        for name, cls in (
            (algorithm.name, FederatedStrategy),
            (f"{algorithm.name}_ddp", FederatedDDPStrategy),
        ):
            if name in StrategyRegistry and StrategyRegistry[name]["strategy"] is not cls:
                rank_zero_warn(
                    f"register_algorithm: Trainer(strategy={name!r}) keeps naming Lightning's "
                    f"{StrategyRegistry[name]['strategy'].__name__}; use {cls.__name__}(algorithm="
                    f"{algorithm.name!r}) or register the algorithm under another name."
                )
    FederatedStrategy.register_strategies(StrategyRegistry)
    FederatedDDPStrategy.register_strategies(StrategyRegistry)


_register_strategy_names()
on_register(_register_strategy_names)
