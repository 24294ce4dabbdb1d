"""The SFT → GRPO → eval pipeline behind `patchgym run`."""
