"""The demo's own pieces, apart from the library: a tiny Qwen3-architecture model and character tokenizer built
locally (`tiny_model`), and the "say <letter>" task with its warm start and its greedy accuracy check (`toy_task`)."""
