"""The accuracy studies: a model pre-trained on a task (`pretrain`), then GRPO in each precision setting
(`run_grpo`), and the tiny mixture-of-experts study (`moe_study`). Run from the repository root:
`python -m benchmarks.convergence.pretrain --help`."""
