"""Workers: the thin per-device processes (actor, rollout, ref, critic) and the rollout backends they drive."""
