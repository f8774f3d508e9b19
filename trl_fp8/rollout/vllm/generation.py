"""vLLM rollouts on the trainer's own FP8 weights and scales.

`FP8VLLMGeneration` is TRL's `VLLMGeneration` with four changes, and nothing else copied:

- colocate start-up: vLLM is built from a config-only folder (`config.json` with the block-FP8
  `quantization_config`, tokenizer, generation config) with `load_format="dummy"`; TRL syncs weights before the
  first generation, so the engine never samples from the dummy weights, and nothing is written to disk but configs;
- the tensors pushed at each sync (`_iter_named_params`): for `rollout_precision="fp8"`, every FP8 layer's
  `weight` (float8_e4m3fn) and `weight_scale_inv` (float32) exactly as the trainer's forward uses them, BF16 for the
  rest; plus, with an FP8 KV cache, the q/k/v scales measured on the trainer's forward (`kv_scales.py`);
- colocate sync: vLLM's layerwise `reload_weights` (the only refresh path that works on a running FP8 engine in
  vLLM 0.26; `model.load_weights`, which TRL calls, fails there). Server mode keeps TRL's own path (its client
  streams the same tensors through vLLM's NCCL weight-transfer engine, which also reloads layerwise);
- colocated rollouts ask vLLM for token ids and log-probs only, through TRL's `generation_kwargs`, and read the
  log-probs back from vLLM's flat arrays instead of a dict per token (`sampling.py`).

Rollout precisions: "fp8" (our quantizer makes weights and scales: the unified flow), "bf16", and "fp8_online"
(BF16 weights pushed, vLLM quantizes them itself: the BF16-train / FP8-rollout baseline).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from trl.generation.vllm_generation import VLLMGeneration

from trl_fp8.checkpoint.experts import fp8_experts_layers
from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.config import check_rollout_precision, check_vllm_version
from trl_fp8.nn.adapters import unwrap_model
from trl_fp8.nn.exact_forward import check_exact_model
from trl_fp8.nn.linear import release_fp8_weight_caches
from trl_fp8.ops.exact import ExactKernels
from trl_fp8.rollout.settings import RolloutSettings
from trl_fp8.rollout.stats import RolloutStats, engine_kv_cache_tokens
from trl_fp8.rollout.vllm import act_quant, norm_quant
from trl_fp8.rollout.vllm._compat import (
    engine_attention_scales,
    engine_query_quant,
    engine_rotary_table,
    register_custom_attention,
    shutdown_engine,
)
from trl_fp8.rollout.vllm.attention import KVAttention, attention_heads, choose_kv_attention
from trl_fp8.rollout.vllm.deepgemm_warmup import PrecompileResult, precompile_engine_kernels
from trl_fp8.rollout.vllm.engine import (
    TRL_MAX_NUM_BATCHED_TOKENS,
    apply_engine_env,
    engine_overrides,
    push_to_engine,
    rollout_weight_tensors,
    write_engine_config,
)
from trl_fp8.rollout.vllm.exact import exact_engine, exact_kernels
from trl_fp8.rollout.vllm.experts import NO_FP8_EXPERTS, EngineExperts, quiet_skipped_layers
from trl_fp8.rollout.vllm.kernels import (
    RolloutKernel,
    check_fp8_kv_attention,
    rollout_kernel,
    server_command,
    server_kernel,
)
from trl_fp8.rollout.vllm.partitions import check_tensor_parallel, tensor_parallel_env, tensor_parallel_overrides
from trl_fp8.rollout.vllm.sampling import flat_logprobs_read_directly, with_token_ids_only
from trl_fp8.rollout.vllm.server import check_server_config

logger = logging.getLogger(__name__)

# The colocated engines started in this process, until they shut down (see `shut_down_earlier_engines`).
_STARTED_ENGINES: weakref.WeakSet = weakref.WeakSet()


def shut_down_earlier_engines() -> None:
    """Shut down the engines earlier trainers of this process started, before a new one starts. vLLM keeps one
    distributed state per process and an engine's shutdown tears it down: left to the garbage collector, an earlier
    engine's shutdown can come in the middle of the next engine's start-up (vLLM 0.31), which then loses its world
    group. Also frees the earlier engine's GPU memory before the new engine measures what it may take."""
    for llm in list(_STARTED_ENGINES):
        _STARTED_ENGINES.discard(llm)
        logger.info("Shutting down the vLLM engine an earlier trainer of this process started (one engine a process)")
        shutdown_engine(llm)
    gc.collect()


