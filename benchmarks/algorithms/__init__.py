"""Benchmarks across every registered algorithm (``digits_all.py``)."""
