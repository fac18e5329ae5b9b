"""Helpers shared by the tests (and by the engine demo and benchmarks), kept out of the installed package.

`tests/` is on `sys.path` whenever pytest loads `tests/conftest.py`; scripts outside the tests put it
there themselves. Modules: `engine` (synthetic RL batches, reference log-probs, `spawn_ranks`),
`models` (random tiny Qwen2 directories), `prompts` (left-padded prompt batches), `rollout` (reference
log-probs for rollout outputs), `e2e` (the tiny task, end-to-end overrides and command-line run helpers).
"""
