"""Federated data: the data module, the per-round client iterables and the partitioners."""
