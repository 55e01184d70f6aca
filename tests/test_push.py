"""push: the model card, the release gate, and real uploads to a loopback Hugging Face Hub
(dflash_train/support/hub_server.py).

Every command that may talk to a Hub runs in a subprocess whose environment points HF_ENDPOINT at the loopback
server before huggingface_hub is imported (this process may already have imported it through transformers)."""

import json
import os
from dataclasses import replace
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml

from dflash_train import eval_report
from dflash_train.eval_report import (CombinedEntry, ConcurrencyRow, DrafterRecord, EvalReport, HeldOutCheck, KRow,
                                      Machine, MethodRow, OfflineEstimate, OwnLoop, OwnPrompt, SampleTau, Settings,
                                      SweepTiming, TimedPrompt, VllmEval)
from dflash_train.target import TargetIdentity
from dflash_train.stages.push.card import safe_summary_rows, serve_commands
from dflash_train.cli import main
from dflash_train.support.hub_server import LoopbackHub
from dflash_train.model.checkpoint import drafter_identity

TOKEN = "hf_LoopbackToken0123456789abcdefXYZ"
REPO = "tiny-org/tiny-dflash"
SECRET = "my confidential prompt about project nightingale"
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_target):
    """A tiny drafter folder as the trainer leaves it: the drafter (its config.json naming the target it was trained
    for) + training_args.json, with
    a real capture store (whose ingest report holds prompt text the card must never show)."""
    import torch

    from tiny import make_tiny_drafter

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.store.writer import StoreWriter

    root = tmp_path_factory.mktemp("push_run")
    identity = dict(tiny_target.identity().to_dict(), base_model="tiny-org/tiny-target")
    store = root / "store"
    ingest_report = {  # the shape dflash_train.stages.ingest.command writes, with text where the card must not look
        "read": 120, "kept": 40, "duplicates": 75, "malformed": 3, "non_utf8": 0, "empty": 2, "too_long": 0,
        "blank_lines": 1, "truncated_at_cut": 0, "pii": {"email": 3, "phone": 1, "ipv4": 0},
        "formats": {"sharegpt": 100, "prompt": 20}, "train": 38, "eval": 2, "total_weight": 115, "max_weight": 9,
        "sources": [{"name": "a.jsonl", "path": "logs/a.jsonl", "read": 120, "kept": 40, "duplicates": 75,
                     "formats": {"sharegpt": 100, "prompt": 20}, "examples": [f"line 3: malformed ({SECRET})"]}],
        "config": {"eval_fraction": 0.02, "scrub": True}, "unread_files": []}
    with StoreWriter(store, target=identity, target_layer_ids=[1, 5], hidden_size=64,
                     generation={"temperature": 0.0, "max_new_tokens": 32,
                                 "template_kwargs": {"enable_thinking": False}},
                     ingest_report=ingest_report) as writer:
        for i in range(2):
            writer.add(torch.arange(10) + 20, torch.arange(10) >= 4, torch.randn(10, 128), id=f"p{i}", weight=1)
    drafter, config = make_tiny_drafter(tiny_target.config, tiny_target.tokenizer, num_layers=2, block_size=8,
                                        target_identity=identity)
    config.extra["fine_tuned_from"] = {"name": "org/general", "repo": "org/general", "revision": "c0ffee" * 6 + "0" * 4,
                                       "layout": "z-lab", "weights_sha256": {"model.safetensors": "ab" * 32}}
    out = root / "run" / "drafter"
    save_drafter(drafter, config, out)
    recipe = {"name": "tiny-run", "license": "mit", "push": {"min_tau": 1.2}, "seed": 0,
              "data": {"stores": [str(store)], "max_length": 512}, "optimizer": {"lr": 6e-4},
              "train": {"epochs": 2.0, "micro_batch_size": 4}}
    manifest = json.loads((store / "manifest.json").read_text())
    data = {"stores": [{"path": str(store), **{k: manifest[k] for k in ("num_samples", "num_tokens", "generation",
                                                                          "storage_dtype", "ingest_report")}}],
            "num_samples": 2, "num_tokens": manifest["num_tokens"]}
    run = {"steps": 10, "final_train_loss": 4.2, "final_eval_sim_tau": 1.9, "wall_time_s": 3.5, "device": "cpu"}
    (out / "training_args.json").write_text(json.dumps({"recipe": recipe, "data": data, "run": run}))
    return out


ACCEPTANCE = [0.8, 0.5, 0.3, 0.1, 0.05, 0.01, 0.0]


def vllm_entry(drafter_dir: Path | None, **overrides) -> VllmEval:
    """vLLM's eval of `drafter_dir` (None: of another drafter), as the eval records it."""
    sha = drafter_identity(drafter_dir)["sha256"] if drafter_dir else "0" * 64
    entry = VllmEval(version="0.32.0", tau_steps=2.3, tau_per_prompt=2.45,
                     per_position_acceptance=[0.75, 0.45, 0.3, 0.1, 0.05, 0.0, 0.0], tokens_per_s=25.0,
                     tokens_per_s_baseline=18.0, speedup=25.0 / 18.0, lossless_checked=2, lossless_mismatches=0,
                     drafter_sha256=sha, dtype="fp32",
                     engine_args={"model": "/home/me/.cache/target", "dtype": "float32", "max_model_len": 600,
                                  "seed": 0, "enforce_eager": True, "max_num_seqs": 1,
                                  "speculative_config": {"method": "dflash", "model": "/home/me/runs/tiny/drafter",
                                                         "num_speculative_tokens": 7}},
                     serve_command="vllm serve /home/me/.cache/target --speculative-config ...",
                     per_prompt=[TimedPrompt(id="p0", tau=2.4, new_tokens=64)])
    return replace(entry, **overrides)


