"""One small module per algorithm, each written on the public algorithm API only (``lightning_fedrep.algorithms``
and ``lightning_fedrep.federation.objective``). ``import lightning_fedrep`` registers them by name."""
