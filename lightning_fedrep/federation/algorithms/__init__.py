"""One small module per algorithm, each written on the public algorithm API only
(:mod:`lightning_fedrep.federation.api`, with the module's feature split): the built-ins (:class:`FedRep`,
:class:`FedPer`, :class:`LGFedAvg`, :class:`FedAvg`, :class:`Local`) and the acceptance examples of the
algorithm API (:class:`Ditto`, :class:`FedProx`, :class:`Scaffold`) and the baselines on its step rules and
evaluation specs (:class:`APFL`, :class:`PerFedAvg`, :class:`HFMAML`), on the server step's client map
(:class:`L2GD`), today's baselines (:class:`FedBABU`, :class:`FedBN`, :class:`FedDBE`, :class:`FedALA`, :class:`GPFL`,
:class:`PFedMe`, :class:`FedCAC`, :class:`FedAS`, :class:`FedProto`, :class:`FedPAC`), and the FedOpt
server optimizers (:class:`FedAdam`, :class:`FedYogi`, :class:`FedAdagrad`: any algorithm's ``with_server_optimizer``;
FedAvg with each by name).

Importing this package registers them all by name, in this order (the order of ``StrategyRegistry`` and the
command's help); ``import lightning_fedrep`` does so.
"""

# the import order is the registration order
# isort: off
from lightning_fedrep.federation.algorithms.fedrep import FedRep
from lightning_fedrep.federation.algorithms.fedper import FedPer
from lightning_fedrep.federation.algorithms.lg_fedavg import LGFedAvg
from lightning_fedrep.federation.algorithms.fedavg import FedAvg
from lightning_fedrep.federation.algorithms.local import Local
from lightning_fedrep.federation.algorithms.ditto import Ditto
from lightning_fedrep.federation.algorithms.fedprox import FedProx
from lightning_fedrep.federation.algorithms.scaffold import Scaffold
from lightning_fedrep.federation.algorithms.apfl import APFL
from lightning_fedrep.federation.algorithms.per_fedavg import PerFedAvg
from lightning_fedrep.federation.algorithms.hf_maml import HFMAML
from lightning_fedrep.federation.algorithms.l2gd import L2GD
from lightning_fedrep.federation.algorithms.fed_mtl import FedMTL
from lightning_fedrep.federation.algorithms.fedrod import FedRoD
from lightning_fedrep.federation.algorithms.fedcp import FedCP
from lightning_fedrep.federation.algorithms.fedbabu import FedBABU
from lightning_fedrep.federation.algorithms.fedbn import FedBN
from lightning_fedrep.federation.algorithms.feddbe import FedDBE
from lightning_fedrep.federation.algorithms.fedala import FedALA
from lightning_fedrep.federation.algorithms.gpfl import GPFL
from lightning_fedrep.federation.algorithms.fedas import FedAS
from lightning_fedrep.federation.algorithms.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi
from lightning_fedrep.federation.algorithms.pfedme import PFedMe
from lightning_fedrep.federation.algorithms.fedcac import FedCAC
from lightning_fedrep.federation.algorithms.fedproto import FedProto
from lightning_fedrep.federation.algorithms.fedpac import FedPAC

# isort: on

__all__ = [
    "APFL",
    "Ditto",
    "FedALA",
    "FedAS",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedBABU",
    "FedBN",
    "FedCAC",
    "FedMTL",
    "FedOpt",
    "FedPAC",
    "FedPer",
    "FedProto",
    "FedProx",
    "FedRep",
    "FedCP",
    "FedDBE",
    "FedRoD",
    "GPFL",
    "HFMAML",
    "L2GD",
    "LGFedAvg",
    "Local",
    "PerFedAvg",
    "PFedMe",
    "Scaffold",
    "FedYogi",
]