def own_loop(**overrides) -> OwnLoop:
    """The project's loop as the eval records it: the drafter's figures (tau over all steps 2.4, its mean over
    prompts 2.5) and every method's row."""
    methods = [MethodRow(method="plain (target only)", role="plain", block_size=1, tokens_per_target_forward=1.0,
                         tokens_per_s=20.0, speedup=1.0),
               MethodRow(method="tiny/drafter", role="drafter", drafter="runs/tiny/drafter", block_size=8,
                         tau_steps=2.4, tau_per_prompt=2.5, per_position_acceptance=ACCEPTANCE,
                         lossless_mismatches=0, tokens_per_target_forward=2.4, tokens_per_s=30.0, speedup=1.5),
               MethodRow(method="block size 1", role="no_speculation", drafter="runs/tiny/drafter", block_size=1,
                         tau_steps=1.0, tau_per_prompt=1.0, lossless_mismatches=0, tokens_per_target_forward=1.0,
                         tokens_per_s=18.0, speedup=0.9)]
    own = OwnLoop(tau_steps=2.4, tau_per_prompt=2.5, lossless_mismatches=0, lossless_checked=2,
                  per_position_acceptance=ACCEPTANCE, tau_histogram={"1": 3, "2": 4}, tokens_per_s=30.0,
                  tokens_per_s_baseline=20.0, speedup=1.5, methods=methods,
                  per_prompt=[OwnPrompt(id="p0", prompt_tokens=9, tau={"tiny/drafter": 2.5})])
    return replace(own, **overrides)


AS_MEASURED = MappingProxyType({})  # write_report's figures unchanged


def write_report(folder: Path, drafter_dir: Path | None = None, own: Mapping | None = AS_MEASURED,
                 vllm: Mapping | None = AS_MEASURED, **overrides) -> Path:
    """An eval folder as the eval stage writes it (stages.evaluate.report: report.json, plots, provenance.json); it
    measured the drafter in `drafter_dir` (None: some other drafter). `own` and `vllm` change the project's loop's
    and vLLM's figures (None: it did not run), `overrides` the report's other fields."""
    folder.mkdir(parents=True, exist_ok=True)
    drafter = DrafterRecord(path="runs/tiny/drafter", block_size=8, num_hidden_layers=2, target_layer_ids=[1, 5],
                            mask_token_id=484, num_parameters=82368,
                            **(drafter_identity(drafter_dir) if drafter_dir else {}))
    report = EvalReport(block_size=8, drafter=drafter, own=None if own is None else own_loop(**own),
                        vllm=None if vllm is None else vllm_entry(drafter_dir, **vllm),
                        offline=OfflineEstimate(tau_steps=2.6, per_sample=[SampleTau(id="s0", tau=2.6)],
                                                num_samples=1),
                        settings=Settings(options={"max_new_tokens": 64, "temperature": 0.0,
                                                   "prompts": "data/prompts"},
                                          num_prompts=2, device="cpu", dtype="bf16"))
    eval_report.dump(replace(report, **overrides), folder / "report.json")
    for name in ("acceptance_by_position.png", "tau_histogram.png"):
        (folder / name).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (folder / "provenance.json").write_text(json.dumps({"created": "2026-11-29T12:00:00+0000",
                                                        "git": {"commit": "abcdef1234567890", "dirty": False}}))
    return folder


