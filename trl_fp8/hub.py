"""Where a model comes from: a local folder or a Hugging Face Hub id, found fast or refused fast.

The command line reads configs of models named either way. Without a network, transformers asks the Hub five times,
with back-off, before it looks at nothing else (about half a minute); here the local folder and the Hub cache come
first, and a Hub that cannot be reached is found out with one short request.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_PROBE_TIMEOUT_S = 2.0


def missing_local_model(name: str) -> str | None:
    """Why `name` is neither a local model folder nor something the Hub could serve, or None.

    Anything that reads as a path (absolute, `./`, `~`, more than one `/`, or a bare word without an organisation)
    must exist here: asking the Hub for it would only wait for a network timeout before failing.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return (
            f"{name} is a folder without config.json: a model folder holds config.json and the weights "
            "(model.safetensors or its shards), as save_pretrained writes them. Pass that folder, or the model's Hub "
            "id 'org/name'."
        )
    if not is_hub_id(name):
        return (
            f"no model folder at {name}, and it is not a Hub id 'org/name' (e.g. Qwen/Qwen3-8B). Pass a folder with "
            "config.json, or the model's Hub id."
        )
    return None  # a Hub id: from the local cache, or downloaded where the Hub is reachable


def unavailable_model(name: str, revision: str | None = None) -> str | None:
    """Why transformers could not load the model `name` here, found before it tries, or None: `missing_local_model`'s
    reasons, and a Hub id whose weights are not in the Hugging Face cache while the Hub cannot be reached (transformers
    would retry, then fail in a long traceback). Only config.json in the cache (what `trl-fp8 plan` downloads) is not
    enough; a reachable Hub is left to download it."""
    from huggingface_hub import try_to_load_from_cache

    if problem := missing_local_model(name):
        return problem
    if Path(name).expanduser().is_dir():
        return None

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(name, filename, revision=revision), str)

    if any(cached(f) for f in WEIGHT_INDEX_FILES):
        return None
    if not (unreachable := _hub_unreachable(name)):
        return None
    fix = (
        f"Download it where the Hub is reachable (hf download {name}; the cache then serves it offline), or pass a "
        "local model folder."
    )
    if cached("config.json"):
        return f"{name}'s config is in the Hugging Face cache but not its weights, and {unreachable}. {fix}"
    return f"{name} is not in the Hugging Face cache, and {unreachable}. {fix}"


# A model's weights in the Hugging Face cache: one file, or the index of its shards.
WEIGHT_INDEX_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")  # fmt: skip


def is_hub_id(name: str) -> bool:
    """`org/name`, unless `org` is a folder here (then it is a local path that does not exist)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None and not Path(name).parent.is_dir()


def load_model_config(name: str, trust_remote_code: bool = False):
    """transformers' `AutoConfig` of a model folder or Hub id: the folder or the Hub cache first, then the Hub.

    Raises:
        ValueError: naming the fix, at once, where the config is neither here nor reachable (offline and uncached).
    """
    from transformers import AutoConfig

    if problem := missing_local_model(name):
        raise ValueError(problem)
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        if Path(name).expanduser().is_dir():
            raise ValueError(f"cannot read the model config in {name}: {first_line(exc)}") from exc
    if unreachable := _hub_unreachable(name):
        raise ValueError(
            f"{name}'s config is not in the Hugging Face cache, and {unreachable}. Run once where the Hub is "
            "reachable (it downloads config.json only), or pass a local model folder with config.json."
        )
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a model config from {name!r}: {first_line(exc)}") from exc


def _hub_unreachable(name: str) -> str | None:
    """Why the Hub cannot serve `name`'s config now (offline mode, no network), or None: one request, no retries."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set (unset it to download)"
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_PROBE_TIMEOUT_S)
    except OfflineModeIsEnabled:
        return "HF_HUB_OFFLINE is set (unset it to download)"
    except HfHubHTTPError:
        return None  # the Hub answered (a gated or missing repo): transformers' own error says which
    except Exception as exc:  # noqa: BLE001 - any transport failure means the same to the user
        endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT)
        return f"the Hub ({endpoint}) cannot be reached ({type(exc).__name__}); set HF_HUB_OFFLINE=1 to not try"
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none): what a one-line error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
