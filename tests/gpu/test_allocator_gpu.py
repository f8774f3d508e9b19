"""On a GPU: the trainer's sleep-mode allocator set-up (`trl_fp8.rollout.vllm.engine.sleep_mode_allocator`) with each
way of setting PyTorch's allocator variables, in a process of its own per environment (PyTorch reads them once).
Afterwards the allocator runs on expandable segments, what reads the setting agrees with it (the allocator asked,
the environment read as PyTorch reads it, a child process started with it), and vLLM's sleep-mode pool turns them off
inside and back on after, as it does where PYTORCH_CUDA_ALLOC_CONF says they are on."""

import json
import sys

import pytest
from test_vllm_engine import ALLOCATOR_ENVIRONMENTS

from conftest import HANG_GUARD_S, clean_subprocess_env, run_child

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, os, subprocess, sys, types
import torch
from trl_fp8.rollout.vllm.engine import expandable_segments_on, sleep_mode_allocator

def live():
    return torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"]

said = sleep_mode_allocator(types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True))
resident = torch.empty(1 << 20, device="cuda")  # the training memory the engine wakes beside
ask_child = "import torch; torch.empty(1, device='cuda'); print(torch.cuda.memory._snapshot()['allocator_settings']['expandable_segments'])"
child = subprocess.run([sys.executable, "-c", ask_child], env=dict(os.environ), capture_output=True, text=True, check=True)
result = {"said": said and said[1], "live": live(), "asked": expandable_segments_on(),
          "record": expandable_segments_on(dict(os.environ)), "child": child.stdout.strip() == "True",
          "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
try:
    from vllm.device_allocator.cumem import CuMemAllocator
except ImportError:
    pass
else:
    with CuMemAllocator.get_instance().use_memory_pool(tag="allocator_gpu_test"):
        result["in_vllm_pool"] = live()
    result["after_vllm_pool"] = live()
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("name", list(ALLOCATOR_ENVIRONMENTS))
def test_sleep_mode_runs_on_expandable_segments_whichever_variable_is_set(name):
    environ = ALLOCATOR_ENVIRONMENTS[name][0]
    env = {k: v for k, v in clean_subprocess_env().items() if not k.endswith("_ALLOC_CONF")} | environ
    out = run_child([sys.executable, "-c", CHILD], timeout=HANG_GUARD_S, env=env)
    assert out.returncode == 0, out.stdout[-4000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"\n{name}: {result}")
    assert result["live"] and result["asked"] and result["record"] and result["child"], result
    assert "expandable_segments:True" in result["conf"], result
    if "in_vllm_pool" in result:
        assert result["in_vllm_pool"] is False and result["after_vllm_pool"] is True, result