def hub_env(hub_url: str, tmp_path: Path, token: str = TOKEN) -> dict[str, str]:
    env = dict(os.environ, HF_ENDPOINT=hub_url, HF_HUB_DISABLE_XET="1", HF_TOKEN=token, HF_HUB_OFFLINE="0",
               HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("HF_HUB_CACHE", None)
    return env


def push(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_train", "push", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def all_text(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_dry_run_writes_the_card_and_never_touches_the_network(drafter_dir, tmp_path):
    report = write_report(tmp_path / "eval", drafter_dir)
    listener = socket.socket()  # HF_ENDPOINT points here: any connection attempt would be accepted and seen
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    out = tmp_path / "out"
    # (huggingface_hub's validators check --repo; its client, which talks to the Hub, is never imported)
    code = ("import sys; from dflash_train.cli import main; rc = main(sys.argv[1:]); "
            "assert 'huggingface_hub.hf_api' not in sys.modules, 'dry run imported the Hub client'; sys.exit(rc)")
    env = hub_env(f"http://127.0.0.1:{listener.getsockname()[1]}", tmp_path)
    result = subprocess.run([sys.executable, "-c", code, "push", str(drafter_dir), "--repo", REPO, "--eval-report",
                             str(report), "--dry-run", "--out", str(out)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()

    uploaded = {"README.md", "config.json", "model.safetensors", "dflash.py", "training_args.json",
                "eval/summary.json", "eval/acceptance_by_position.png", "eval/tau_histogram.png"}
    for name in uploaded:
        assert (out / name).is_file() and f"  {name}  " in result.stdout, name
    assert (out / "provenance.json").is_file() and "provenance.json stays local" in result.stdout
    assert not (out / "INCOMPLETE").exists()
    assert (out / "model.safetensors").read_bytes() == (drafter_dir / "model.safetensors").read_bytes()
    assert SECRET.encode() not in all_text(out)
    assert TOKEN.encode() not in all_text(out)
    summary = json.loads((out / "eval" / "summary.json").read_text())
    assert summary["schema_version"] == eval_report.SCHEMA_VERSION
    own = summary["own"]
    assert own["tau_steps"] == own["methods"][1]["tau_steps"] == 2.4 and summary["offline"]["tau_steps"] == 2.6
    assert "per_prompt" not in own and "per_prompt" not in summary["vllm"]
    assert "per_sample" not in summary["offline"]
    assert "prompts" not in summary["settings"]["options"]

    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "tiny-org/tiny-target" and meta["license"] == "mit"
    assert {"speculative-decoding", "dflash"} <= set(meta["tags"]) and meta["library_name"] == "transformers"
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 2.4
    from huggingface_hub import ModelCard  # parses the metadata as the Hub does; raises on a malformed model-index

    parsed = ModelCard(card)
    assert parsed.data.eval_results[0].metric_value == 2.4 and parsed.data.base_model == "tiny-org/tiny-target"
    sglang, vllm = serve_commands("tiny-org/tiny-target", REPO, 8, None)
    assert sglang in card and vllm in card
    assert '"num_speculative_tokens": 7' in vllm and "--speculative-num-draft-tokens 8" in sglang
    assert "| Tapped target layers | 1, 5 |" in card and "| Block size B | 8 |" in card
    assert ("| Fine-tuned from | [org/general](https://huggingface.co/org/general/tree/" + "c0ffee" * 6 + "0000) at "
            "revision `" + "c0ffee" * 6 + "0000` (z-lab layout); `model.safetensors` sha256 `" + "ab" * 32 + "` |") in card
    assert "| Acceptance length τ, online (real speculative decoding with the target) | 2.4 |" in card
    assert "| 0.8 | 0.5 | 0.3 | 0.1 | 0.05 | 0.01 | 0 |" in card
    assert "![eval/acceptance_by_position.png](eval/acceptance_by_position.png)" in card
    assert "| Lossless check | passed: 0 of 2 prompts differ, every output is token-for-token the target's own |" \
        in card
    assert "| block size 1 | 1 | 1 | 1 | 1 | 18 | 0.9× | 0 |" in card
    assert "| τ, mean over prompts | 2.5 |" in card  # the distribution figure beside the headline
    assert "| Evaluated with dflash-train | commit `abcdef123456`, 2026-11-29T12:00:00+0000 |" in card
    assert "| Training samples (prompt + target response) | 2 |" in card
    assert "| Log records read | 120 from 1 file(s) (sharegpt 100, prompt 20) |" in card
    assert "| Unique prompts kept | 40: 38 train, 2 held out for eval (split by hash) |" in card
    assert "| Records skipped | malformed 3, empty 2 |" in card
    assert "| PII scrubbed (replaced by placeholders) | email 3, phone 1 |" in card
    assert "| a.jsonl | sharegpt 100, prompt 20 | 120 | 40 | 75 |" in card
    assert '`{"enable_thinking": false}`' in card
    assert "| `optimizer.lr` | 0.0006 |" in card and "| `final_train_loss` | 4.2 |" in card
    assert "minimum from the training recipe's push.min_tau" in card and "overridden" not in card
    assert "`mit` (from the training recipe)" in card
    # the engine's own figures and the exact command it ran, with the Hub repos in place of local folders
    assert "Measured in vLLM 0.32.0, the serving engine itself" in card and "| Acceptance length τ | 2.3 |" in card
    assert "| Lossless check | passed: 0 of 2 prompts differ from vLLM's own plain decoding |" in card
    assert ("vllm serve tiny-org/tiny-target --dtype float32 --max-model-len 600 --seed 0 --enforce-eager "
            "--max-num-seqs 1 --speculative-config '{\"method\":\"dflash\",\"model\":\"tiny-org/tiny-dflash\","
            "\"num_speculative_tokens\":7}'") in card
    assert [m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]] == [2.4, 2.3]
    assert b"/home/me" not in all_text(out)
    assert summary["vllm"]["engine_args"]["speculative_config"]["model"] == REPO


def test_gate_refuses_without_report_on_lossless_failure_and_low_tau(drafter_dir, tmp_path, capsys):
    def run(*extra: str) -> tuple[int, str]:
        """A real push where the gate should refuse (refusal comes before any network), a dry run otherwise."""
        out = tmp_path / "out"
        rc = main(["push", str(drafter_dir), "--repo", REPO, "--out", str(out), *extra])
        return rc, capsys.readouterr().err

    rc, err = run()
    assert rc == 2 and "refusing to push: no eval report" in err and "--force" in err
    assert not (tmp_path / "out").exists()
    rc, err = run("--eval-report", str(write_report(tmp_path / "bad", own={"lossless_mismatches": 3})))
    assert rc == 2 and "lossless check failed: 3 outputs" in err
    rc, err = run("--eval-report", str(write_report(tmp_path / "bf16_still", own={"lossless_mismatches": 2,
                                                                                  "lossless_mismatches_fp32": 1})))
    assert rc == 2 and "lossless check failed: 1 outputs" in err and "(still, when rerun in fp32)" in err
    rc, err = run("--eval-report", str(write_report(tmp_path / "bf16_ties", drafter_dir, own={
        "lossless_mismatches": 2, "lossless_mismatches_fp32": 0})), "--dry-run")
    assert rc == 0, err
    assert "2 of 2 prompts differed in bf16 by rounding near-ties" in (tmp_path / "out" / "README.md").read_text()
    rc, err = run("--eval-report", str(write_report(tmp_path / "no_check", own={"lossless_mismatches": None})))
    assert rc == 2 and "lossless check did not run" in err
    # the gate reads tau over all steps (tokens per verification), not its mean over prompts
    low = write_report(tmp_path / "low", drafter_dir, own={"tau_steps": 1.1, "tau_per_prompt": 1.6})
    rc, err = run("--eval-report", str(low))
    assert rc == 2 and "online tau 1.100 is below the minimum 1.2 (the training recipe's push.min_tau)" in err
    # and so it does in a report written before schema_version, whose `tau` was that mean
    before = write_report(tmp_path / "before", drafter_dir)
    raw = eval_report.to_json(eval_report.load(before))
    old_vllm = {**raw.pop("vllm"), "tau": 2.45}
    raw = {**{k: v for k, v in raw.pop("own").items() if k != "tau_per_prompt"}, **raw, "tau": 1.6, "tau_steps": 1.1,
           "engines": {"vllm": old_vllm}}
    del raw["schema_version"]
    (before / "report.json").write_text(json.dumps(raw))
    rc, err = run("--eval-report", str(before))
    assert rc == 2 and "online tau 1.100 is below the minimum" in err and "vLLM tau" not in err
    rc, err = run("--eval-report", str(low), "--min-tau", "1.05", "--dry-run")
    assert rc == 0, err
    rc, err = run("--eval-report", str(write_report(tmp_path / "other", drafter_dir, block_size=4)))
    assert rc == 2 and "measured a different drafter or block size (eval block size 4 vs the drafter's 8)" in err
    record = drafter_identity(drafter_dir)
    stale = write_report(tmp_path / "stale", drafter=DrafterRecord(block_size=8, **{**record,
                                                                                   "weights_sha256": "0" * 64}))
    rc, err = run("--eval-report", str(stale))
    assert rc == 2 and "model.safetensors are not the ones evaluated (sha256 differs)" in err
    rc, err = run("--eval-report", str(write_report(tmp_path / "fresh", drafter_dir, drafter=DrafterRecord(**record))),
                  "--dry-run")
    assert rc == 0, err
    other_target = write_report(tmp_path / "other_target", target=TargetIdentity(name="x", config_hash="0" * 64))
    rc, err = run("--eval-report", str(other_target))
    assert rc == 2 and "measured another target (x)" in err
    assert not (tmp_path / "out" / "INCOMPLETE").exists()

    rc, err = run("--eval-report", str(write_report(tmp_path / "bad2", own={"lossless_mismatches": 2})), "--force",
                  "--dry-run")
    assert rc == 0 and "gate overridden with --force" in err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "The release gate was overridden" in card and "lossless check failed: 2 outputs" in card

    no_recipe = tmp_path / "drafter_no_recipe"
    no_recipe.mkdir()
    for f in drafter_dir.iterdir():
        if f.name != "training_args.json":
            (no_recipe / f.name).write_bytes(f.read_bytes())
    (no_recipe / "INCOMPLETE").write_text("")
    rc = main(["push", str(no_recipe), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "out2"),
               "--eval-report", str(write_report(tmp_path / "meh", own={"tau_steps": 1.4}))])
    assert rc == 2 and "is marked incomplete: its training run did not finish" in capsys.readouterr().err
    (no_recipe / "INCOMPLETE").unlink()
    rc = main(["push", str(no_recipe), "--repo", REPO, "--out", str(tmp_path / "out2"),
               "--eval-report", str(write_report(tmp_path / "meh", own={"tau_steps": 1.4}))])
    assert rc == 2 and "below the minimum 1.5 (dflash-train's default)" in capsys.readouterr().err
    rc = main(["push", str(no_recipe), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "out2"),
               "--eval-report", str(write_report(tmp_path / "ok", no_recipe, own={"tau_steps": 1.6}))])
    card = (tmp_path / "out2" / "README.md").read_text()
    assert rc == 0 and "license: apache-2.0" in card and "the recipe set no license" in card
    assert "did not record a data summary" in card and "did not record its recipe" in card

    # a training_args.json without the data summary: the counts come from the store manifest the recipe names
    recipe_only = json.loads((drafter_dir / "training_args.json").read_text())["recipe"]
    (no_recipe / "training_args.json").write_text(json.dumps({"recipe": recipe_only}))
    rc = main(["push", str(no_recipe), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "out2"),
               "--eval-report", str(tmp_path / "ok")])
    card = (tmp_path / "out2" / "README.md").read_text()
    assert rc == 0 and "| Unique prompts kept | 40: 38 train, 2 held out for eval (split by hash) |" in card


