"""Differential privacy for federated training. No Lightning here.

:mod:`.accounting` (:class:`PrivacyAccountant`: the ε a sequence of sampled Gaussian mechanism steps spends,
computed by Opacus or dp-accounting, the noise multiplier for a target ε, checkpointed with a run). The
libraries are the ``privacy`` extra (``pip install "lightning-fedrep[privacy]"``), imported when an accountant
is built, so importing this package needs neither.
"""

from lightning_fedrep.privacy.accounting import ACCOUNTANTS, SAMPLINGS, PrivacyAccountant

__all__ = ["ACCOUNTANTS", "SAMPLINGS", "PrivacyAccountant"]
