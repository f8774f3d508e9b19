"""A vLLM engine's own log-probabilities of the tokens it sampled, against its prompt log-probabilities of the same
sequences (the exactness gates, `tests/gpu/test_exactness_gates_gpu.py`): vLLM must agree with itself before a trainer
can agree with it. With `--trainer BF16_DIR` (the BF16 model MODEL_DIR was quantized from), also the trainer's exact
forward on the engine's kernels (`nn.exact_forward`, each sequence alone) against both. Prints one JSON line: per
comparison the tokens, how many differ, the largest difference, and where the first difference of each sequence lies
(its index in the completion and its position in the sequence).

    python vllm_self_logprobs.py MODEL_DIR [--sequences 16] [--tokens 64] [--trainer BF16_DIR [--layers]]
                                 [--no_cudagraphs [--decode_layers]]
    # run with `rollout.vllm.exact.ExactEngine().env` in the environment
"""

import argparse
import contextlib
import json
import random
import statistics

from vllm import LLM, SamplingParams

from trl_fp8.rollout.vllm.exact import ExactEngine

RESULT = "self-logprobs:"  # the line the test reads, among vLLM's own output
parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--sequences", type=int, default=16)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--trainer", default=None)
parser.add_argument("--no_cudagraphs", action="store_true", help="decode without CUDA graphs (cudagraph_mode NONE)")
parser.add_argument("--decode_layers", action="store_true",
                    help="with --no_cudagraphs: every op's output in every layer, row by row, as the engine decodes "
                    "the sequences again, against its prefill of them; names the first op that parts")  # fmt: skip
parser.add_argument("--layers", action="store_true",
                    help="with --trainer: each decoder layer's output, engine (prefill) vs trainer, on the first "
                    "sequence they score differently")  # fmt: skip
args = parser.parse_args()
if args.decode_layers and not args.no_cudagraphs:
    parser.error("--decode_layers needs --no_cudagraphs (a replayed CUDA graph runs no forward hook)")
if args.layers and not args.trainer:
    parser.error("--layers compares the trainer's layers: give --trainer BF16_DIR")
# exact mode's engine settings (its environment came with the process: vLLM reads it at import)
engine_kwargs = ExactEngine().llm_kwargs
if args.no_cudagraphs:  # (forward hooks see decode steps only outside CUDA graphs)
    engine_kwargs["compilation_config"] = {**engine_kwargs["compilation_config"], "cudagraph_mode": "NONE"}
llm = LLM(model=args.model, gpu_memory_utilization=0.2, max_model_len=64 + args.tokens, seed=0, **engine_kwargs)
rng = random.Random(0)
vocab = llm.llm_engine.model_config.get_vocab_size()
prompts = [[rng.randrange(4, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(args.sequences)]
sampled = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1, ignore_eos=True))  # fmt: skip
sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, sampled, strict=True)]
scored = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0))
decode = [[o.outputs[0].logprobs[k][t].logprob for k, t in enumerate(o.outputs[0].token_ids)] for o in sampled]
prefill = [[s.prompt_logprobs[len(p) + k][seq[len(p) + k]].logprob for k in range(len(seq) - len(p))]
           for p, s, seq in zip(prompts, scored, sequences, strict=True)]  # fmt: skip
runs = {"decode_vs_prefill": (decode, prefill)}