def test_gate_needs_a_passing_vllm_eval_of_these_very_weights(drafter_dir, tmp_path, capsys):
    def refusal(report: Path) -> str:
        rc = main(["push", str(drafter_dir), "--repo", REPO, "--out", str(tmp_path / "out"),
                   "--eval-report", str(report)])
        assert rc == 2
        return capsys.readouterr().err

    own_only = write_report(tmp_path / "own_only", drafter_dir, vllm=None)
    assert "has no vLLM eval of this drafter (run `dflash-train eval --engine both`" in refusal(own_only)
    err = refusal(write_report(tmp_path / "other_weights"))  # vLLM measured some other drafter
    assert f"the vLLM eval in {tmp_path / 'other_weights'}" in err and f"measured another drafter than {drafter_dir}" in err
    assert "(the sha256 of its weights and config.json differs)" in err
    err = refusal(write_report(tmp_path / "lossy", drafter_dir, vllm={"lossless_mismatches": 1}))
    assert "the lossless check failed: 1 outputs in the vLLM eval in" in err
    err = refusal(write_report(tmp_path / "sampled", drafter_dir, vllm={
        "lossless_mismatches": None, "lossless_note": "not checked: at temperature > 0 ..."}))
    assert "the lossless check did not run (not checked: at temperature > 0" in err
    err = refusal(write_report(tmp_path / "slow", drafter_dir, vllm={"tau_steps": 1.1, "tau_per_prompt": 1.5}))
    assert "vLLM tau 1.100 is below the minimum 1.2" in err
    err = refusal(write_report(tmp_path / "overfit", drafter_dir, held_out_check={"prompts": HeldOutCheck(
        checked=True, by_id=["data/store/x"], training_prompts=2)}))
    assert "evaluated 2 prompts or samples the drafter was trained on (--training-prompts)" in err
    # an engine-only eval (no own loop) passes on the engine's figures alone
    engine_only = write_report(tmp_path / "engine_only", drafter_dir, own=None)
    assert main(["push", str(drafter_dir), "--repo", REPO, "--out", str(tmp_path / "out"), "--dry-run",
                 "--eval-report", str(engine_only)]) == 0
    assert "REFUSED" not in capsys.readouterr().out
    # --force pushes anyway, and the card says what the gate found
    assert main(["push", str(drafter_dir), "--repo", REPO, "--out", str(tmp_path / "out"), "--dry-run", "--force",
                 "--eval-report", str(own_only)]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "The release gate was overridden" in card and "has no vLLM eval of this drafter" in card
    assert "Not measured in a serving engine" in card


def test_the_card_serves_the_measured_best_k_and_the_gate_reads_its_figures(drafter_dir, tmp_path, capsys):
    """The eval's fastest K is the card's `num_speculative_tokens`, said to be measured and where; the K and
    concurrency tables and vLLM's per-batch-size setting are shown; the gate reads that K's figures."""
    row = KRow(tau_steps_interval=[1.9, 2.3], tokens_per_s_baseline=18.0, speedup_interval=[1.1, 1.5],
               tokens_per_s_baseline_wall=17.0, lossless_checked=2, lossless_mismatches=0)
    sweep = [replace(row, k=3, tau_steps=2.1, tokens_per_s=23.4, speedup=1.3, tokens_per_s_wall=22.1,
                     speedup_wall=1.3, speedup_wall_interval=[1.1, 1.5]),
             replace(row, k=7, tau_steps=2.3, tokens_per_s=19.8, speedup=1.1, tokens_per_s_wall=18.7,
                     speedup_wall=1.1, speedup_wall_interval=[0.9, 1.3])]
    together = ConcurrencyRow(requests=4, k=3, tokens_per_s_baseline=60.0, tokens_per_s=54.0, speedup=0.9,
                              tokens_per_s_baseline_wall=58.0, tokens_per_s_wall=52.0, speedup_wall=0.9)
    at_batch_1 = [ConcurrencyRow(requests=1, k=r.k, tokens_per_s=r.tokens_per_s, speedup=r.speedup) for r in sweep]
    args = dict(vllm_entry(drafter_dir).engine_args)
    args["speculative_config"] = dict(args["speculative_config"], num_speculative_tokens=3)
    figures = dict(best_k=3, tau_steps=2.1, tau_steps_interval=[1.9, 2.3], speedup=1.3, speedup_interval=[1.1, 1.5],
                   speedup_wall=1.3, speedup_wall_interval=[1.1, 1.5], engine_args=args, sweep=sweep,
                   best_k_share=0.8, concurrency=at_batch_1 + [together], concurrency_best=[at_batch_1[0], together],
                   pays_up_to_concurrency=1, per_batch_size_schedule=[[1, 2, 3], [3, 4, 0]],
                   timing=SweepTiming(protocol="warm engines", repeats=1, budget_s=900, skipped_k=[1],
                                      load_average_after=[2.5, 2.0, 1.0]))
    settings = Settings(options={"max_new_tokens": 64, "temperature": 0.0}, num_prompts=2, device="cpu",
                        dtype="fp32", machine=Machine(cpu="Some CPU", cores=2, load_average=[1.5, 1.0, 0.5]))
    out = tmp_path / "out"
    assert main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out), "--eval-report",
                 str(write_report(tmp_path / "eval", drafter_dir, settings=settings, vllm=figures))]) == 0
    card = (out / "README.md").read_text()
    _, vllm = serve_commands("tiny-org/tiny-target", REPO, 8, None, 3)
    assert vllm in card and '"num_speculative_tokens": 3' in vllm
    assert ("vLLM (`num_speculative_tokens` counts drafted tokens, at most B - 1 = 7; 3 was the fastest of the "
            "lengths measured one request at a time, on Some CPU (2 cores), fp32, load average 1.5 at the start with "
            "vLLM 0.32.0") in card
    assert "| **3** | 2.1 [1.9, 2.3] | 18 / 23.4 | 1.3 [1.1, 1.5]× | 17 / 22.1 | 1.3 [1.1, 1.5]× | 0 of 2 |" in card
    assert "best_k = 3: the fastest at batch 1 (in 80% of the bootstrap resamples" in card
    assert "not measured within the time budget (900 s): K = 1" in card
    assert "| 4 | **3** | 60 / 54 | 0.9× | 58 / 52 | 0.9× |" in card
    assert '`"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 0]]`' in card
    assert "Measured on Some CPU (2 cores), fp32, load average 1.5 at the start (2.5 at the end)" in card
    assert "| Acceptance length τ at K = 3 | 2.1 [1.9, 2.3] |" in card
    assert "Release gate: passed (vLLM τ 2.1 at K = 3" in card
    assert main(["push", str(drafter_dir), "--repo", REPO, "--out", str(tmp_path / "out2"), "--eval-report", str(
        write_report(tmp_path / "slow", drafter_dir, vllm={**figures, "tau_steps": 1.1}))]) == 2
    assert "vLLM tau (K = 3) 1.100 is below the minimum 1.2" in capsys.readouterr().err


