"""RL training pieces: GRPO advantages, truncated importance sampling and the PPO-clip policy loss (SPEC 7)."""
