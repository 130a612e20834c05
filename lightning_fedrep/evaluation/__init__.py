"""Personalized evaluation, with no Lightning: per-client metrics and their summary over clients
(:mod:`.metrics`), what a finished evaluation pass leaves behind (:mod:`.records`), and what fine-tuning many
clients' heads on cached features takes (:mod:`.head_tuning`).
"""