def test_dry_run_with_a_failing_gate_writes_the_preview_and_exits_2_in_one_line(drafter_dir, tmp_path, capsys):
    """A dry run answers the question a real push would: refused by the gate is exit 2 with one line (a script that
    checks the preview's exit status learns the push would fail); the preview folder is written all the same."""
    out = tmp_path / "out"
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out),
               "--eval-report", str(write_report(tmp_path / "low", drafter_dir, own={"tau_steps": 1.07}))])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert ("dflash-train push: error: dry run: a real push would be REFUSED: online tau 1.070 is below the minimum "
            "1.2 (the training recipe's push.min_tau) (the preview is in") in err and "pass --force" in err
    card = (out / "README.md").read_text()
    assert "**This drafter fails the release gate**: online tau 1.070 is below the minimum 1.2" in card
    assert "overridden" not in card and "Release gate: passed" not in card
    assert (out / "model.safetensors").is_file() and not (out / "INCOMPLETE").exists()
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out)])
    assert rc == 2 and "a real push would be REFUSED: no eval report" in capsys.readouterr().err
    assert "No eval report was attached" in (out / "README.md").read_text()
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out),
               "--eval-report", str(write_report(tmp_path / "good", drafter_dir))])
    assert rc == 0 and capsys.readouterr().err == ""


def test_repo_ids_and_branches_the_hub_refuses_are_one_line_before_anything_is_written(drafter_dir, tmp_path,
                                                                                       capsys):
    """huggingface_hub's own validator for --repo and git's branch rules for --revision, before the drafter is read
    or a folder written: a dry run with a repo id the Hub would refuse on upload writes nothing."""
    report = str(write_report(tmp_path / "eval", drafter_dir))
    refused = [("--repo", "org/x..y", "is not a Hub repo id: Cannot have -- or .. in repo_id: 'org/x..y'."),
               ("--repo", "org/x--y", "is not a Hub repo id: Cannot have -- or .. in repo_id: 'org/x--y'."),
               ("--repo", "org/" + "n" * 200, "is not a Hub repo id: Repo id must use alphanumeric chars"),
               ("--repo", "org/x.git", "is not a Hub repo id: Repo_id cannot end by '.git'"),
               ("--repo", "tiny-dflash", "is not a Hub repo id of the form ORG/NAME"),
               ("--revision", "v1..2", "is not a branch name git accepts"),
               ("--revision", "my branch", "is not a branch name git accepts"),
               ("--revision", "-f", "is not a branch name git accepts")]
    out = tmp_path / "out"
    for flag, value, words in refused:
        given = [f"{flag}={value}"] if flag == "--revision" else []  # (= : a value that starts with -)
        rc = main(["push", str(drafter_dir), "--repo", value if flag == "--repo" else REPO, *given, "--eval-report",
                   report, "--dry-run", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"dflash-train push: error: {flag} {value!r} {words}"), \
            err
        assert not out.exists()
    assert main(["push", str(drafter_dir), "--repo", REPO, "--revision", "release/v1.0", "--eval-report", report,
                 "--dry-run", "--out", str(out)]) == 0 and (out / "README.md").is_file()


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_the_revision_check_is_gits_own_branch_rule(tmp_path):
    from dflash_train.stages.push.command import branch_problem

    names = ["main", "release/v1.0", "feature/x-2", "a@b", "\u00fc", "-x", "a b", "a..b", "a/.b", "a.lock",
             "a/b.lock/c", "a/", "/a", "a//b", "a@{b", "a.", ".a", "x~1", "x^", "x:y", "x?", "x*", "x[", "x\\y",
             "tab\there", ""]
    for name in names:
        by_git = subprocess.run(["git", "check-ref-format", "--branch", name], cwd=tmp_path, capture_output=True)
        assert (branch_problem(name) is None) == (by_git.returncode == 0), name


def test_out_folder_of_someone_else_is_never_wiped(drafter_dir, tmp_path, capsys):
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("do not delete")
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(foreign),
               "--eval-report", str(write_report(tmp_path / "eval"))])
    assert rc == 2 and "already holds files that push did not write (thesis.tex)" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"]