__all__ = ["FP8VLLMGeneration", "RolloutReport", "check_rollout_class"]


def _choose_op_kernel(engine, module, name: str, label: str) -> None:
    """The kernel of the vLLM op `module` (`act_quant` or `norm_quant`) replaces, for `engine` (an
    `FP8VLLMGeneration`): its `settings.<name>_kernel` "vllm" gives vLLM its kernel back; otherwise
    `module.install_for_model` decides (requiring speed under "auto"), into `engine.report.checked_<name>`, and the
    start-up log says which and why."""
    settings = engine.settings
    if settings.rollout_precision != "fp8":
        return
    kernel = "vllm" if settings.exact else getattr(settings, f"{name}_kernel")  # exact: the trainer calls vLLM's
    if kernel == "vllm":
        if module.installed() is not None:
            module.uninstall()
            logger.info("%s: vLLM's kernel again (FP8Tuning(vllm_%s_kernel='vllm'))", label, name)
        return
    if torch.cuda.is_available():
        choice = module.install_for_model(
            unwrap_model(engine.model), engine.accelerator.device, require_faster=kernel == "auto", owner=engine
        )
        setattr(engine.report, f"checked_{name}", choice)
        logger.info("%s: %s", label, choice.reason)


@dataclass
class RolloutReport:
    """What an `FP8VLLMGeneration` settled and did, in one place for the trainer's logs and the benchmarks: the FP8
    linear kernel (`kernel`), the attention kernel of an FP8 KV cache (`kv_attention`), the SiLU-and-mul quantization
    (`act_quant_choice`), the RMSNorm quantization (`norm_quant_choice`) and DeepGEMM's parallel compilation
    (`deepgemm_precompile`) a colocated engine's start-up chose, how long the engine took to start and what its KV
    cache holds, what the engine did in each rollout (`rollout_stats`), the last weight sync's seconds (None once
    logged) and the bytes of FP8 weight copies let go for the last rollout (sleep mode)."""

    kernel: RolloutKernel | None = None
    kv_attention: KVAttention | None = None
    checked_act_quant: act_quant.SiluQuantChoice | None = None  # as the engine's start-up decided (`act_quant_choice`)
    checked_norm_quant: norm_quant.NormQuantChoice | None = None  # likewise (`norm_quant_choice`)
    deepgemm_precompile: PrecompileResult | None = None
    engine_start_seconds: float | None = None
    kv_cache_tokens: int | None = None
    rollout_stats: RolloutStats | None = None
    last_sync_seconds: float | None = None
    released_cache_bytes: int = 0

    @property
    def act_quant_choice(self) -> act_quant.SiluQuantChoice | None:
        """The start-up's SiLU-and-mul decision as it holds now: installed only while trl-fp8's kernel is still in
        force (another engine of the process may have given vLLM its kernel back since)."""
        return act_quant.in_force(self.checked_act_quant)

    @property
    def norm_quant_choice(self) -> norm_quant.NormQuantChoice | None:
        """The start-up's RMSNorm + FP8 quantization decision as it holds now (as `act_quant_choice`)."""
        return norm_quant.in_force(self.checked_norm_quant)


