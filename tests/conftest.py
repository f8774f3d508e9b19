import contextlib
import os
import socket
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build every model and tokenizer locally
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The timeout of the tests' subprocesses and notebooks: a guard against a hung process, not a bound on speed. A slow
# or loaded machine makes a test slow, never red (a fixed 600 s failed a smoke run on a busy 2-core machine); a hang
# still ends, well inside CI's 90 minutes.
HANG_GUARD_S = 1800


def _pin_to_one_gpu() -> None:
    """The GPUs this test session may use go to TRL_FP8_TEST_GPUS (from CUDA_VISIBLE_DEVICES, else every GPU of the
    machine), and this process keeps the first: transformers' Trainer wraps a model in DataParallel when it sees
    several GPUs. Tests that need several launch processes of their own on `session_gpus()`. Runs before torch
    initializes CUDA, which reads CUDA_VISIBLE_DEVICES once, and only in pytest's process: a worker script that
    imports test helpers (and with them this file) keeps the GPUs its launcher gave it."""
    if "PYTEST_VERSION" not in os.environ:  # pytest sets it for its session; clean_subprocess_env drops it
        return
    if "TRL_FP8_TEST_GPUS" not in os.environ:
        from visible_gpus import visible_gpus

        os.environ["TRL_FP8_TEST_GPUS"] = ",".join(visible_gpus())
    first = os.environ["TRL_FP8_TEST_GPUS"].split(",")[0]
    if first:
        os.environ["CUDA_VISIBLE_DEVICES"] = first


_pin_to_one_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter here (tests/test_kernels.py); read when kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an SM90 (H100/H200) GPU")
    gpus = len(session_gpus())
    for item in items:
        if "gpu" in item.keywords and not _sm90():
            item.add_marker(skip)
        needs = item.get_closest_marker("gpus")
        if needs is not None and needs.args[0] > gpus:
            reason = f"needs {needs.args[0]} GPUs of one machine; this session has {gpus} (CUDA_VISIBLE_DEVICES)"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def restore_environment(request):
    """TRL's colocate set-up exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for vLLM's in-process engine;
    left behind, they make a later test's subprocess think it is one rank of a distributed launch. A GPU test gets a
    rendezvous port of its own: left to TRL's pick (29500 first), tests running side by side on a machine's GPUs
    (tests/gpu/run_suite.py) could take the same port at once."""
    saved = dict(os.environ)
    if request.node.get_closest_marker("gpu") is not None:
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture
def exact_interpreter_casts(monkeypatch):
    """Triton's CPU interpreter casts float32 to e4m3 and to bf16 by truncating the mantissa (no carry into the
    exponent); the GPU's `cvt.rn.satfinite.e4m3x2.f32` and `cvt.rn.bf16.f32` round to nearest even, as torch's casts
    do. Kernel tests running in the interpreter use torch's casts instead (nothing to do on a GPU)."""
    if torch.cuda.is_available():
        return
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        pytest.skip(f"Triton {triton.__version__}'s interpreter has no _convert_float to make its fp8 cast exact")

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            f32 = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
            return f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        if output_dtype == tl.bfloat16 and input_dtype == tl.float32:
            f32 = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
            return f32.to(torch.bfloat16).view(torch.uint16).numpy()
        return original(values, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's `LLM` replaced by `fake_vllm.FakeLLM` for TRL's colocate code (no vLLM needed); returns the class, whose
    `instances` are the engines built since."""
    import torch.distributed as dist

    from fake_vllm import install_fake_vllm

    yield install_fake_vllm(monkeypatch)
    # TRL's colocate set-up starts a one-process default group for vLLM; a later test starting its own would fail
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 and its character tokenizer saved to a folder, as a user's model name (a test module may define
    its own `model_dir`)."""
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3

    path = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = tiny_char_tokenizer()
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


WORKERS = Path(__file__).resolve().parent / "workers"  # scripts the tests run in processes of their own


def clean_subprocess_env() -> dict[str, str]:
    """This process's environment without distributed-launch variables and without the test session's own (the
    NVLink settings stay), and with a rendezvous port of the child's own: left unset, TRL's colocated engine takes
    the first free one of a short list (29500 first), which two children started at once on other GPUs of the
    machine (tests/gpu/run_suite.py) can both find free and then contend for."""
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "PYTEST_VERSION", "TRL_FP8_TEST_GPUS")  # fmt: skip
    return {**{k: v for k, v in os.environ.items() if k not in launch}, "MASTER_PORT": str(free_port())}


