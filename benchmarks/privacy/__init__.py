"""Differential privacy (issue 40): CENTAUR's privacy-utility trade-off on the digits, the cost of client-level DP."""
