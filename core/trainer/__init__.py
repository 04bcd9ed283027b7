"""The RL loop, its experience building, PPO update and checkpoint policy."""
