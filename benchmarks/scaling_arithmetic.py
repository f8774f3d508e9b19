"""Several GPUs and several nodes, on paper: the arithmetic behind docs/contributing/scaling-details.md, from the
library's own rules.

Nothing here runs on a GPU. Each Qwen3 shape is built on the meta device from a transformers config; the FP8 layers
are the ones `plan_fp8_conversion` picks by default, and every rule is the library's own:

a. FSDP2 alignment (`trl_fp8.distributed.shard_rows_align`): at 2-64 shards, whether each weight kind's shards hold
   whole 128-row blocks (then the FP8 data and float32 scales are all-gathered; otherwise the weight is gathered
   whole in BF16 and quantized), and the bytes the vLLM sync gathers per step with that rule, against always
   gathering BF16 and against gathering the float32 masters (a plain `full_tensor()` of accelerate's FSDP2
   parameters);
b. vLLM tensor parallel 1-8 (`trl_fp8.rollout.vllm.partitions`): each rank's partition of every FP8 layer, the sizes
   `check_tensor_parallel` accepts, and where experts need vLLM's expert parallelism;
c. the FP8 sync per step: the bytes each colocated engine receives and what crosses NVLink, InfiniBand or the
   network to a `trl vllm-serve` server, with the time at the link's peak bandwidth (`LINKS`: assumptions);
d. per-GPU memory of weights, gradients and optimizer states (and what stays beside them: DDP's buckets, FSDP2's
   gathered layers, NCCL's buffers; `trl_fp8.plan.memory.trainer_memory_per_gpu`) under DDP, HSDP (sharded in
   a node of 8 GPUs, replicated across nodes) and FSDP2 over every GPU, at 1-8 nodes; and the training's own traffic: the gradient
   reduction of an optimizer step and the weight all-gathers of a micro-batch, and what of it leaves each node.

    python -m benchmarks.scaling_arithmetic [--models Qwen3-8B ...] [--out results.json]

Writes benchmarks/results/scaling_arithmetic.json (with the harness's metadata) and prints the tables as Markdown.
Bytes on links are in GB (1e9, as the GB/s of the links); memory in GiB.
"""

from __future__ import annotations

import math

import torch

from benchmarks.common import RESULTS, arg_parser, metadata, write_json
from trl_fp8.config import BLOCK
from trl_fp8.distributed import shard_rows_align
from trl_fp8.plan.memory import trainer_memory_per_gpu
from trl_fp8.requirements import is_bitsandbytes_optimizer
from trl_fp8.rollout.capacity import ModelShape
from trl_fp8.rollout.vllm.partitions import KV_PROJECTIONS, ROW_PARALLEL, check_tensor_parallel, partition_shape

GB, GiB = 1e9, 2**30
# The published shapes (the models' config.json), untied embeddings as the three checkpoints have.
MODELS = {
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "Qwen3-32B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1),
}  # fmt: skip
SHARDS = (2, 4, 8, 16, 32, 64)  # FSDP2 shard counts
TP_SIZES = (1, 2, 4, 8)  # vLLM tensor_parallel_size
NODES = (1, 2, 4, 8)
GPUS_PER_NODE = 8
# Link bandwidths, one direction, at their peak: NCCL reaches less (about 80% on large messages, far less on small
# ones), so every time below is a lower bound.
LINKS = {
    "nvlink": {"GB/s": 450.0, "what": "NVLink 4 inside an H100 SXM node: 450 GB/s each way per GPU (900 GB/s both)"},
    "infiniband": {"GB/s": 50.0, "what": "InfiniBand NDR400 between nodes: one 400 Gb/s adapter per GPU, 50 GB/s "
                                         "each, 8 per node (rail-optimized, as in DGX H100 clusters)"},
    "server": {"GB/s": 25.0, "what": "the trainer's main process to a `trl vllm-serve` server on another machine: one "
                                     "200 Gb/s link, 25 GB/s (NCCL over InfiniBand or RoCE; TCP gets less)"},
}  # fmt: skip
# A ring collective over several nodes splits its data over one ring per adapter: each node's adapters together carry
# (W-1)/W of the data each way (2(W-1)/W for an all-reduce), the node's 8 adapters at once.
NICS_PER_NODE = GPUS_PER_NODE
# Memory per GPU: the library's own account of several training processes (`trainer_memory_per_gpu`, as `trl-fp8
# plan` sizes them). DDP: the whole model per GPU (BF16 weights, gradients in DDP's buckets, AdamW's moments in BF16
# or 8-bit, the FP8 weight cache). FSDP2, as TRL's fsdp2.yaml launches it: float32 masters and gradients, AdamW's
# moments in float32 or 8-bit, sharded; the units it computes gathered whole in BF16; no FP8 weight cache. HSDP holds
# what FSDP2 over the 8 GPUs of its node holds. Activations, logits and vLLM's share are left out.
MEMORY_PARTS = ("weights", "gradients", "optimizer", "fp8_weight_cache", "ddp_buckets", "gathered_units",
                "nccl_buffers")  # fmt: skip
