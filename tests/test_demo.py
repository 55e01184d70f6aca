"""The whole pipeline, shrunken (a dozen prompts, a few steps), run exactly as `make demo` runs it: every stage
through its own command, on the real embedded target. Keeps the stages from drifting apart unnoticed."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

EXAMPLE_LOGS = ["sharegpt.json", "openai_requests.jsonl", "messages.jsonl", "prompts.jsonl"]


@pytest.mark.real_model
@pytest.mark.slow
def test_shrunken_demo_end_to_end_and_rerun_skips(tmp_path):
    command = [sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--workdir", str(tmp_path),
               "--logs", *[str(REPO_ROOT / "data" / "examples" / name) for name in EXAMPLE_LOGS],
               "--capture-limit", "12", "--max-new-tokens", "16", "--eval-max-new-tokens", "16", "--no-plan",
               "--train-override", "train.max_steps=4", "--train-override", "eval.every=0",
               "--train-override", "checkpoint.every=2", "--eval-limit", "2", "--ngram", "2"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for stage in ("ingest", "capture", "train", "capture (held-out)", "eval", "push (dry run)"):
        assert f"=== {stage}: " in first.stdout
    report = json.loads((tmp_path / "eval" / "smollm2-demo" / "report.json").read_text())
    # lossless: every speculative output equals plain decoding, in bf16 or, where a near-tie rounded differently
    # there, when rerun in fp32 (the warm-started drafter accepts drafts from its first step)
    assert report["lossless_mismatches"] == 0 or report["lossless_mismatches_fp32"] == 0, report["mismatches"]
    assert 1.0 <= report["tau"] <= 16
    lookup = report["engines"]["vllm"]["ngram"]  # --ngram 2: the engine's own prompt lookup beside the drafter
    assert lookup["k"] == 2 and lookup["lossless_mismatches"] == 0, lookup
    assert "- vllm, prompt lookup (no model): tau " in (tmp_path / "eval" / "smollm2-demo.demo.md").read_text()
    card = (tmp_path / "push" / "smollm2-demo" / "README.md").read_text()
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert {"config.json", "model.safetensors", "dflash.py"} <= {
        p.name for p in (tmp_path / "push" / "smollm2-demo").iterdir()}

    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    for stage in ("ingest", "capture", "train", "capture (held-out)", "eval"):
        assert f"=== {stage}: " in second.stdout
    assert second.stdout.count("is complete, skipping") == 5  # and the push preview is written again
