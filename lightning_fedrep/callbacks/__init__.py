"""Callbacks that plug into the federated strategy."""
