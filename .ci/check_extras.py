"""What a fresh `pip install -e ".[vllm,bnb,liger,math]"` resolves to, checked against the releases trl-fp8 is
tested on (`trl_fp8.stack.TESTED`): pip's dry run on an empty environment (`--ignore-installed`), its report read
back. Exits 1, naming the packages, where the extras would install an untested vLLM, torch, TRL or torchao."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from trl_fp8.stack import TESTED, outside_tested_stack  # noqa: E402 (the repository's own, not an installed copy)

EXTRAS = "vllm,bnb,liger,math"


def resolved_versions() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-e", f"{ROOT}[{EXTRAS}]"], check=True)  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}


def main() -> int:
    versions = resolved_versions()
    chosen = {name: versions[name] for name in TESTED if name in versions}
    print(f"pip install -e '.[{EXTRAS}]' resolves: " + ", ".join(f"{n} {v}" for n, v in chosen.items()))
    if missing := [name for name in TESTED if name not in versions]:
        print(f"the extras no longer install {', '.join(missing)}: check_extras.py expects them", file=sys.stderr)
        return 1
    if outside := outside_tested_stack(chosen):
        print(f"outside the tested releases: {'; '.join(outside)}. Pin the extra to the tested release, or run the "
              "GPU suite on this one and add it to trl_fp8.stack.TESTED.", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