OPTIMIZERS = ("adamw_torch", "adamw_bnb_8bit")
ASSUMPTIONS = {
    "links": LINKS,
    "times": "bytes over the slowest link at its peak bandwidth, lower bounds. Ring all-gather over W GPUs: each GPU "
    "receives (W-1)/W of the gathered bytes over NVLink; across nodes each node's 8 adapters together carry (W-1)/W "
    "of them each way (all-reduce: twice that). Each collective also pays NCCL's latency, which grows with W",
    "nics_per_node": NICS_PER_NODE,
    "memory": "trl_fp8.plan.memory.trainer_memory_per_gpu (DDP: launch='ddp'; HSDP: launch='fsdp2' over the 8 "
    "GPUs of a node; FSDP2: over every GPU), the parts in MEMORY_PARTS; activations, logits and vLLM's share left out. "
    "FSDP2 and HSDP with their gradients reduce-scattered at every micro-batch (accelerate's sync_each_batch, or one "
    "micro-batch a step); under the Trainer's gradient accumulation without it, every GPU also keeps the whole "
    "model's gradients unsharded in BF16 between micro-batches, 2 bytes a parameter",
    "gradient_reduction": "accelerate's FSDP2 policy reduces gradients in BF16 (reduce_dtype = param_dtype); DDP "
    "all-reduces BF16 gradients",
    "units": "links in GB (1e9 bytes), memory in GiB",
}


# --- the models, on the meta device ------------------------------------------------------------------------------


def build(name: str):
    """The model `name` on the meta device (no memory) and the FP8 layers `plan_fp8_conversion` picks by default."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_fp8.nn.conversion import plan_fp8_conversion

    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), tie_word_embeddings=False, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _, planned = plan_fp8_conversion(model, warn=False)
    return config, model, {n for n, _ in planned}


def tensors(model, fp8_modules: set[str]) -> list[dict]:
    """Every parameter: its name, kind (`q_proj`, `experts.gate_up_proj`, `other`), shape, and whether it is an FP8
    weight; the rows FSDP2 shards (dim 0: a linear weight's outputs in blocks of 128, stacked experts by expert)."""
    rows = []
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        fp8 = prefix in fp8_modules and (leaf == "weight" or p.dim() == 3)
        kind = "other"
        if fp8:
            kind = f"experts.{leaf}" if p.dim() == 3 else prefix.rpartition(".")[2]
        rows.append({"name": name, "kind": kind, "shape": tuple(p.shape), "numel": p.numel(), "fp8": fp8,
                     "rows_per_block": 1 if p.dim() == 3 else BLOCK})  # fmt: skip
    return rows


def fp8_bytes(shape: tuple[int, ...]) -> int:
    """One byte a weight and a float32 scale per 128x128 block of each matrix (each expert's, for stacked experts)."""
    *lead, n, k = shape
    return math.prod(shape) + 4 * math.prod(lead) * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)


