"""Evaluation protocols measured: what the best round adds over the last rounds."""
