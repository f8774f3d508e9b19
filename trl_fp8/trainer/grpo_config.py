"""`FP8GRPOConfig`: TRL's `GRPOConfig` with the FP8 fields of `FP8TrainingArguments` and the rollout corrections
(token-level TIS mapped onto TRL's own importance-sampling fields, the mismatch metrics, scoring in the training
forward)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_fp8.field_docs import field_help
from trl_fp8.rollout.vllm.exact import release_not_exact
from trl_fp8.trainer.config import FP8TrainingArguments

TIS_MODES = ("auto", "token", "off")
TIS_CAP_DEFAULT = 2.0  # veRL's and NeMo RL's cap for FP8 rollouts
# TRL's importance-sampling fields, which tis="token" sets and tis="auto" leaves to a user who set them
TRL_IS_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                 "vllm_importance_sampling_cap")  # fmt: skip


@dataclass
class FP8GRPOConfig(FP8TrainingArguments, GRPOConfig):
    r"""Configuration for `FP8GRPOTrainer`: every field of TRL's `GRPOConfig`, the FP8 fields of
    `FP8TrainingArguments` (the precision flow, vLLM rollouts, saving), and the rollout corrections below.

    Args:
        log_rollout_mismatch (bool): With vLLM, always score the rollouts with the trainer (one extra forward when no
            importance sampling needs it) and log the trainer-vs-rollout mismatch (`fp8/mismatch/*`).
        tis (str | None): `"token"`: token-level TIS, `min(pi_train / pi_rollout, tis_cap)` per token (TRL's
            `token_truncate` mode with vLLM; applied by this trainer to any other rollout that returns its own
            log-probs). `"auto"` (default): token-level TIS, unless TRL's own `vllm_importance_sampling_*` fields are
            set to something else, which then stands; unlike `"token"`, never refused for having nothing to correct.
            `"off"`: no correction. `None`: TRL's `vllm_importance_sampling_*` fields as they are (TRL's default:
            `sequence_mask`). Every FP8 run measured for trl-fp8's accuracy and speed used token TIS, as Jet-RL, NeMo
            RL and veRL do for FP8 rollouts.
        tis_cap (float): Upper clip of the token ratio (veRL and NeMo RL use 2.0 for FP8 rollouts).
        score_in_training_forward (bool | None): Take the trainer's log-probs of the rollout tokens (for the
            importance-sampling ratio and the mismatch metrics) from each micro-batch's own training forward, detached,
            instead of a no-grad forward over the whole rollout before the micro-batches (TRL's scoring pass): one
            forward pass fewer per step, the same values where every rollout is trained on within one optimizer step
            (`gradient_accumulation_steps` a multiple of `steps_per_generation` x `num_iterations`, TRL's default),
            since the weights are then the same in both forwards. `None`: on there. The metrics are then summed over
            the rollout batch's micro-batches and logged once, after its last: the values TRL's scoring pass logs (a
            micro-batch trained on again, `num_iterations > 1`, is not scored again).
        exact_on_policy (bool): Make the trainer's log-probabilities of the rollout tokens equal vLLM's bit for bit
            (KL = 0, an importance ratio of exactly 1): the colocated engine runs in vLLM's batch-invariant mode
            (DeepGEMM, FlashAttention with one split, no compilation, no prefix cache) and the trainer's forward calls
            the engine's own kernels op by op (`trl_fp8.nn.exact_forward`), with its usual backward. Needs a dense
            Qwen3, Llama or Qwen2 model, `vllm_mode="colocate"` on one GPU and plain sampling (no top-p, top-k, min-p
            or penalties). The KV cache is BF16 unless `fp8_kv_cache=True` asks for FP8 (then the trainer quantizes
            its queries, keys and values as the engine does, with the engine's scales). Needs vLLM 0.31 (0.26's
            batch-invariant mode is not exact). Exact with the BF16 cache, 512-token completions included; with the
            FP8 cache only on short sequences (FlashAttention-3's FP8 decode parts from its prefill from position
            127), so keep TIS on there (docs/rollouts.md).
    """

    log_rollout_mismatch: bool = field(default=True, metadata=field_help(__doc__, "log_rollout_mismatch"))
    tis: str | None = field(default="auto", metadata=field_help(__doc__, "tis"))
    tis_cap: float = field(default=TIS_CAP_DEFAULT, metadata=field_help(__doc__, "tis_cap"))
    score_in_training_forward: bool | None = field(
        default=None, metadata=field_help(__doc__, "score_in_training_forward")
    )
    exact_on_policy: bool = field(default=False, metadata=field_help(__doc__, "exact_on_policy"))

    def __post_init__(self):
        if isinstance(self.tis, str) and self.tis.lower() in ("none", "null", ""):
            self.tis = None
        if self.tis is not None and self.tis not in TIS_MODES:
            raise ValueError(f"tis={self.tis!r} is unknown; use 'auto' (the default), 'token', 'off' or None.")
        if not self.tis_cap > 1.0:
            raise ValueError(
                f"tis_cap must be > 1 (a cap at or below 1 down-weights every token), got {self.tis_cap}."
            )
        self._check_exact_on_policy()
        self._check_fp8_fields()
        self._refuse_tis_conflicts()
        # Map onto TRL's own fields before its __post_init__ validates them (TRL's trainer reads them from there);
        # whether token TIS then corrects anything, and who applies it, is the run plan's (`choose_token_tis`).
        if self.tis_asks_for_token():
            self.vllm_importance_sampling_correction = True
            self.vllm_importance_sampling_mode = "token_truncate"
            self.vllm_importance_sampling_clip_max = self.tis_cap
        elif self.tis == "off":
            self.vllm_importance_sampling_correction = False
        self._finish_post_init()
        if self.exact_on_policy and self.world_size > 1:
            raise ValueError(
                f"exact_on_policy=True runs on one process for now ({self.world_size} here): launch on one GPU."
            )
        if self.score_in_training_forward and not self.rollouts_train_within_one_step():
            raise ValueError(
                "score_in_training_forward=True takes the trainer's log-probs of a rollout from the training forward, "
                "which equals a scoring pass before the micro-batches only if every rollout is trained on within one "
                f"optimizer step: gradient_accumulation_steps={self.gradient_accumulation_steps} must be a multiple "
                f"of steps_per_generation x num_iterations = {self.steps_per_generation} x {self.num_iterations}. "
                "Align them, or set score_in_training_forward=False (the scoring pass)."
            )

    def _check_exact_on_policy(self) -> None:
        """Refuse, naming the fix, what exact mode cannot make exact; settle the FP8 KV cache to BF16."""
        if not self.exact_on_policy:
            return
        needs = []
        if not self.use_vllm or self.vllm_mode != "colocate":
            needs.append("use_vllm=True with vllm_mode='colocate' (the trainer calls the engine's kernels in-process)")
        if self.rollout_precision not in (None, "fp8", "bf16"):
            needs.append(
                f"rollout_precision 'fp8' or 'bf16', not {self.rollout_precision!r} (vLLM's own quantization)"
            )
        if self.vllm_fp8_backend not in ("auto", "deepgemm"):
            needs.append(f"vllm_fp8_backend 'auto' or 'deepgemm', not {self.vllm_fp8_backend!r} (DeepGEMM is the "
                         "block-FP8 kernel whose rows do not depend on the batch)")  # fmt: skip
        if getattr(self, "vllm_tensor_parallel_size", 1) != 1:
            needs.append("vllm_tensor_parallel_size=1")
        plain = {"top_p": (1.0,), "top_k": (None, 0, -1), "min_p": (None, 0.0), "repetition_penalty": (1.0,)}
        for name, neutral in plain.items():
            if getattr(self, name, neutral[0]) not in neutral:
                needs.append(f"{name}={neutral[0]!r}, not {getattr(self, name)!r} (the engine's log-probabilities "
                             "would be of the filtered distribution)")  # fmt: skip
        if (not_exact := release_not_exact()) is not None:
            needs.append(f"vLLM 0.31 (pip install 'trl-fp8[vllm]'): {not_exact}")
        if needs:
            raise ValueError("exact_on_policy=True needs " + "; ".join(needs) + ".")
        if self.fp8_kv_cache is None:  # a BF16 cache unless asked (None would let the planner choose FP8)
            self.fp8_kv_cache = False

    def tis_asks_for_token(self) -> bool:
        """Whether `tis` asks for token-level TIS: `"token"`, or `"auto"` with TRL's own importance-sampling fields
        unset (TRL's fields as token TIS sets them count as unset, so the answer holds after the mapping). Whether it
        corrects anything, and who applies it, is the run plan's decision (`FP8RunPlan.token_tis`)."""
        return self.tis == "token" or (self.tis == "auto" and not self.trl_is_fields_set())

    def trl_is_fields_set(self) -> list[str]:
        """TRL's importance-sampling fields set to something else than TRL's defaults or what token TIS sets them to
        (`name=value` each): where `tis="auto"` leaves the user's settings."""
        trl_defaults = {f.name: f.default for f in fields(GRPOConfig)}
        token = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
                 "vllm_importance_sampling_clip_max": self.tis_cap}  # fmt: skip
        unset = {name: (trl_defaults.get(name), token.get(name, trl_defaults.get(name))) for name in TRL_IS_FIELDS}
        return [f"{name}={getattr(self, name)!r}" for name in TRL_IS_FIELDS
                if hasattr(self, name) and getattr(self, name) not in unset[name]]  # fmt: skip

    def rollouts_train_within_one_step(self) -> bool:
        """Whether every rollout is trained on within one optimizer step (TRL's condition for not scoring old
        log-probs), so that the weights a rollout was sampled with are the weights of all its micro-batches."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) == 0

    def _refuse_tis_conflicts(self) -> None:
        """Raise where TRL's own importance-sampling fields say otherwise than `tis`; warn on a cap nothing uses."""
        if self.tis == "token":
            trl_defaults = {f.name: f.default for f in fields(GRPOConfig)}
            if self.vllm_importance_sampling_correction is False:
                raise ValueError(
                    "tis='token' turns TRL's importance-sampling correction on, but "
                    "vllm_importance_sampling_correction=False turns it off. Drop one of them (tis='off' is the way "
                    "to say off)."
                )
            mode = self.vllm_importance_sampling_mode
            if mode not in (trl_defaults["vllm_importance_sampling_mode"], "token_truncate"):
                raise ValueError(
                    f"tis='token' is TRL's vllm_importance_sampling_mode='token_truncate', but "
                    f"vllm_importance_sampling_mode={mode!r} is set. Drop one of them."
                )
            for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"):
                value = getattr(self, name, None)
                if value not in (trl_defaults.get(name), self.tis_cap):
                    raise ValueError(
                        f"tis='token' clips the ratio at tis_cap={self.tis_cap}, but {name}={value} is set. Set "
                        f"tis_cap={value} instead."
                    )
        elif self.tis_cap != TIS_CAP_DEFAULT and not self.tis_asks_for_token():
            warnings.warn(
                f"tis_cap={self.tis_cap} has no effect without token TIS (TRL's own correction, if on, clips at "
                "vllm_importance_sampling_clip_max).",
                stacklevel=3,
            )
