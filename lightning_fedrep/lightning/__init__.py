"""The Lightning face: the strategies (one device, DDP), the federated callback base class, the Trainer checks
and the Lightning internals relied on. Everything Lightning-specific lives here; the hooks read the Trainer
and call the Lightning-free :class:`~lightning_fedrep.session.session.FederatedSession` (the settings, the public
accessors), :class:`~lightning_fedrep.federation.run.FederatedRun` and the runners (:mod:`lightning_fedrep.runners`).

Import from the submodules (``lightning_fedrep.lightning.strategy``, ...): inside them, ``import lightning``
is the Lightning distribution, not this folder.
"""
