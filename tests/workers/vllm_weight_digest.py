"""A vLLM worker extension for the server-mode identity test: `vllm serve ... --worker-extension-cls
vllm_weight_digest.WeightDigest` (with this folder on PYTHONPATH), then POST `/collective_rpc` with
`{"method": "trl_fp8_weight_digest", "args": ["<json list of parameter names>"]}` (dev mode, which `trl vllm-serve`
turns on). Each worker answers the SHA-256 of the raw bytes of those parameters, as the engine holds them, and
`trl_fp8_tensor_parallel_rank` which partition it holds."""

import hashlib
import json

import torch


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    if t.dtype == torch.float8_e4m3fn or t.element_size() == 1:
        raw = t.view(torch.uint8)
    else:
        raw = t.float().contiguous().view(torch.uint8)  # scales: compare their float32 values
    return hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()


class WeightDigest:
    def trl_fp8_weight_digest(self, names_json: str) -> dict[str, str]:
        params = dict(self.model_runner.model.named_parameters())
        return {name: tensor_digest(params[name]) for name in json.loads(names_json)}

    def trl_fp8_tensor_parallel_rank(self) -> int:
        """This worker's rank in the engine's tensor-parallel group (which partition of each layer it holds)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def trl_fp8_attention_impls(self) -> list[str]:
        """The class of each attention layer's implementation (which backend the server's engine runs)."""
        from vllm.model_executor.layers.attention.attention import Attention

        return sorted({type(m.impl).__name__ for m in self.model_runner.model.modules() if isinstance(m, Attention)})
