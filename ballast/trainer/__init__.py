"""The driver side of Ballast: typed config, the RL loop, algorithms, tracking and checkpoints."""
