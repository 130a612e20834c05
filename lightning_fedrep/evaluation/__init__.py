"""Personalized evaluation, with no Lightning: per-client metrics and their summary over clients
(:mod:`.metrics`), what a finished evaluation pass leaves behind (:mod:`.records`), what fine-tuning many
clients' heads on cached features takes (:mod:`.head_tuning`), and fine-tuning each evaluated client before it
is scored (:mod:`.finetuning`, its optimizer :mod:`.finetuning_optimizer`; an algorithm's
``EvaluationSpec.adapt``: :mod:`.adaptation`).
"""
