"""Differential privacy for federated training. No Lightning here.

* :mod:`.client_level` (:class:`ClientLevelDP`: ``FederatedStrategy(privacy=ClientLevelDP(...))``, client-level DP
  with a trusted server: every round's shared updates clipped and noised before the server step), over
  :mod:`.aggregator` (:class:`ClippedNoisyMean`, the aggregator that does it), :mod:`.clipping` (flat-norm
  clipping, :class:`AdaptiveClipping`) and :mod:`.budget` (the rounds' sampling and ε);
* :mod:`.sample_level` (:class:`SampleLevelDP`: ``FederatedStrategy(privacy=SampleLevelDP(...))``, DP-SGD in every
  client's local steps on Poisson batches, each client's ε accounted), over :mod:`.dp_sgd` (the step rule:
  per-example gradients with ``torch.func``, clipped, summed, noised), :mod:`.noise` (Gaussian noise keyed by
  seed, round, client and step, the same on every runner) and :mod:`.sample_budget` (each client's ε);
* :mod:`.accounting` (:class:`PrivacyAccountant`: the ε a sequence of sampled Gaussian mechanism steps spends,
  computed by Opacus or dp-accounting, the noise multiplier for a target ε, checkpointed with a run).

The libraries are the ``privacy`` extra (``pip install "lightning-fedrep[privacy]"``), imported when an accountant
is built, so importing this package needs neither. The federation core reaches a mechanism only through its own
protocol (:class:`lightning_fedrep.federation.api.mechanism.PrivacyMechanism`).
"""

from lightning_fedrep.privacy.accounting import ACCOUNTANTS, SAMPLINGS, PrivacyAccountant
from lightning_fedrep.privacy.aggregator import ClippedNoisyMean
from lightning_fedrep.privacy.client_level import ClientLevelDP
from lightning_fedrep.privacy.clipping import AdaptiveClipping
from lightning_fedrep.privacy.sample_level import SampleLevelDP

__all__ = [
    "ACCOUNTANTS",
    "SAMPLINGS",
    "AdaptiveClipping",
    "ClientLevelDP",
    "ClippedNoisyMean",
    "PrivacyAccountant",
    "SampleLevelDP",
]
