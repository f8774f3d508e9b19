"""The benchmarks of trl-fp8, run from the repository root as modules: `python -m benchmarks.bench_grpo --help`.

Speed (and memory) scripts sit here (`bench_*.py`); the accuracy studies in `benchmarks.convergence`. What they
share, argument parsing and the results files' metadata, is `benchmarks.common`; `benchmarks/README.md` says which
command writes which results file."""