def test_push_round_trip_through_loopback_hub(drafter_dir, tmp_path):
    report = write_report(tmp_path / "eval", drafter_dir)
    out = tmp_path / "out"
    with LoopbackHub(tokens={TOKEN}) as hub:
        env = hub_env(hub.url, tmp_path)
        result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(report), "--out", str(out),
                       "--private"], env)
        assert result.returncode == 0, result.stderr
        assert f"pushed to {REPO}" in result.stdout and hub.repos[("model", REPO)].private
        head = hub.head(REPO)
        pushed = json.loads((out / "pushed.json").read_text())  # beside the upload, not in it
        assert pushed == {"repo": REPO, "revision": "main", "commit": head.oid, "url": pushed["url"]}
        assert hub.commit_count(REPO) == 2  # the repo's initial commit + exactly one upload commit
        assert head.title == "Upload DFlash drafter from run tiny-run"
        assert set(head.files) == {".gitattributes", "README.md", "config.json", "model.safetensors", "dflash.py",
                                   "training_args.json", "eval/summary.json",
                                   "eval/acceptance_by_position.png", "eval/tau_histogram.png"}
        weights = (drafter_dir / "model.safetensors").read_bytes()
        assert head.files["model.safetensors"].lfs_sha256 is not None  # went through LFS batch + PUT
        assert any(r["method"] == "PUT" and r["path"] == f"/_lfs/upload/{head.files['model.safetensors'].lfs_sha256}"
                   for r in hub.requests)
        assert hub.file_content(REPO, "model.safetensors") == weights
        assert hub.file_content(REPO, "README.md") == (out / "README.md").read_bytes()
        assert all(r["authorized"] for r in hub.requests if r["path"].startswith("/api/repos/create")
                   or "/commit/" in r["path"])

        # a second push to a branch: only the card changes (it names the revision), main stays as it was
        result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(report), "--out", str(out),
                       "--revision", "dev"], env)
        assert result.returncode == 0, result.stderr
        assert hub.head(REPO, "main").oid == head.oid
        assert "--speculative-draft-model-revision dev" in hub.file_content(REPO, "README.md", "dev").decode()

        local = tmp_path / "download"
        code = f"""
import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file
from transformers import AutoModel
path = snapshot_download({REPO!r}, revision="dev", local_dir={str(local)!r})
model = AutoModel.from_pretrained(path, trust_remote_code=True)
ref = load_file({str(drafter_dir / "model.safetensors")!r})
state = model.state_dict()
assert set(ref) == set(state), sorted(set(ref) ^ set(state))
assert all(torch.equal(ref[k], state[k]) for k in ref)
print("loaded", type(model).__name__, sum(p.numel() for p in model.parameters()))
"""
        loaded = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        assert "loaded DFlashDraftModel" in loaded.stdout
        assert (local / "README.md").read_bytes() == hub.file_content(REPO, "README.md", "dev")


def test_transient_commit_error_is_retried_and_the_token_never_shows(drafter_dir, tmp_path):
    report = write_report(tmp_path / "eval", drafter_dir)
    with LoopbackHub(tokens={TOKEN}) as hub:
        hub.fail("POST", r"/commit/", status=500, times=1, echo_auth=True)  # the error message echoes the token
        result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(report), "--out",
                       str(tmp_path / "out"), "--retry-wait", "0.05"], hub_env(hub.url, tmp_path))
        assert result.returncode == 0, result.stderr
        assert "upload failed (HfHubHTTPError: Server error '500" in result.stderr and "retry 1/3" in result.stderr
        assert "Authorization: Bearer ***" in result.stderr
        assert TOKEN not in result.stdout + result.stderr
        assert hub.commit_count(REPO) == 2
        assert all(TOKEN.encode() not in hub.file_content(REPO, name) for name in hub.head(REPO).files)


def test_failed_upload_keeps_the_folder_and_says_what_to_rerun(drafter_dir, tmp_path):
    report = write_report(tmp_path / "eval", drafter_dir)
    out = tmp_path / "out"
    with LoopbackHub(tokens={TOKEN}) as hub:
        hub.fail("POST", r"/commit/", status=503, times=100, echo_auth=True)
        result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(report), "--out", str(out),
                       "--retries", "3", "--retry-wait", "0.01"], hub_env(hub.url, tmp_path))
        assert result.returncode == 2
        assert f"upload to {REPO} failed" in result.stderr and "is complete and unchanged" in result.stderr
        assert f"rerun: dflash-train push {drafter_dir} --repo {REPO} --out {out}" in result.stderr
        assert TOKEN not in result.stdout + result.stderr
        assert sum("/commit/" in r["path"] for r in hub.requests) == 3
        assert hub.commit_count(REPO) == 1  # only the repo's initial commit
        assert (out / "model.safetensors").read_bytes() == (drafter_dir / "model.safetensors").read_bytes()
        assert (out / "README.md").is_file() and not (out / "INCOMPLETE").exists()

        # a bad token is not transient: one attempt, a clear error, and the wrong token is not printed either
        wrong = "hf_WrongToken9876543210zyxwvutsrq"
        result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(report), "--out", str(out),
                       "--retry-wait", "0.01"], hub_env(hub.url, tmp_path, token=wrong))
        assert result.returncode == 2 and "401" in result.stderr
        assert wrong not in result.stdout + result.stderr
        assert sum(r["path"] == "/api/repos/create" and not r["authorized"] for r in hub.requests) == 1