# FlashAttention-3's decode over an FP8 cache does not give every position the bits of its prefill (the trainer's
# call): tests/gpu/test_exactness_gates_gpu.py, on vLLM 0.26 and 0.31, one H200.
FP8_KV_EXACT_CAVEAT = (
    "exact_on_policy=True with fp8_kv_cache=True is exact on short sequences only: FlashAttention-3's decode over an "
    "FP8 cache gives the bits of its prefill at the positions tested below 127 but not from 127 on, so longer "
    "completions keep a mismatch (k3 KL about 2e-3 over 512-token completions of a 76M model), which fp8/mismatch/* "
    "reports and TIS corrects (keep it on). fp8_kv_cache=False is exact (docs/rollouts.md)."
)


class FP8VLLMGeneration(VLLMGeneration):
    """TRL's vLLM generation whose rollouts run on the trainer's own FP8 weights (see the module docstring).

    Takes `VLLMGeneration`'s arguments plus `settings`, the run plan's `RolloutSettings` (default: its defaults;
    `trl_fp8.rollout.settings` describes each field).
    """

    def __init__(self, *args, settings: RolloutSettings | None = None, **kwargs):
        settings = RolloutSettings() if settings is None else settings
        check_rollout_precision(settings.rollout_precision)
        self.settings = settings
        self._fp8_modules = None if settings.fp8_modules is None else set(settings.fp8_modules)
        self.report = RolloutReport()  # what the engine's start-up settled and what the rollouts and syncs did
        self.engine_dir: Path | None = None
        self.exact_rotary_table: torch.Tensor | None = None  # exact mode: the engine's rotary table, for the trainer
        self.exact_kernels: ExactKernels | None = None  # exact mode: vLLM's kernels for the trainer's ops
        # exact mode with an FP8 KV cache: each layer's (q, k, v) scales as the engine holds them since the last sync
        self.exact_kv_scales: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        # colocate: writes FP8 experts in place (None until the first sync decides; False: the reload for all)
        self.engine_experts: EngineExperts | None | bool = None
        super().__init__(*args, **kwargs)
        if self.mode == "colocate" and settings.token_ids_only:
            # TRL merges these into each colocated rollout's SamplingParams (a server answers in OpenAI's format).
            self.generation_kwargs, why = with_token_ids_only(self.generation_kwargs)
            logger.info("vLLM rollout outputs: %s", why)

    def generate(self, *args, **kwargs):
        # TRL reads vLLM's flat log-probs back through a dict and an object per token; read the arrays instead
        with flat_logprobs_read_directly():
            return super().generate(*args, **kwargs)

    @property
    def fp8_modules(self) -> set[str]:
        """Names of the layers vLLM runs in FP8 (empty unless rollout_precision is "fp8"); PEFT or plain, the engine
        config and the pushed tensors compare them as transformers names."""
        if self.settings.rollout_precision != "fp8":
            return set()
        return fp8_module_names(self.model) if self._fp8_modules is None else self._fp8_modules

    # --- start-up ----------------------------------------------------------------------------------------------

    def _init_vllm(self):
        settings = self.settings
        check_vllm_version()  # FSDP1 / ZeRO-3 launches were refused by the trainer before loading
        if self.mode != "colocate":
            if self.accelerator.is_main_process:
                self._check_server()  # before TRL joins the server's NCCL group, which cannot be undone
            super()._init_vllm()
            return
        self.engine_dir = Path(tempfile.mkdtemp(prefix="trl_fp8_vllm_engine_"))
        weakref.finalize(self, shutil.rmtree, str(self.engine_dir), True)
        write_engine_config(self.model, self.processing_class, self.engine_dir, self.fp8_modules)
        if settings.kv_observer is not None:
            check_fp8_kv_attention(self.accelerator.device)
            self._choose_kv_attention()

        # TRL builds `LLM(...)` itself with no knob for these settings: hand it an LLM that takes our overrides.
        import trl.generation.vllm_generation as trl_vllm

        llm_class = trl_vllm.LLM
        if settings.rollout_precision == "fp8":
            if settings.fp8_moe_backend != "auto" and not fp8_experts_layers(unwrap_model(self.model)):
                raise ValueError(
                    f"vllm_fp8_moe_backend={settings.fp8_moe_backend!r} picks the kernel of FP8 experts, but this model "
                    "has no FP8 experts layer (a dense model, or experts kept in BF16). Drop vllm_fp8_moe_backend."
                )
            self.report.kernel = rollout_kernel(
                settings.fp8_backend,
                moe_backend=settings.fp8_moe_backend,
                jit_cache_dir=settings.jit_cache_dir,
                device=self.accelerator.device,
            )
            kernel = self.report.kernel
            if settings.exact and kernel.backend != "deepgemm":
                raise RuntimeError(
                    f"exact_on_policy=True runs the engine's block-FP8 linears on DeepGEMM, which cannot run here "
                    f"({kernel.reason}). Run on a Hopper GPU with nvcc, or set exact_on_policy=False."
                )
            log = logger.warning if settings.fp8_backend == "auto" and kernel.backend != "deepgemm" else logger.info
            log("vLLM block-FP8 kernel for rollouts: %s (%s)", kernel.backend, kernel.reason)
        overrides = engine_overrides(
            self.engine_dir, settings.rollout_precision, settings.kv_observer is not None, self.report.kernel,
            self.report.kv_attention,
        )  # fmt: skip
        overrides.update(check_tensor_parallel(self.model, self.fp8_modules, self.tensor_parallel_size))
        for name, (value, why) in tensor_parallel_overrides(self.tensor_parallel_size).items():
            logger.info("vLLM tensor parallel: %s=%s (%s)", name, value, why)
            overrides[name] = value
        for name, (value, why) in tensor_parallel_env(self.tensor_parallel_size).items():
            logger.info("vLLM tensor parallel: %s=%s (%s)", name, value, why)
            os.environ[name] = value
        apply_engine_env(settings.rollout_precision, self.report.kernel)
        if settings.exact:
            check_exact_model(unwrap_model(self.model))
            exact = exact_engine()
            overrides.update(exact.llm_kwargs)
            os.environ.update(exact.env)
            self.accelerator.print(f"[trl-fp8] vLLM engine in {exact.describe()}.", flush=True)  # a start-up line
        self._choose_act_quant_kernel()
        self._choose_norm_quant_kernel()
        start = time.perf_counter()
        self._precompile_deepgemm()
        shut_down_earlier_engines()
        trl_vllm.LLM = lambda *a, **kw: llm_class(*a, **{**kw, **overrides})
        try:
            super()._init_vllm()
        finally:
            trl_vllm.LLM = llm_class
        # DeepGEMM's kernels are compiled above or in vLLM's warm-up when the JIT cache is cold.
        self.report.engine_start_seconds = time.perf_counter() - start
        _STARTED_ENGINES.add(self.llm)
        if settings.exact:  # read now: a sleeping engine's buffers are gone
            self.exact_rotary_table = engine_rotary_table(self.llm)
            fp8_kv = settings.kv_observer is not None
            # vLLM's kernels, imported now that the engine's environment is set
            self.exact_kernels = exact_kernels(engine_query_quant(self.llm) if fp8_kv else None)
            self._take_exact_kv_scales()
        self.report.rollout_stats = RolloutStats.attach(self.llm)
        self.report.kv_cache_tokens = engine_kv_cache_tokens(self.llm)
        logger.info(
            "vLLM engine started in %.0f s, KV cache %s tokens",
            self.report.engine_start_seconds,
            self.report.kv_cache_tokens,
        )

    def _choose_kv_attention(self) -> None:
        """The decode kernel of the FP8 KV cache (`rollout.vllm.attention`): XQA where it builds and follows the
        scales of every sync on this GPU, else FlashAttention-3; the engine's process gets XQA's settings, and
        trl-fp8's backend is registered here too, as the package's vLLM plugin does where trl-fp8 is installed."""
        if self.settings.exact:  # the trainer attends with the engine's kernel, which is FlashAttention-3's
            if self.settings.kv_attention == "xqa":
                raise ValueError(
                    "exact_on_policy=True decodes the FP8 KV cache with FlashAttention-3, the kernel the trainer "
                    "calls too; drop FP8Tuning(vllm_fp8_kv_attention='xqa')."
                )
            self.report.kv_attention = KVAttention("flash_attn", "FlashAttention-3, as exact mode needs it")
            logger.info("vLLM attention on the FP8 KV cache: %s", self.report.kv_attention.reason)
            logger.warning(FP8_KV_EXACT_CAVEAT)
            return
        self.report.kv_attention = choose_kv_attention(
            self.settings.kv_attention, self.accelerator.device, **attention_heads(unwrap_model(self.model).config)
        )
        choice = self.report.kv_attention
        if choice.kernel == "xqa":
            os.environ.update(choice.env)
            other = register_custom_attention()
            if other is not None:
                raise RuntimeError(
                    f"vLLM's CUSTOM attention backend is already {other}, so trl-fp8's XQA backend cannot run. Use "
                    "FP8Tuning(vllm_fp8_kv_attention='flash_attn')."
                )
        log = logger.warning if choice.kernel != "xqa" and self.settings.kv_attention == "auto" else logger.info
        log("vLLM attention on the FP8 KV cache: %s", choice.reason)

    def _choose_act_quant_kernel(self) -> None:
        """The kernel of vLLM's fused SiLU-and-mul + FP8 quantization for this engine (`act_quant`): a choice other
        engines of the process made holds here only at the same settings (and this engine then keeps it in force
        too), else it is re-checked or undone."""
        _choose_op_kernel(self, act_quant, "act_quant", "vLLM SiLU-and-mul + FP8 quantization")

    def _choose_norm_quant_kernel(self) -> None:
        """The kernel of vLLM's fused RMSNorm (+ residual add) + FP8 quantization for this engine (`norm_quant`), chosen
        as `_choose_act_quant_kernel` chooses its own."""
        _choose_op_kernel(self, norm_quant, "norm_quant", "vLLM RMSNorm + FP8 quantization")

    def _precompile_deepgemm(self) -> None:
        """Compile the engine's DeepGEMM kernels in parallel processes (local main process; the others wait and
        find them in the shared cache) before vLLM's warm-up, which would compile them one at a time."""
        if self.accelerator.is_local_main_process:
            self.report.deepgemm_precompile = precompile_engine_kernels(
                self.report.kernel, self.model, self.fp8_modules, TRL_MAX_NUM_BATCHED_TOKENS,
                workers=self.settings.deepgemm_workers, device=self.accelerator.device.index,
                tensor_parallel=self.tensor_parallel_size,
            )  # fmt: skip
        self.accelerator.wait_for_everyone()

    def _check_server(self) -> None:
        import requests
        from trl.generation.vllm_client import VLLMClient

        settings = self.settings
        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        try:
            client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
        except (ConnectionError, requests.exceptions.ConnectionError) as exc:  # TRL raises the latter
            raise ConnectionError(
                f"{exc} For FP8 rollouts the server must run an FP8 checkpoint of the initial policy: "
                f"`trl-fp8 quantize <model> <fp8_dir>` then `{server_command(server_kernel(settings.fp8_backend))}`."
            ) from exc
        # TRL's get_server_info() returns the config only; the same endpoint also reports the server's VLLM_* settings.
        response = client.session.get(f"{client.base_url}/server_info", params={"config_format": "json"})
        info = response.json() if response.status_code == 200 else {"vllm_config": client.get_server_info()}
        check_server_config(
            info["vllm_config"], self.model, settings.rollout_precision, settings.kv_observer is not None,
            server_env=info.get("vllm_env"), fp8_backend=settings.fp8_backend, fp8_modules=self.fp8_modules,
        )  # fmt: skip

    # --- weight sync -------------------------------------------------------------------------------------------

    def _attention_scales(self) -> dict[str, torch.Tensor] | None:
        observer = self.settings.kv_observer
        if observer is None:
            return None
        scales = observer.scales()
        if torch.distributed.is_available() and torch.distributed.is_initialized() and scales:
            # One scale per layer for every engine: the max over the ranks' observations.
            stacked = torch.stack(list(scales.values())).to(self.accelerator.device)
            torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX)
            scales = dict(zip(scales, stacked.unbind(), strict=True))
        return scales

    def _iter_named_params(self, skip_experts: frozenset[str] | set[str] = frozenset()):
        # DDP / ZeRO-1/2: every rank holds the whole model. FSDP2: each tensor is gathered as it is produced, and TRL
        # walks this on every rank in the same order (in server mode the others discard it). vLLM shards for TP.
        yield from rollout_weight_tensors(
            self.model,
            self.settings.rollout_precision,
            fp8_modules=self.fp8_modules,
            power_of_two_scales=self.settings.power_of_two_scales,
            attention_scales=self._attention_scales(),
            skip_experts=skip_experts,
        )

    def _push_colocated(self) -> None:
        """Everything through vLLM's layerwise reload, except FP8 experts once writing them in place is proven to
        give the engine the same bits (`vllm_experts`: the reload's per-expert path dominated MoE syncs)."""
        if self.engine_experts:
            with quiet_skipped_layers():
                push_to_engine(self.llm, self._iter_named_params(skip_experts=self.engine_experts.names))
            self.engine_experts.write()  # (no request ran since the reload reset the prefix cache)
            return
        push_to_engine(self.llm, self._iter_named_params())
        if self.engine_experts is None and self.settings.rollout_precision == "fp8":
            experts, why = EngineExperts.verified(
                self.model, self.llm, self.fp8_modules, sleep_mode=bool(self.enable_sleep_mode)
            )
            self.engine_experts = experts or False
            if experts is not None:
                logger.info("FP8 experts sync: %s", why)
            elif why != NO_FP8_EXPERTS:
                logger.warning("FP8 experts sync: one tensor per expert through vLLM's reload (slower): %s", why)

    def _take_exact_kv_scales(self) -> None:
        """Exact mode with an FP8 KV cache: copy the scales the engine's next rollouts quantize with, for the trainer
        to score those rollouts with (read while the engine is awake)."""
        if self.settings.exact and self.settings.kv_observer is not None:
            self.exact_kv_scales = engine_attention_scales(self.llm)

    def sync_weights(self):
        start = time.perf_counter()
        if self.mode == "colocate":
            if self.enable_sleep_mode:
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            self._push_colocated()
            self._take_exact_kv_scales()
            if self.enable_sleep_mode:  # the KV cache wakes next: give it the trainer's FP8 copies while it generates
                self.report.released_cache_bytes = release_fp8_weight_caches(self.model)
                torch.cuda.empty_cache()
        else:
            super().sync_weights()  # streams _iter_named_params through TRL's client
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.report.last_sync_seconds = time.perf_counter() - start


def check_rollout_class(generation) -> None:
    """TRL has no factory hook for its rollout class: the trainer swaps the name in TRL's module while TRL builds it.
    Should a TRL release build it another way, rollouts would run on BF16 weights without a word; say so instead."""
    if not isinstance(generation, FP8VLLMGeneration):
        raise RuntimeError(
            f"TRL built its vLLM rollouts as {type(generation).__name__}, not trl-fp8's FP8VLLMGeneration: this TRL "
            "version builds them another way than the ones trl-fp8 supports (see pyproject.toml's trl range). "
            "Install a supported TRL."
        )
