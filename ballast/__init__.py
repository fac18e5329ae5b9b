"""Ballast: a single-controller RL trainer for language models on Ray, built around a correct and balanced batch path."""

__version__ = "0.1.0"
