"""FLUTE (Liu, Shen & Yang, ICML 2024): linear FLUTE (Algorithm 1) and the neural-collapse mechanism."""