def run_child(cmd: list[str], *, timeout: float, env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
    """`cmd` run to its end, its stdout and stderr together in `.stdout` (unbuffered, in the order printed). A child
    that outlives `timeout` fails the test with its output and, for every Python process it started, the stack of
    each thread at that moment (faulthandler, dumped on SIGABRT), so a hang says where it hangs."""
    import signal
    import tempfile

    env = {**env, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGABRT)  # every process of the group prints its Python stacks
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.seek(0)
            pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... ran past {timeout:.0f} s; its output, with the stacks "
                        f"of its processes at that moment:\n{launch_failure(log.read(), tail=20000)}")  # fmt: skip
        log.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, log.read(), "")


def artifacts_dir() -> Path | None:
    """Where a GPU test keeps what it leaves for the record (server logs, a run's log history): `TRL_FP8_ARTIFACTS`,
    made if missing (a folder named by hand may not exist yet), or None when unset."""
    out = os.environ.get("TRL_FP8_ARTIFACTS")
    if not out:
        return None
    Path(out).mkdir(parents=True, exist_ok=True)
    return Path(out)


def session_gpus() -> list[str]:
    """The GPUs this test session may use, as CUDA_VISIBLE_DEVICES names them (empty without GPUs)."""
    return [g for g in os.environ.get("TRL_FP8_TEST_GPUS", "").split(",") if g]


def launch_failure(output: str, tail: int = 4000) -> str:
    """What a failed multi-process launch printed that says why: each distinct line naming an error (the root cause
    of a crash is often far above the launcher's own summary, which fills the tail), then the last `tail` characters."""
    marks = ("Error", "error:", "ILLEGAL", "Traceback")
    errors = dict.fromkeys(line.strip()[:400] for line in output.splitlines() if any(m in line for m in marks))
    return "\n".join(list(errors)[:60]) + "\n--- last lines ---\n" + output[-tail:]


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def layer_names(i: int) -> list[str]:
    """The linear layers of decoder layer `i` of a (tiny) Qwen3, in transformers names."""
    return [f"model.layers.{i}.{p}" for p in DECODER_LINEARS]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference_quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block FP8 written out block by block, independently of `trl_fp8.quantization`, from the format's
    definition (vLLM / DeepSeek-V3; torchao's rounding steps): `scale = fp32(448 / amax)` (amax >= 1e-12, computed in
    float64), `q = e4m3(clamp(w * scale, +-448))`, `weight_scale_inv = 1 / scale`. Tests compare what the library
    pushes or exports against this, never against the library's own output."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((n + 127) // 128, (k + 127) // 128, dtype=torch.float32)
    w = w.detach().cpu()
    for bi, i in enumerate(range(0, n, 128)):
        for bj, j in enumerate(range(0, k, 128)):
            block = w[i : i + 128, j : j + 128]
            amax = max(block.abs().max().item(), 1e-12)
            scale = torch.tensor(448.0 / amax, dtype=torch.float64).to(torch.float32)
            q[i : i + 128, j : j + 128] = (
                (block.to(torch.float32) * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            )
            scale_inv[bi, bj] = 1.0 / scale
    return q, scale_inv


def assert_fp8_equal(q: torch.Tensor, scale_inv: torch.Tensor, weight: torch.Tensor) -> None:
    """`(q, scale_inv)` are bit for bit the block-FP8 quantization of `weight` (independent reference)."""
    q_ref, s_ref = reference_quantize_blocks(weight)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale_inv.cpu(), s_ref)