def test_unreachable_hub_is_retried_then_reported(drafter_dir, tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens here: every connection is refused
    result = push([str(drafter_dir), "--repo", REPO, "--eval-report", str(write_report(tmp_path / "eval", drafter_dir)),
                   "--out", str(tmp_path / "out"), "--retries", "2", "--retry-wait", "0.01"],
                  hub_env(f"http://127.0.0.1:{port}", tmp_path))
    assert result.returncode == 2
    assert "create_repo failed (ConnectError" in result.stderr and "retry 1/1" in result.stderr
    assert "rerun: dflash-train push" in result.stderr and (tmp_path / "out" / "model.safetensors").is_file()


def test_data_summary_rows_drop_anything_that_could_be_text():
    summary = {"num_samples": 10, "sources": [{"name": "a.jsonl", "count": 3}], "prompts": [SECRET],
               "examples": [{"text": SECRET}], "note": "x" * 200, "first": {"prompt": SECRET},
               "dedup": {"removed": 4}, "splits": ["train", "eval"]}
    rows = dict(safe_summary_rows(summary))
    assert rows == {"num_samples": 10, "sources[0].name": "a.jsonl", "sources[0].count": 3, "dedup.removed": 4,
                    "splits": ["train", "eval"]}
    sglang, vllm = serve_commands("org/target", "org/drafter", 16, "v2")
    assert "--speculative-draft-model-revision v2" in sglang
    assert vllm == ("vllm serve org/target \\\n    --speculative-config '{\"method\": \"dflash\", \"model\": "
                    "\"org/drafter\", \"num_speculative_tokens\": 15, \"revision\": \"v2\"}'")


def test_the_card_marks_a_replayed_store_and_the_trainer_says_how_many_of_its_samples_trained():
    from dflash_train.stages.push.command import data_summary

    store = {"num_samples": 4, "num_tokens": 40, "storage_dtype": "bf16", "ingest_report": None}
    args = {"recipe": {}, "data": {"stores": [{"path": "/d/new", **store}, {"path": "/d/old", **store, "replay": True}],
                                   "num_samples": 8, "num_tokens": 80, "replay_samples_trained": 3,
                                   "replay_samples_total": 4}}
    summary, _ = data_summary(args, None)
    assert ["replay" in s for s in summary["stores"]] == [False, True]
    assert summary["recorded"] == {"num_samples": 8, "num_tokens": 80, "replay_samples_trained": 3,
                                   "replay_samples_total": 4}
    old = {"recipe": {}, "data": {"stores": [{"path": "/d/new", **store}], "num_samples": 4, "num_tokens": 40}}
    assert data_summary(old, None)[0]["stores"] == [{"name": "new", **store}]  # a run before replay reads as it did


def test_nothing_uploaded_names_a_local_absolute_path(drafter_dir, tmp_path, tmp_path_factory):
    """The run's recipe, store summary, ingest report (with the raw production log's path), target name and eval
    settings name absolute local folders; none of them reaches an uploaded file."""
    import shutil

    from dflash_train.stages.push.command import upload_files

    drafter = tmp_path / "run" / "drafter"
    shutil.copytree(drafter_dir, drafter)
    args = json.loads((drafter / "training_args.json").read_text())
    raw_log = "/srv/prod/logs/chat-2026-11-29.jsonl.gz"
    args["data"]["stores"][0]["ingest_report"]["sources"][0]["path"] = raw_log
    args["data"]["stores"][0]["prompts"] = {"source": "/srv/prod/prompts", "split": "train"}
    (drafter / "training_args.json").write_text(json.dumps(args))
    report = write_report(tmp_path / "eval", drafter, settings=Settings(
        options={"max_new_tokens": 64, "temperature": 0.0, "prompts": "/srv/prod/prompts",
                 "store": "/srv/prod/store-eval", "drafter": str(drafter)}, num_prompts=2, device="cpu", dtype="bf16"))
    out = tmp_path / "out"
    assert main(["push", str(drafter), "--repo", REPO, "--eval-report", str(report), "--dry-run", "--out",
                 str(out)]) == 0
    uploaded = upload_files(out)
    assert {p.name for p in uploaded} >= {"README.md", "config.json", "training_args.json", "summary.json"}
    for path in uploaded:
        if path.suffix in (".md", ".json"):
            text = path.read_text()
            for local in (str(tmp_path_factory.getbasetemp()), "/srv/prod", "/home/me", str(Path.home()) + "/"):
                assert local not in text, (path.name, local)
    assert "chat-2026-11-29.jsonl.gz" in (out / "training_args.json").read_text()  # the file's name is kept
    card = (out / "README.md").read_text()  # HTML closing tags are no paths
    assert card.count("<details>") == card.count("</details>") >= 1 and "</summary>" in card
    assert json.loads((out / "config.json").read_text())["dflash_config"] == \
        json.loads((drafter / "config.json").read_text())["dflash_config"]


def test_push_refuses_a_config_json_that_does_not_fit_the_weights(drafter_dir, tmp_path, capsys):
    import shutil

    drafter = tmp_path / "d"
    shutil.copytree(drafter_dir, drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    out = tmp_path / "out"
    rc = main(["push", str(drafter), "--repo", REPO, "--dry-run", "--force", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "the weights do not fit" in err and "so the drafter would not load" in err, err
    assert not out.exists()
    (drafter / "config.json").write_text(json.dumps(config))
    (drafter / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert main(["push", str(drafter), "--repo", REPO, "--dry-run", "--out", str(out)]) == 2
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err


def test_a_config_json_edited_after_its_eval_is_refused_naming_the_key(drafter_dir, tmp_path, capsys):
    """The gate binds the whole drafter, not only its weights: config.json edited after the eval (rope_theta, or
    rms_norm_eps, which the model reads) is refused in one line naming the key, before any folder is written; the
    very drafter passes and its card names the sha256 of what vLLM evaluated (weights and config.json)."""
    import shutil

    drafter = Path(shutil.copytree(drafter_dir, tmp_path / "d"))
    report = write_report(tmp_path / "eval", drafter)
    assert main(["push", str(drafter), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "very"),
                 "--eval-report", str(report)]) == 0
    assert "REFUSED" not in capsys.readouterr().out
    assert (f"evaluated this very drafter: its weights and config.json, sha256 "
            f"`{drafter_identity(drafter)['sha256']}`") in (tmp_path / "very" / "README.md").read_text()
    config = json.loads((drafter / "config.json").read_text())
    for key, value in (("rope_theta", 20000.0), ("rms_norm_eps", 0.001)):
        (drafter / "config.json").write_text(json.dumps({**config, key: value}))
        out = tmp_path / key
        rc = main(["push", str(drafter), "--repo", REPO, "--out", str(out), "--eval-report", str(report)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and not out.exists(), err
        assert f"config.json {key} was {json.dumps(config[key])} when evaluated, is {json.dumps(value)} now" in err


def test_a_config_json_of_a_billion_layers_is_one_line_at_once(drafter_dir, tmp_path, capsys):
    import shutil

    drafter = Path(shutil.copytree(drafter_dir, tmp_path / "d"))
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    out = tmp_path / "out"
    rc = main(["push", str(drafter), "--repo", REPO, "--dry-run", "--force", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not out.exists(), err
    assert f"{drafter / 'config.json'}: num_hidden_layers is 1000000000, not an integer from 1 to 1024" in err


def test_out_that_is_a_symlink_is_refused_in_one_line(drafter_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "link"),
               "--eval-report", str(write_report(tmp_path / "eval", drafter_dir))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a symbolic link" in err[0], err
    assert list(target.iterdir()) == []


def test_a_push_into_a_folder_another_push_is_writing_is_refused(drafter_dir, tmp_path, capsys):
    from dflash_train.provenance import OutputClaim

    out = tmp_path / "out"
    running = OutputClaim(out, "push")
    rc = main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out)])
    running.release()
    assert rc == 2 and "is being written by another run right now" in capsys.readouterr().err


def test_read_only_push_folder_is_one_line(drafter_dir, tmp_path):
    from sandbox import run_with_mount

    ro = tmp_path / "ro"
    report = write_report(tmp_path / "eval", drafter_dir)
    proc = run_with_mount([sys.executable, "-m", "dflash_train", "push", str(drafter_dir), "--repo", REPO,
                           "--eval-report", str(report), "--dry-run", "--out", str(ro)], ro, read_only=True,
                          cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"dflash-train push: error: cannot write {ro}: read-only file system. Choose a writable folder"


def test_the_published_eval_names_hub_repos_for_the_drafter_and_the_combined_speculator_alike():
    from dflash_train.stages.push.command import publishable_engine

    local = {"model": "/home/me/target", "speculative_config": {"method": "dflash", "model": "/home/me/runs/d",
                                                                "num_speculative_tokens": 9}}
    engine = VllmEval(engine_args=local, engine_args_plain={"model": "/home/me/target"},
                      combined=CombinedEntry(k=9, setting="k=4,confidence=0.6", engine_args=local))
    published = publishable_engine(engine, "org/target", "org/drafter")
    for args in (published.engine_args, published.combined.engine_args):
        assert args["model"] == "org/target" and args["speculative_config"]["model"] == "org/drafter"
    assert published.engine_args_plain == {"model": "org/target"}
    assert published.combined.setting == "k=4,confidence=0.6"
    assert "/home/me" not in published.serve_command and engine.engine_args is local  # the report untouched


def test_the_card_names_a_draft_vocabulary_and_what_each_engine_drafts_with():
    from dflash_train.stages.push.card import CardInputs, Gate, render_card

    def card(**config) -> str:
        return render_card(CardInputs(
            repo_id=REPO, revision=None, run_name="tiny", num_parameters=1000, weights_dtype="bf16",
            drafter_config={"block_size": 8, "num_hidden_layers": 1, "vocab_size": 49152, **config},
            target={"base_model": "tiny-org/tiny-target", "vocab_size": 49152}, license="mit",
            license_from_recipe=True, gate=Gate(passed=True, forced=False, min_tau=1.0, min_tau_source="the test")))

    cut = card(draft_vocab_size=1258)
    assert ("| Draft vocabulary | 1,258 of the target's 49,152 token ids, the ones its training answers use most, "
            "then their prompts': vLLM drafts only these") in cut
    assert "SGLang's DFlash drafts with the target's whole head |" in cut
    assert "embedding not included, the draft vocabulary's LM head rows included" in cut
    whole = card()
    assert "Draft vocabulary" not in whole and "embedding and LM head not included" in whole


def test_the_card_lists_the_refresh_rounds_given_and_a_malformed_history_is_one_line(drafter_dir, tmp_path, capsys):
    """push --history (what `dflash-train refresh` writes): one row per round, in order, its keys the columns; a file
    that is not such a history is one line naming it, before anything is written."""
    rounds = [{"round": "1", "logs": "day1.jsonl.gz (sha256 0123456789ab)", "drift": "held: tau 2.10 against 2.05",
               "released": "yes"},
              {"round": "2", "logs": "day2.jsonl.gz (sha256 ba9876543210)", "drift": "moved down: tau 1.40 against 2.41",
               "released": "yes"}]
    history = tmp_path / "card_rounds.json"
    history.write_text(json.dumps({"rounds": rounds}))
    out = tmp_path / "out"
    assert main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(out), "--history", str(history),
                 "--eval-report", str(write_report(tmp_path / "eval", drafter_dir))]) == 0
    card = (out / "README.md").read_text()
    assert "## Refresh rounds" in card and "| round | logs | drift | released |" in card
    assert card.index("| 1 | day1.jsonl.gz (sha256 0123456789ab) | held: tau 2.10 against 2.05 | yes |") < \
        card.index("| 2 | day2.jsonl.gz (sha256 ba9876543210) | moved down: tau 1.40 against 2.41 | yes |")
    plain = tmp_path / "plain"  # without --history: no such section
    assert main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(plain), "--eval-report",
                 str(tmp_path / "eval")]) == 0
    assert "## Refresh rounds" not in (plain / "README.md").read_text()
    capsys.readouterr()
    for bad in ({"rounds": []}, {"rounds": [{"round": 1}]}, {"rounds": [{"a": "x"}, {"b": "y"}]}, {"other": 1}):
        history.write_text(json.dumps(bad))
        assert main(["push", str(drafter_dir), "--repo", REPO, "--dry-run", "--out", str(tmp_path / "bad"),
                     "--history", str(history), "--eval-report", str(tmp_path / "eval")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and f"--history {history}" in err
        assert not (tmp_path / "bad").exists()