def aligned(t: dict, shards: int) -> bool:
    return shard_rows_align(t["shape"][0], shards, t["rows_per_block"])


def gathered_bytes(ts: list[dict], shards: int) -> dict:
    """What the sync all-gathers per step over `shards` FSDP2 shards: FP8 layers by the rule, all BF16 or all
    float32; the other tensors (embeddings, norms, lm_head, routers) in BF16 (float32 for `full_tensor()` of the
    masters); and how many collectives (an aligned FP8 weight: data and scales; everything else: one)."""
    fp8 = [t for t in ts if t["fp8"]]
    rest = [t for t in ts if not t["fp8"]]
    split = [t for t in fp8 if not aligned(t, shards)]
    in_bf16 = {id(t) for t in split}
    return {
        "shards": shards,
        "fp8_weights": len(fp8),
        "fp8_weights_gathered_in_bf16": len(split),
        "fp8_layers_rule": sum(2 * t["numel"] if id(t) in in_bf16 else fp8_bytes(t["shape"]) for t in fp8),
        "fp8_layers_bf16": sum(2 * t["numel"] for t in fp8),
        "fp8_layers_fp32": sum(4 * t["numel"] for t in fp8),
        "rest_bf16": sum(2 * t["numel"] for t in rest),
        "rest_fp32": sum(4 * t["numel"] for t in rest),
        "collectives": 2 * (len(fp8) - len(split)) + len(split) + len(rest),
    }


# --- a. FSDP2 alignment ------------------------------------------------------------------------------------------


def alignment(model_name: str, ts: list[dict]) -> list[dict]:
    """One row per FP8 weight kind: its shape and, per shard count, whether the shards hold whole blocks."""
    kinds = {}
    for t in ts:
        if t["fp8"]:
            kinds.setdefault(t["kind"], t)
    return [{"model": model_name, "kind": kind, "shape": list(t["shape"]), "rows_per_block": t["rows_per_block"],
             "aligned": {str(w): aligned(t, w) for w in SHARDS}} for kind, t in kinds.items()]  # fmt: skip


# --- b. vLLM tensor parallel -------------------------------------------------------------------------------------


# vLLM splits the vocabulary of the embedding and the lm_head over the ranks; norms and routers are replicated.
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def engine_rank_bytes(ts: list[dict], parts: dict, tp: int) -> int:
    """The weight bytes one rank of a `tp`-rank FP8 engine holds: its partitions of the FP8 layers (with their
    scales), its share of the BF16 embedding and lm_head, and whole BF16 norms and routers."""
    total = 0
    for t in ts:
        if t["fp8"]:
            p = parts[t["kind"]]
            total += p.get("experts", 1) * fp8_bytes(tuple(p["shape"]))
        elif t["name"].endswith(VOCAB_PARALLEL):
            total += math.ceil(2 * t["numel"] / tp)
        else:
            total += 2 * t["numel"]
    return total