if args.trainer:  # the trainer's side, as exact mode computes it: FP8 linears from the BF16 model, engine's kernels
    import torch
    from transformers import AutoModelForCausalLM

    from trl_fp8 import convert_to_fp8
    from trl_fp8.nn.exact_forward import exact_token_logprobs
    from trl_fp8.rollout.vllm._compat import engine_rotary_table
    from trl_fp8.rollout.vllm.exact import exact_kernels

    model = AutoModelForCausalLM.from_pretrained(args.trainer, dtype=torch.bfloat16).cuda()
    convert_to_fp8(model)
    kernels, table = exact_kernels(), engine_rotary_table(llm).cuda()
    trainer = []
    with torch.no_grad():
        for p, seq in zip(prompts, sequences, strict=True):
            ids = torch.tensor([seq], device="cuda")
            lp, _ = exact_token_logprobs(model, ids, torch.ones_like(ids), len(seq) - len(p), dtype=torch.bfloat16,
                                         cos_sin_cache=table, kernels=kernels)  # fmt: skip
            trainer.append(lp[0].tolist())
    runs |= {"trainer_vs_decode": (trainer, decode), "trainer_vs_prefill": (trainer, prefill)}
    # as training runs it: up to 8 sequences packed in one forward, with autograd on (right-padded to one length)
    some = list(range(min(8, len(sequences))))
    width = max(len(sequences[i]) for i in some)
    ids = torch.zeros(len(some), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, i in enumerate(some):
        ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        mask[row, : len(sequences[i])] = 1
    # (every token but the first: column j holds token j + 1's log-probability)
    lp, _ = exact_token_logprobs(model, ids, mask, width - 1, dtype=torch.bfloat16, cos_sin_cache=table,
                                 kernels=kernels)  # fmt: skip
    packed = [lp[row, len(prompts[i]) - 1 : len(sequences[i]) - 1].tolist() for row, i in enumerate(some)]
    runs["trainer_packed_grad_vs_alone"] = (packed, trainer[: len(some)])


def compare(a, b) -> dict:
    """Tokens, how many differ and by how much at most, and where each differing sequence first differs."""
    tokens = differ = 0
    largest, first = 0.0, []
    for p, x, y in zip(prompts, a, b, strict=False):  # (a comparison of the first sequences only: the shorter)
        diffs = [k for k, (u, v) in enumerate(zip(x, y, strict=True)) if u != v]
        tokens += len(x)
        differ += len(diffs)
        largest = max([largest, *(abs(x[k] - y[k]) for k in diffs)])
        if diffs:
            first.append((diffs[0], len(p) + diffs[0]))
    where = {}
    if first:
        where = {"first_index_min": min(f[0] for f in first), "first_index_median": statistics.median(f[0] for f in first),
                 "first_position_min": min(f[1] for f in first)}  # fmt: skip
    return {
        "tokens": tokens,
        "differ": differ,
        "largest_abs_diff": largest,
        "sequences_differing": len(first),
        **where,
    }


def first_differing(a, b) -> int:
    """The index of the first sequence `a` and `b` score differently (0 if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 0)


def row_differences(ours, theirs) -> dict:
    """How many rows of two per-token tensors differ, the first of them, and the largest difference."""
    theirs = theirs[: ours.shape[0]]
    rows = (ours != theirs).reshape(ours.shape[0], -1).any(-1).nonzero().flatten().tolist()
    return {"rows_differing": len(rows), "first_row": rows[0] if rows else None,
            "max_abs": (ours.float() - theirs.float()).abs().max().item()}  # fmt: skip


@contextlib.contextmanager
def outputs_of(modules: dict):
    """key -> the outputs (tuples kept whole) of `modules[key]` at each forward while the block runs."""
    calls = {key: [] for key in modules}

    def keep(key):
        def hook(module, inputs, out):
            calls[key].append(
                tuple(None if t is None else t.detach().clone() for t in out)  # (a linear's bias: None)
                if isinstance(out, tuple)
                else out.detach().clone()
            )

        return hook

    hooks = [module.register_forward_hook(keep(key)) for key, module in modules.items()]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


found = {name: compare(a, b) for name, (a, b) in runs.items()}

if args.decode_layers:  # where the engine's decode leaves its prefill: each op's output, row by row, as the batch
    # of sampled sequences is decoded again, against the prefill of the same tokens (every op site of each layer)
    import torch

    from trl_fp8.rollout.vllm._compat import engine_model

    net = engine_model(llm).model
    sites = ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "self_attn.rotary_emb",
             "self_attn.attn", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
             "mlp.down_proj", "")  # fmt: skip
    modules = {}
    for n, layer in enumerate(net.layers):
        for site in sites:
            module = layer.get_submodule(site) if site else layer
            modules[f"{n}.{site or 'layer'}"] = module
    modules["norm"] = net.norm
    # a module every layer shares (vLLM caches one rotary embedding for all) runs once a layer: its calls cannot be
    # told apart by forward, so it is left out and named
    seen = [id(m) for m in modules.values()]
    shared = sorted({key.split(".", 1)[1] for key, m in modules.items() if seen.count(id(m)) > 1})
    modules = {key: m for key, m in modules.items() if seen.count(id(m)) == 1}

    def hidden(out):  # a module's first output (a layer's hidden states, a linear's product, a rotary's query)
        return out[0] if isinstance(out, tuple) else out

    def positions_of(calls):  # each forward's positions, kept by a pre-hook on the first layer (the model's own
        # call bypasses hooks: vLLM's compile decorator replaces it)
        def keep(module, args, kwargs):
            calls.append((kwargs["positions"] if "positions" in kwargs else args[0]).detach().clone())

        return net.layers[0].register_forward_pre_hook(keep, with_kwargs=True)

    decode_positions, prefill_positions = [], []
    hook = positions_of(decode_positions)
    with outputs_of(modules) as decode_calls:
        again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=1, ignore_eos=True))  # fmt: skip
    hook.remove()
    same_tokens = all(
        list(o.outputs[0].token_ids) == s[len(p) :] for o, s, p in zip(again, sequences, prompts, strict=True)
    )
    hook = positions_of(prefill_positions)
    with outputs_of(modules) as prefill_calls:
        llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1))
    hook.remove()

    def split_prefill(rows, positions):
        """A prefill's rows (all forwards', in order) split where positions restart: one piece per sequence."""
        starts = (positions == 0).nonzero().flatten().tolist() + [positions.shape[0]]
        return [rows[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]

    def in_order(pieces, lengths, what):  # the engine orders a step's sequences its own way: match them by length
        if sorted(len(p) for p in pieces) != sorted(lengths) or len(set(lengths)) != len(lengths):
            raise SystemExit(f"{what}: rows per sequence {[len(p) for p in pieces]}, expected {lengths}")
        by_length = {len(p): p for p in pieces}
        return [by_length[n] for n in lengths]

    # each decode step's row of sequence i: the one at its position (the prompts' lengths differ)
    step_rows = [[int((pos == len(p) + t - 1).nonzero()[0]) for p in prompts]
                 for t, pos in enumerate(decode_positions) if t > 0]  # fmt: skip
    per_module = {}
    for key in modules:
        # the decode run: its first forward prefills the prompts, each later one decodes a row per sequence
        prompt_rows = hidden(decode_calls[key][0])[: decode_positions[0].shape[0]]
        pieces = in_order(split_prefill(prompt_rows, decode_positions[0]), [len(p) for p in prompts],
                          f"{key}: the decode run's first forward")  # fmt: skip
        steps = [hidden(out) for out in decode_calls[key][1:]]
        decoded = [torch.cat([piece, *(step[at[i] : at[i] + 1] for step, at in zip(steps, step_rows, strict=True))])
                   for i, piece in enumerate(pieces)]  # fmt: skip
        outs = prefill_calls[key]
        rows = torch.cat([hidden(out)[: pos.shape[0]] for out, pos in zip(outs, prefill_positions, strict=True)])
        prefilled = in_order(split_prefill(rows, torch.cat(prefill_positions)), [len(s) for s in sequences],
                             f"{key}: the prefill")  # fmt: skip
        # (the decode has no row for a sequence's last token: row_differences compares the decode's rows)
        diffs = [row_differences(ours, theirs) for ours, theirs in zip(decoded, prefilled, strict=True)]
        per_module[key] = {
            "rows": sum(len(ours) for ours in decoded),
            "rows_differing": sum(d["rows_differing"] for d in diffs),
            "first_position": min((d["first_row"] for d in diffs if d["first_row"] is not None), default=None),
            "max_abs": max(d["max_abs"] for d in diffs),
        }
    # the op that parts first: the earliest position any op differs at, and the first op (in forward order) there
    earliest = min((m["first_position"] for m in per_module.values() if m["first_position"] is not None), default=None)
    first = None if earliest is None else next(k for k, m in per_module.items() if m["first_position"] == earliest)
    found["decode_layers"] = {"shared_modules_left_out": shared, "same_tokens_sampled": same_tokens,
                              "decode_forwards": len(decode_positions), "prefill_forwards": len(prefill_positions),
                              "earliest_position": earliest, "first_op": first, "per_module": per_module}  # fmt: skip

if args.layers:  # where the trainer and the engine's prefill part: each layer's (hidden, residual)
    import trl_fp8.nn.exact_forward as exact_forward
    from trl_fp8.rollout.vllm._compat import engine_model

    index = first_differing(*runs["trainer_vs_prefill"])
    seq = sequences[index]
    with outputs_of(dict(enumerate(engine_model(llm).model.layers))) as engine_calls:
        llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1))  # one forward: the prefill
    layer_fn, trainer_layers = exact_forward._layer, []

    def recorded(*a, **k):
        out = layer_fn(*a, **k)
        trainer_layers.append([t.detach().clone() for t in out])
        return out

    exact_forward._layer = recorded
    with torch.no_grad():
        ids = torch.tensor([seq], device="cuda")
        exact_token_logprobs(model, ids, torch.ones_like(ids), 1, dtype=torch.bfloat16, cos_sin_cache=table,
                             kernels=kernels)  # fmt: skip
    exact_forward._layer = layer_fn
    per_layer = []
    for n, (ours, theirs) in enumerate(zip(trainer_layers, engine_calls.values(), strict=False)):
        pairs = zip(("hidden", "residual"), ours, theirs[0], strict=True)  # (the prefill: each layer's one call)
        per_layer.append({"layer": n, **{name: row_differences(a, b) for name, a, b in pairs}})
    found["layers"] = {"sequence": index, "length": len(seq),
                       "engine_layer_calls": sum(len(c) for c in engine_calls.values()), "per_layer": per_layer}  # fmt: skip
print(RESULT, json.dumps(found if len(found) > 1 else found["decode_vs_prefill"]), flush=True)
