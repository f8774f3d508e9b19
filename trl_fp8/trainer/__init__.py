"""The FP8 trainers (GRPO, RLOO) over TRL's, their config, TIS and the training-phase helpers."""
