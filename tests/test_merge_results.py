"""`benchmarks.merge_results`: runs that went at once on disjoint GPUs of one machine, as one results file."""

import json

import pytest

from benchmarks.merge_results import main, merge_at_once

pytestmark = pytest.mark.benchmark_scripts  # not in the default run; `-m benchmark_scripts` runs them


def grpo_file(rows: dict[str, float], **settings) -> dict:
    return {"device": "NVIDIA H100 80GB HBM3", "settings": {"shape": "8b", "vllm_memory": 0.3, **settings},
            "results": [{"name": name, "step_time": {"step_s": s}} for name, s in rows.items()]}  # fmt: skip


def test_rows_side_by_side_with_who_ran_together_and_the_failures(tmp_path, capsys):
    files = [grpo_file({"trl_bf16": 120.0}), grpo_file({"fp8": 60.0})]
    files[1]["failed_runs"], files[1]["failures"] = ["fp8_compiled"], {"fp8_compiled": "out of memory"}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, r in zip(paths, files, strict=True):
        path.write_text(json.dumps(r))
    main([*map(str, paths), "--same", "settings", "--out", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [row["name"] for row in merged["results"]] == ["trl_bf16", "fp8"]
    assert merged["ran_at_once"] == [["trl_bf16"], ["fp8", "fp8_compiled"]]
    assert merged["failed_runs"] == ["fp8_compiled"] and merged["failures"] == {"fp8_compiled": "out of memory"}
    assert "trl_bf16 | fp8, fp8_compiled at once" in capsys.readouterr().out


def test_files_of_another_regime_or_gpu_are_refused_and_nothing_is_written(tmp_path):
    rollout = {"device": "GPU X", "shape": {"name": "8b"}, "gpu_memory_utilization": 0.3,
               "results": [{"engine": "bf16"}]}  # fmt: skip
    other_share = {**rollout, "gpu_memory_utilization": 0.5, "results": [{"engine": "fp8_deepgemm"}]}
    with pytest.raises(ValueError, match="differ in gpu_memory_utilization: 0.3 vs 0.5"):
        merge_at_once([rollout, other_share], ["shape.name", "gpu_memory_utilization"], id_key="engine")
    with pytest.raises(ValueError, match="differ in vllm_memory"):
        merge_at_once([grpo_file({"a": 1.0}), grpo_file({"b": 1.0}, vllm_memory=0.4)], ["settings.vllm_memory"])
    with pytest.raises(ValueError, match="other GPUs"):
        merge_at_once([rollout, {**rollout, "device": "GPU Y"}], ["shape.name"], id_key="engine")
    merged = merge_at_once([rollout, {**rollout, "results": [{"engine": "fp8_deepgemm"}]}], ["shape"], "engine")
    assert merged["ran_at_once"] == [["bf16"], ["fp8_deepgemm"]] and "failed_runs" not in merged
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, r in zip(paths, (rollout, other_share), strict=True):
        path.write_text(json.dumps(r))
    with pytest.raises(ValueError):
        main(
            [*map(str, paths), "--same", "gpu_memory_utilization", "--id_key", "engine", "--out", str(tmp_path / "m")]
        )
    assert not (tmp_path / "m").exists()