def tensor_parallel(model_name: str, config, model, fp8_modules: set[str], ts: list[dict]) -> list[dict]:
    """Per `tensor_parallel_size`: `check_tensor_parallel`'s answer, and each FP8 weight kind's partition per rank."""
    head_dim = config.head_dim
    kinds = {}
    for t in ts:
        if t["fp8"]:
            kinds.setdefault(t["kind"], t)
    out = []
    for tp in TP_SIZES:
        row = {"model": model_name, "tp": tp, "accepted": True, "error": None, "enable_expert_parallel": False}
        try:
            row["enable_expert_parallel"] = bool(check_tensor_parallel(model, fp8_modules, tp))
        except ValueError as e:
            row.update(accepted=False, error=str(e))
        parts = {}
        for kind, t in kinds.items():
            if kind.startswith("experts."):
                experts, n, k = t["shape"]
                if row["enable_expert_parallel"]:  # whole experts per rank
                    parts[kind] = {"experts": experts // tp, "shape": [n, k], "replicated": False}
                else:  # the intermediate size splits: gate_up's outputs, down's inputs
                    shape = [n // tp, k] if kind == "experts.gate_up_proj" else [n, k // tp]
                    parts[kind] = {"experts": experts, "shape": shape, "replicated": False}
                continue
            n, k = t["shape"]
            pn, pk = partition_shape(kind, n, k, tp, head_dim)
            replicated = kind in KV_PROJECTIONS and tp > 1 and n // tp < head_dim
            parts[kind] = {"shape": [pn, pk], "replicated": replicated,
                           "split": "inputs" if kind in ROW_PARALLEL else "outputs"}  # fmt: skip
        row["partitions"] = parts
        row["whole_blocks"] = all(p["shape"][0] % BLOCK == 0 and p["shape"][1] % BLOCK == 0 for p in parts.values())
        row["kv_replicated"] = any(p["replicated"] for p in parts.values())
        row["weight_bytes_per_gpu"] = engine_rank_bytes(ts, parts, tp)
        out.append(row)
    return out


# --- c. the FP8 sync per step ------------------------------------------------------------------------------------


def ring(nbytes: float, gpus: int, all_reduce: bool = False) -> dict:
    """A ring collective of `nbytes` over `gpus` GPUs (8 a node): the bytes each GPU moves over NVLink, the bytes each
    node's adapters carry out (and in) when it spans nodes, and the time at the slower of the two links' peak."""
    moved = (2 if all_reduce else 1) * (gpus - 1) / gpus * nbytes
    across = moved if gpus > GPUS_PER_NODE else 0.0
    seconds = max(moved / (LINKS["nvlink"]["GB/s"] * GB), across / (NICS_PER_NODE * LINKS["infiniband"]["GB/s"] * GB))
    return {"nvlink_bytes_per_gpu": moved, "infiniband_bytes_per_node": across, "seconds": seconds}


def sync(model_name: str, ts: list[dict]) -> list[dict]:
    """The weight sync of one step: what each colocated engine receives, and per launch what crosses which link, for
    FP8 rollouts (the rule), BF16 rollouts and a `full_tensor()` of float32 masters."""
    engine = sum(fp8_bytes(t["shape"]) if t["fp8"] else 2 * t["numel"] for t in ts)
    engine_bf16 = sum(2 * t["numel"] for t in ts)
    rows = [{"model": model_name, "launch": "DDP or ZeRO-1/2, colocated", "gpus": None, "engine_bytes": engine,
             "engine_bytes_bf16": engine_bf16, "fp8": None, "bf16": None, "fp32": None,
             "note": "each rank pushes its own copy into its engine: nothing crosses a link"}]  # fmt: skip
    for nodes in NODES:
        w = nodes * GPUS_PER_NODE
        g = gathered_bytes(ts, w)
        gathers = {"fp8": g["fp8_layers_rule"] + g["rest_bf16"], "bf16": g["fp8_layers_bf16"] + g["rest_bf16"],
                   "fp32": g["fp8_layers_fp32"] + g["rest_fp32"]}  # fmt: skip
        launch = "FSDP2 in one node, or HSDP over any number of nodes" if nodes == 1 else f"FSDP2 over {nodes} nodes"
        rows.append({"model": model_name, "launch": f"{launch}, colocated", "gpus": w, "engine_bytes": engine,
                     "engine_bytes_bf16": engine_bf16, **{k: ring(v, w) for k, v in gathers.items()},
                     "fp8_weights_gathered_in_bf16": g["fp8_weights_gathered_in_bf16"],
                     "fp8_weights": g["fp8_weights"], "collectives": g["collectives"],
                     "note": f"all-gather over {w} GPUs, one tensor at a time"
                     + (": each node gathers from its own 8 shards, nothing crosses nodes" if nodes == 1 else "")})  # fmt: skip
    server = LINKS["server"]["GB/s"] * GB
    rows.append({"model": model_name, "launch": "server on another machine", "gpus": None, "engine_bytes": engine,
                 "engine_bytes_bf16": engine_bf16, "fp8": {"server_bytes": engine, "seconds": engine / server},
                 "bf16": {"server_bytes": engine_bf16, "seconds": engine_bf16 / server}, "fp32": None,
                 "note": "the trainer's main process sends the whole model once (under FSDP2, after the ranks' "
                         "all-gather); the server's ranks keep their partitions"})  # fmt: skip
    return rows


# --- d. memory per GPU: DDP, HSDP, FSDP2 over every GPU -----------------------------------------------------------


def per_gpu(shape: ModelShape, optim: str, processes: int, launch: str) -> dict[str, int]:
    """One GPU's share of the training state (`MEMORY_PARTS`) when `processes` GPUs train together."""
    parts = trainer_memory_per_gpu(shape, num_processes=processes, launch=launch, optim=optim,
                                   accumulates_gradients=False)  # fmt: skip
    return {key: parts.get(key, 0) for key in MEMORY_PARTS}


def memory(model_name: str, config) -> list[dict]:
    """Per node count and optimizer: the trainer's weights, gradients and optimizer states per GPU under DDP, HSDP
    (shards of 8) and FSDP2 over every GPU, with what each holds beside them (buckets, gathered layers, NCCL)."""
    shape = ModelShape.from_config(config)
    rows = []
    for optim in OPTIMIZERS:
        hsdp = per_gpu(shape, optim, GPUS_PER_NODE, "fsdp2")
        for nodes in NODES:
            w = nodes * GPUS_PER_NODE
            parts = {"ddp": per_gpu(shape, optim, w, "ddp"), "hsdp": hsdp, "fsdp2": per_gpu(shape, optim, w, "fsdp2")}
            rows.append({"model": model_name, "optim": optim, "nodes": nodes, "gpus": w,
                         **{f"{k}_bytes": sum(v.values()) for k, v in parts.items()},
                         **{f"{k}_parts": v for k, v in parts.items()}})  # fmt: skip
    return rows


def training_traffic(model_name: str, ts: list[dict]) -> list[dict]:
    """Per node count: the BF16 gradient reduction of an optimizer step and the BF16 weight all-gathers of one
    micro-batch (forward, and backward's recompute), under DDP, HSDP and FSDP2 over every GPU."""
    grads = 2 * sum(t["numel"] for t in ts)  # BF16, as the weights FSDP2 gathers
    rows = []
    for nodes in NODES:
        w = nodes * GPUS_PER_NODE
        in_node = ring(grads, GPUS_PER_NODE)  # HSDP: reduce-scatter in the node...
        # ...and each GPU all-reduces its 1/8 with its peers of the same local rank, over its own adapter; the two
        # overlap (one bucket reduces in the node while the previous one crosses), as a ring's hops do
        across = 2 * (nodes - 1) / nodes * grads / GPUS_PER_NODE
        hsdp_grads = {
            "nvlink_bytes_per_gpu": in_node["nvlink_bytes_per_gpu"],
            "infiniband_bytes_per_node": across * NICS_PER_NODE,
            "seconds": max(in_node["seconds"], across / (LINKS["infiniband"]["GB/s"] * GB)),
        }
        weights = ring(grads, w)
        rows.append({"model": model_name, "nodes": nodes, "gpus": w,
                     "ddp_gradients": ring(grads, w, all_reduce=True), "hsdp_gradients": hsdp_grads,
                     "fsdp2_gradients": ring(grads, w),
                     "hsdp_weights": {k: 2 * v for k, v in ring(grads, GPUS_PER_NODE).items()},
                     "fsdp2_weights": {k: 2 * v for k, v in weights.items()}})  # fmt: skip
    return rows


# --- Markdown -----------------------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def gb(x: float) -> str:
    return "0" if not x else f"{x / GB:.2f}" if x < 10 * GB else f"{x / GB:.1f}"


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:,.0f}"


def report(result: dict) -> str:
    out = []
    kinds_by_model: dict[str, list[dict]] = {}
    for r in result["alignment"]:
        kinds_by_model.setdefault(r["model"], []).append(r)
    out.append("### FSDP2 shards and 128-row blocks\n")
    out.append("Whether each shard holds whole 128-row blocks (yes: FP8 data and scales are gathered; BF16: the "
               "weight is gathered whole in BF16, then quantized). Stacked experts shard by expert.\n")  # fmt: skip
    for model, rows in kinds_by_model.items():
        out.append(f"**{model}**\n")
        out.append(table(["weight", "shape", *[f"{w} shards" for w in SHARDS]],
                         [[r["kind"], "x".join(map(str, r["shape"])), *["yes" if r["aligned"][str(w)] else "BF16"
                                                                         for w in SHARDS]] for r in rows]))  # fmt: skip
        out.append("")
    out.append("Bytes the vLLM sync all-gathers per step (the whole tensors each GPU ends up with, GB): the FP8 "
               "layers by the rule, always in BF16, or as float32 masters; the other tensors in BF16.\n")  # fmt: skip
    rows = [[g["model"], g["shards"], f"{g['fp8_weights_gathered_in_bf16']} / {g['fp8_weights']}",
             gb(g["fp8_layers_rule"]), gb(g["fp8_layers_bf16"]), gb(g["fp8_layers_fp32"]), gb(g["rest_bf16"]),
             g["collectives"]] for g in result["gather_bytes"]]  # fmt: skip
    out.append(table(["model", "shards", "FP8 weights gathered in BF16", "FP8 layers: the rule", "all BF16",
                      "fp32 masters", "other tensors (BF16)", "collectives"], rows))  # fmt: skip

    out.append("\n### vLLM tensor parallel: each rank's part of the FP8 layers\n")
    by_model: dict[str, list[dict]] = {}
    for r in result["tensor_parallel"]:
        by_model.setdefault(r["model"], []).append(r)
    for model, rows in by_model.items():
        out.append(f"**{model}** (N x K per rank; experts: per expert)\n")
        kinds = list(rows[0]["partitions"])

        def cell(p):
            text = "x".join(map(str, p["shape"]))
            if "experts" in p:
                text = f"{p['experts']} x {text}"
            return text + (" (replicated)" if p["replicated"] else "")

        body = [[k, *[cell(r["partitions"][k]) for r in rows]] for k in kinds]
        body.append(["weights per GPU (GB)", *[gb(r["weight_bytes_per_gpu"]) for r in rows]])
        verdicts = [
            ("yes" if r["accepted"] else "refused") + (", expert parallel" if r["enable_expert_parallel"] else "")
            for r in rows
        ]
        body.append(["accepted", *verdicts])
        out.append(table(["weight", *[f"TP={r['tp']}" for r in rows]], body))
        out.append("")

    out.append("### The FP8 sync per step\n")
    for link in LINKS.values():
        out.append(f"- {link['what']}")
    out.append("")
    rows = []
    for r in result["sync"]:
        fp8 = r["fp8"]
        if fp8 is None:
            on_link = "0"
        elif "server_bytes" in fp8:
            on_link = f"{gb(fp8['server_bytes'])} (server link)"
        elif fp8["infiniband_bytes_per_node"]:
            on_link = f"{gb(fp8['infiniband_bytes_per_node'])} per node (InfiniBand)"
        else:
            on_link = f"{gb(fp8['nvlink_bytes_per_gpu'])} per GPU (NVLink)"
        in_bf16 = f"{r['fp8_weights_gathered_in_bf16']} / {r['fp8_weights']}" if "fp8_weights" in r else "-"
        rows.append([r["model"], r["launch"], gb(r["engine_bytes"]), in_bf16, on_link,
                     *[ms(r[k]["seconds"]) if r[k] else "-" for k in ("fp8", "bf16", "fp32")]])  # fmt: skip
    out.append(table(["model", "launch", "into each engine (GB)", "FP8 weights gathered in BF16",
                      "on the slowest link (GB)", "ms, FP8", "ms, BF16 rollouts", "ms, fp32 full_tensor()"],
                     rows))  # fmt: skip

    out.append("\n### Training state per GPU (GiB)\n")
    # trl-fp8 refuses bitsandbytes' optimizers under FSDP2 (their update ops do not take its shards): what those
    # launches would hold with them stays in the JSON, the table says refused.
    rows = [[r["model"], r["optim"], r["nodes"], r["gpus"], gib(r["ddp_bytes"]),
             *(["refused"] * 2 if is_bitsandbytes_optimizer(r["optim"]) else
               [gib(r["hsdp_bytes"]), gib(r["fsdp2_bytes"])])] for r in result["memory"]]  # fmt: skip
    out.append(table(["model", "optimizer", "nodes", "GPUs", "DDP", "HSDP (shards of 8)", "FSDP2 over all GPUs"],
                     rows))  # fmt: skip

    out.append("\n### Training traffic: ms at the links' peak\n")
    rows = []
    for r in result["training_traffic"]:
        ib = " / ".join(gb(r[f"{k}_gradients"]["infiniband_bytes_per_node"]
                           + r.get(f"{k}_weights", {}).get("infiniband_bytes_per_node", 0))
                        for k in ("ddp", "hsdp", "fsdp2"))  # fmt: skip
        rows.append([r["model"], r["nodes"], r["gpus"],
                     *[ms(r[f"{k}_gradients"]["seconds"]) for k in ("ddp", "hsdp", "fsdp2")],
                     ms(r["hsdp_weights"]["seconds"]), ms(r["fsdp2_weights"]["seconds"]), ib])  # fmt: skip
    out.append(table(["model", "nodes", "GPUs", "gradients per step: DDP", "HSDP", "FSDP2 over all",
                      "weights per micro-batch: HSDP", "FSDP2 over all",
                      "GB leaving each node, one micro-batch a step: DDP / HSDP / FSDP2"], rows))  # fmt: skip
    return "\n".join(out)


def compute(models: list[str]) -> dict:
    result = {
        "models": {},
        "alignment": [],
        "gather_bytes": [],
        "tensor_parallel": [],
        "sync": [],
        "memory": [],
        "training_traffic": [],
    }
    for name in models:
        config, model, fp8_modules = build(name)
        ts = tensors(model, fp8_modules)
        result["models"][name] = {
            "config": MODELS[name],
            "params": sum(t["numel"] for t in ts),
            "fp8_params": sum(t["numel"] for t in ts if t["fp8"]),
            "fp8_weights": sum(t["fp8"] for t in ts),
        }
        result["alignment"] += alignment(name, ts)
        result["gather_bytes"] += [{"model": name, **gathered_bytes(ts, w)} for w in SHARDS]
        result["tensor_parallel"] += tensor_parallel(name, config, model, fp8_modules, ts)
        result["sync"] += sync(name, ts)
        result["memory"] += memory(name, config)
        result["training_traffic"] += training_traffic(name, ts)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = arg_parser(__doc__, out="benchmarks/results/scaling_arithmetic.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    result = {"benchmark": "multi-GPU arithmetic: FSDP2 alignment, vLLM partitions, the FP8 sync, memory per GPU",
              **metadata(argv=argv), "assumptions": ASSUMPTIONS, **compute(args.models)}  # fmt: skip
    print(report(result))
    print(f"\nwrote {write_json(args.out or RESULTS / 'scaling_arithmetic.json', result)}")
    return result


if __name__ == "__main__":
    main()
