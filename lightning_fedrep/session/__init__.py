"""One federated strategy's Lightning-free half: :class:`~lightning_fedrep.session.session.FederatedSession`
holds the settings and the objects a strategy owns (the federation, the run, the runner selection, evaluation,
prediction, the data binding, the collective), their public accessors and what the hooks do with them. The
Lightning face (:mod:`lightning_fedrep.lightning`) inherits it and translates Lightning's events into its calls.
"""
