"""The pure parts of the experiment scripts: override/variant parsing, metrics and report parsing into table rows,
the skip-if-complete decision. Synthetic files only; no model runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import ablate_sample_efficiency as ablate
import experiment_own_outputs as experiment

from dflash_train import runs
from dflash_train.engine import vllm_version
from dflash_train.errors import UserError
from dflash_train.provenance import INCOMPLETE_MARKER, PROVENANCE_FILE

needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed (make install installs it)")


# --- parsing ------------------------------------------------------------------------------------------------------


def test_split_overrides_keeps_commas_inside_brackets():
    assert runs.split_overrides("a.b=1, data.stores=[x,y] ,c={p: 1, q: 2}") == [
        "a.b=1", "data.stores=[x,y]", "c={p: 1, q: 2}"]
    assert runs.split_overrides("") == []


@pytest.mark.parametrize("text", ["a.b=1,oops", "a=[1,2", "a=1]", "=3", "a b=1"])
def test_split_overrides_rejects_malformed(text):
    with pytest.raises(UserError, match="key=value|unbalanced"):
        runs.split_overrides(text)


def test_parse_variant():
    assert runs.parse_variant("fast:optimizer.lr=1e-3,optimizer.schedule=wsd") == (
        "fast", ["optimizer.lr=1e-3", "optimizer.schedule=wsd"])
    assert runs.parse_variant("plain") == ("plain", [])
    with pytest.raises(UserError, match="name"):
        runs.parse_variant("bad name:a=1")
    with pytest.raises(UserError, match="--variant x"):
        runs.parse_variant("x:a=1,b")


def test_parse_sizes():
    assert runs.parse_sizes("32, 96,all") == [32, 96, None]
    for bad in ["0", "12,x", "5,5", ""]:
        with pytest.raises(UserError):
            runs.parse_sizes(bad)


def test_select_variants_defaults_replace_add_and_only():
    v = ablate.select_variants(None, [], None)
    assert list(v) == ["baseline", "init", "soft", "dense", "norm", "optim", "warmup", "focus", "batch", "combo"]
    assert v["baseline"] == [] and v["init"] == ["drafter.init=target"]
    chosen = ("init", "optim", "warmup", "focus", "batch")
    assert set(v["combo"]) == {o for name in chosen for o in runs.split_overrides(ablate.LEVERS[name])}
    v = ablate.select_variants("drafter.init=target,objective.num_anchors=512",
                               ["init:drafter.init=target,optimizer.lr=1e-3", "mine:objective.num_anchors=128"],
                               "mine,init,combo")
    assert list(v) == ["mine", "init", "combo"]
    assert v["init"] == ["drafter.init=target", "optimizer.lr=1e-3"]
    assert v["combo"] == ["drafter.init=target", "objective.num_anchors=512"]
    with pytest.raises(UserError, match="nope"):
        ablate.select_variants(None, [], "baseline,nope")


def test_budget_overrides():
    assert runs.budget_overrides(100, None, 25) == ["eval.every=25", "eval.at_end=true", "train.max_steps=100"]
    assert runs.budget_overrides(None, 60.0, 5)[2:] == ["train.time_budget_s=60.0", "train.max_steps=1000000"]


def test_the_warm_start_experiment_ingests_only_prompts_under_its_prompt_limit(tmp_path, monkeypatch):
    """Then `--limit N` captures N prompts on every workload, whatever share of its log is too long."""
    import experiment_warm_start as ws

    commands = []

    def first_stage_only(name, folder, command, log, *rest, **kw):
        commands.append(command)
        raise StopIteration

    monkeypatch.setattr(ws.runs, "run_stage", first_stage_only)
    args = ws.parse_args(["--workloads", "router", "--max-prompt-tokens", "300"])
    with pytest.raises(StopIteration):
        ws.run_workload(args, "router", tmp_path, {}, runs.Log())
    ingest = commands[0]
    assert ingest[2:4] == ["dflash_train", "ingest"] and str(ws.WORKLOADS["router"]) in ingest
    assert ingest[ingest.index("--max-prompt-tokens") + 1] == "300"


def test_the_demo_summary_flags_a_speedup_measured_while_the_machine_changed_speed():
    import demo

    args = demo.parse_args(["--logs", "data/workloads/router.jsonl.gz"])
    vllm = {"tau": 1.26, "best_k": 2, "speedup": 1.096, "speedup_interval": [1.018, 1.177], "lossless_mismatches": 0,
            "timing": {"host_drift": 0.72, "host_unsteady": True}}
    steady = {**vllm, "timing": {"host_drift": 0.05, "host_unsteady": False}}
    summaries = [demo.demo_summary(args, None, runs.Log(), {"engines": {"vllm": e}}, 1.0, []) for e in (vllm, steady)]
    assert ("- vllm: tau 1.26, best K 2, speedup over plain decoding 1.10x [1.02, 1.18] (95% interval over prompts; "
            "the machine's speed changed by 72% while it was measured: not to be believed)") in summaries[0]
    assert "(95% interval over prompts), lossless" in summaries[1]


def test_experiment_quick_defaults_and_scaled_budget():
    args = experiment.parse_args(["--quick"])
    assert (args.steps, args.limit, args.name, args.out) == (6, 40, "exp-quick", "results/experiment_own_outputs-quick")
    assert experiment.scaled_budget(args, 0.25) == ["eval.every=2", "eval.at_end=true", "train.max_steps=2"]
    args = experiment.parse_args(["--time-budget", "100"])
    assert args.steps is None and args.limit == 600
    assert experiment.scaled_budget(args, 0.5)[2] == "train.time_budget_s=50.0"


def refused_in_one_line(parse_args, argv: list[str], named: str, capsys) -> None:
    """A script's option check: exit 2 with one line naming the option (the program name is pytest's here)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f": error: {named}" in err[0], err


@pytest.mark.parametrize("bad,named", [
    (["--sizes", "a,b"], "--sizes 'a,b': 'a' is neither"),  # checked only after ingest and three captures
    (["--time-budget", "nan"], "--time-budget nan must be"),  # not checked: the recipe refused it stages later
    (["--sweep-budget-s", "-5"], "--sweep-budget-s -5.0 must be"),
    (["--name", "../../x"], "--name '../../x' must be letters"),
    (["--limit", "0"], "--limit 0 must be a number >= 1"),
])
def test_the_warm_start_experiment_refuses_a_bad_option_before_any_stage(bad, named, capsys):
    import experiment_warm_start as ws

    refused_in_one_line(ws.parse_args, ["--quick", *bad], named, capsys)


def test_compare_ids():
    ids = experiment.compare_ids(["a", "b", "c"], ["a", "c", "d"])
    assert ids == {"own": 3, "logged": 3, "common": 2, "only_own": 1, "only_logged": 1, "same_order": True}
    assert experiment.compare_ids(["a", "b"], ["b", "a"])["same_order"] is False


# --- metrics and reports ------------------------------------------------------------------------------------------


def write_metrics(path: Path) -> Path:
    rows = [{"kind": "train", "step": 1, "loss": 9.0, "time": 1.5},
            {"kind": "eval", "step": 1, "eval_tau": 1.01, "eval_acc": [0.01, 0.0], "time": 2.0},
            {"kind": "train", "step": 2, "loss": 8.0, "time": 3.0},
            {"kind": "eval", "step": 2, "eval_sim_tau": 1.25, "eval_acc": [0.2, 0.05], "time": 4.25}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def test_eval_curve_and_run_summary(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    assert runs.eval_curve(metrics) == [(1.0, 1.01), (2.0, 1.25)]
    assert runs.run_summary(metrics) == {"steps": 2, "train_s": 4.25, "final_sim_tau": 1.25,
                                         "final_sim_acc": [0.2, 0.05]}
    assert runs.eval_curve(metrics, "time") == [(2.0, 1.01), (4.25, 1.25)]
    assert runs.eval_curve(metrics, runs.TRAIN_TIME) == [(2.0, 1.01), (4.25, 1.25)]  # no train_time: wall time
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    for row in rows:
        row["train_time"] = row["time"] - 1
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert runs.eval_curve(metrics, runs.TRAIN_TIME) == [(1.0, 1.01), (3.25, 1.25)]
    assert runs.run_summary(metrics)["train_s"] == 3.25
    with pytest.raises(UserError, match="none of wall"):
        runs.eval_curve(metrics, ("wall",))



def test_bad_metrics_name_the_file_and_line(tmp_path):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"kind": "train", "step": 1}\n{not json\n')
    with pytest.raises(UserError, match=r"metrics.jsonl line 2"):
        runs.run_summary(bad)
    with pytest.raises(UserError, match="does not exist"):
        runs.eval_curve(tmp_path / "missing.jsonl")


def write_report(folder: Path, drafters: list[Path]) -> Path:
    """An eval report.json as the eval stage writes it: rows with their roles (evaluate.ROLES)."""
    methods = [{"method": "plain (target only)", "role": "plain", "drafter": None, "block_size": 1,
                "tokens_per_s": 20.0}]
    for i, d in enumerate(drafters):
        methods.append({"method": f"drafter {d.name}", "role": "drafter" if i == 0 else "baseline",
                        "drafter": str(d), "block_size": 16, "tau": 2.0 + i,
                        "per_position_acceptance": [0.9, 0.5 - 0.1 * i, 0.25, 0.1], "tokens_per_s": 10.0 * (i + 1),
                        "lossless_mismatches": 0})
    methods.append({"method": "block size 1", "role": "no_speculation", "drafter": None, "block_size": 1,
                    "tokens_per_s": 21.0})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({"methods": methods, "settings": {"num_prompts": 3}}))
    return folder


def test_online_rows_match_drafters_by_folder(tmp_path, monkeypatch):
    a, b = tmp_path / "runs" / "own" / "drafter", tmp_path / "runs" / "logged" / "drafter"
    report = runs.read_report(write_report(tmp_path / "eval", [a, b]))
    monkeypatch.chdir(tmp_path)
    row = runs.online_row(report, Path("runs/logged/drafter"))  # relative path, same folder
    assert row["online_tau"] == 3.0 and row["acceptance_first"] == [0.9, 0.4, 0.25]
    assert row["tokens_per_s_plain"] == 20.0 and row["tokens_per_s_ratio"] == pytest.approx(1.0)
    assert runs.online_row(report, a)["tokens_per_s_ratio"] == pytest.approx(0.5)
    with pytest.raises(UserError, match="no method for drafter"):
        runs.online_row(report, tmp_path / "other")


def test_read_report_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        runs.read_report(tmp_path)
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(UserError, match="'methods'"):
        runs.read_report(tmp_path)


def test_variant_rows_and_markdown_table(tmp_path):
    plan = {}
    for name in ["baseline", "init"]:
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        write_metrics(run / "metrics.jsonl")
        plan[name] = (run, [] if name == "baseline" else ["drafter.init=target"])
    report = runs.read_report(write_report(tmp_path / "eval", [p[0] / "drafter" for p in plan.values()]))
    rows = runs.run_rows(plan, report)
    assert rows["init"]["online_tau"] == 3.0 and rows["init"]["steps"] == 2
    assert rows["baseline"]["final_sim_tau"] == 1.25 and rows["baseline"]["overrides"] == []
    table = runs.markdown_table(["variant", "tau", "acc"], [["init", rows["init"]["online_tau"],
                                                             rows["init"]["acceptance_first"]], ["x", None, 7]])
    assert table.splitlines() == ["| variant | tau | acc |", "|---|---|---|",
                                  "| init | 3.000 | 0.900 / 0.400 / 0.250 |", "| x | - | 7 |"]


def test_results_name_no_folder_of_the_machine_they_were_made_on(tmp_path, monkeypatch):
    """Results are committed and published: the repo's paths relative, the --workdir as WORKDIR (even one whose name
    starts like another folder's), any other local folder cut to its last component."""
    work = tmp_path / "exp"
    monkeypatch.setattr(sys, "argv", ["experiment_warm_start.py", "--workdir", str(work)])
    log = runs.Log()
    log.add("train", [runs.PY, "train.py", f"{runs.REPO}/recipes/smollm2-135m-adapt.yaml",
                      f"data.stores=[{work}/data/store/own]"], 12.0, skipped=False)
    data = {"general": f"{runs.REPO}/drafters/smollm2-135m-instruct-general", "workdir": str(work),
            "other": [f"{tmp_path}/exp-sg/data/store/own", "64 tokens/s"]}
    markdown = runs.header("t", "scripts/experiment_warm_start.py") + "\n\n" + runs.commands_section(log)
    runs.write_results(tmp_path / "out", markdown, data, [], log, work=work)
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Reproduce: `python scripts/experiment_warm_start.py --workdir WORKDIR`" in md
    got = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "--workdir WORKDIR" in md and "data.stores=[WORKDIR/data/store/own]" in md
    assert "recipes/smollm2-135m-adapt.yaml" in md
    assert got["general"] == "drafters/smollm2-135m-instruct-general" and got["workdir"] == "WORKDIR"
    assert got["other"] == ["own", "64 tokens/s"]
    assert str(tmp_path) not in md + json.dumps(got) and str(runs.REPO) not in md + json.dumps(got)


def test_cpu_model():
    assert runs.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags: x\n") == "AMD EPYC 9654"


# --- skipping complete stages -------------------------------------------------------------------------------------


def make_folder(path: Path, complete: bool) -> Path:
    path.mkdir(parents=True)
    (path / PROVENANCE_FILE).write_text("{}")
    if not complete:
        (path / INCOMPLETE_MARKER).write_text("")
    return path


def test_stage_decision(tmp_path):
    command = ["python", "-m", "dflash_train", "capture", "--out", "x"]
    assert runs.stage_decision(tmp_path / "missing", command) == "run"
    assert runs.stage_decision(make_folder(tmp_path / "half", complete=False), command) == "run"
    done = make_folder(tmp_path / "done", complete=True)
    assert runs.stage_decision(done, command) == "skip"  # made before records existed: trusted
    runs.record_path(done).write_text(json.dumps({"command": command, "seconds": 12.5}))
    assert runs.stage_decision(done, command) == "skip"
    with pytest.raises(UserError, match="made by another command"):
        runs.stage_decision(done, [*command, "--limit", "5"])


def test_run_stage_skips_a_complete_folder_without_running(tmp_path):
    done = make_folder(tmp_path / "done", complete=True)
    log = runs.Log()
    runs.run_stage("capture", done, ["false"], log)  # `false` would fail if it ran
    assert log.stages == [{"stage": "capture", "command": "false", "seconds": None, "skipped": True}]
    assert "capture (time not recorded, in an earlier run):\n  `false`" in runs.commands_section(log)


def test_run_stage_records_the_command_and_its_time(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    script = f"from dflash_train.provenance import write_provenance; write_provenance({str(folder)!r})"
    command = [runs.PY, "-c", script]
    monkeypatch.setenv("PYTHONPATH", str(runs.REPO))
    log = runs.Log()
    runs.run_stage("make", folder, command, log)
    assert log.stages[0]["skipped"] is False and log.stages[0]["command"].startswith("python -c ")
    runs.run_stage("make", folder, command, log)  # now complete: skipped, with the first run's time
    assert log.stages[1]["skipped"] is True and log.stages[1]["seconds"] == log.stages[0]["seconds"]
    with pytest.raises(UserError, match="made by another command"):
        runs.run_stage("make", folder, [*command, "x"], log)


def test_run_stage_failure_stops_with_the_exit_status(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        runs.run_stage("boom", tmp_path / "never", [runs.PY, "-c", "raise SystemExit(3)"], runs.Log())
    assert stop.value.code == 3
    assert "stage 'boom' failed (exit 3)" in capsys.readouterr().err


def test_default_variants_are_valid_overrides_of_the_demo_recipe(monkeypatch):
    from dflash_train.stages.train.recipe import load_recipe

    monkeypatch.chdir(runs.REPO)  # the recipe's paths are relative to the repo root
    base = runs.split_overrides(ablate.PUBLIC)
    for name, overrides in ablate.select_variants(None, [], None).items():
        recipe = load_recipe("recipes/smollm2-135m-demo.yaml",
                             [*base, *overrides, *runs.budget_overrides(None, 60.0, 5)])
        assert recipe.train.time_budget_s == 60.0
        assert (recipe.drafter.init == "target") == (name in ("init", "combo"))
        assert (recipe.objective.num_anchors == 512) == (name == "dense")
        assert (recipe.objective.context_warmup_ratio > 0) == (name in ("warmup", "combo"))
        assert (recipe.optimizer.lr, recipe.optimizer.schedule) == (
            (2e-3, "wsd") if name in ("optim", "combo") else (6e-4, "cosine"))
        assert recipe.decay_gamma == (3.0 if name in ("focus", "combo") else 7.0)
        assert (recipe.train.micro_batch_size, recipe.objective.num_anchors) == (
            (2, 32) if name in ("batch", "combo") else (1, 512 if name == "dense" else 64))


def test_anchor_use_tells_whether_a_drafter_reads_its_anchor_and_its_context(tiny_target_dir, tiny_target):
    import anchor_use
    import torch
    from tiny import make_tiny_drafter
    from transformers import AutoConfig

    drafter, _ = make_tiny_drafter(AutoConfig.from_pretrained(tiny_target_dir), tiny_target.tokenizer,
                                   num_layers=2, block_size=8)
    drafter.eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    embed = tiny_target.model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(0)
    H = drafter.config.hidden_size * len(drafter.target_layer_ids)
    samples = [{"input_ids": torch.randint(0, 500, (30,), generator=g),
                "loss_mask": torch.arange(30) >= 6, "hidden_states": torch.randn(30, H, generator=g)}
               for _ in range(3)]
    reads = anchor_use.anchor_use(drafter, embed, embed, samples, anchors=8)
    assert reads["blocks"] == 24 and reads["slot1_changed"] > 0.2
    assert 0.0 <= reads["acc_slot1"] <= 1.0 and 0.0 <= reads["acc_slot5"] <= 1.0
    assert reads["slot1_changed_no_context"] > 0.2 and 0.0 <= reads["acc_slot1_no_context"] <= 1.0
    with torch.no_grad():
        fc = drafter.fc.weight.clone()
        drafter.fc.weight.zero_()  # the fused context is 0 whatever the states: zeroing them changes nothing
    blind = anchor_use.anchor_use(drafter, embed, embed, samples, anchors=8)
    assert blind["slot1_changed_no_context"] == 0.0 and blind["acc_slot1_no_context"] == blind["acc_slot1"]
    with torch.no_grad():  # no attention output: slot 1 sees nothing but its own mask embedding
        drafter.fc.weight.copy_(fc)
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
    assert anchor_use.anchor_use(drafter, embed, embed, samples, anchors=8)["slot1_changed"] == 0.0


def test_ngram_baseline_scores_bigram_and_trigram_tables(tmp_path, capsys):
    import ngram_baseline as ng
    import torch

    from dflash_train.store import StoreWriter

    # "a b c" and "d b e": after b the bigram table can only guess, the trigram table knows
    prompt_then_response = [False, True, True, True]
    seqs = [([9, 1, 2, 3], prompt_then_response), ([9, 4, 2, 5], prompt_then_response)]
    bigram, trigram = ng.build_tables(seqs)
    assert bigram[2] == {3: 1, 5: 1} and trigram[(4, 2)] == {5: 1}
    assert ng.slot1_accuracy(bigram, trigram, seqs) == {"anchors": 4, "bigram": 0.75, "trigram": 1.0}
    unseen = ng.slot1_accuracy(bigram, trigram, [([7, 8, 6], [False, True, True])])
    assert unseen == {"anchors": 1, "bigram": 0.0, "trigram": 0.0}

    with StoreWriter(tmp_path / "st", target={"name": "x"}, target_layer_ids=[1], hidden_size=8) as writer:
        for i in range(12):
            ids, mask = seqs[i % 2]
            writer.add(torch.tensor(ids), torch.tensor(mask), torch.randn(4, 8), id=f"s{i}")
    assert ng.main([str(tmp_path / "st"), "--eval-fraction", "0.5", "--eval-store", str(tmp_path / "st")]) == 0
    out = capsys.readouterr().out
    assert "| training split (" in out and f"| {tmp_path / 'st'} (12 samples) | 24 | 0.750 | 1.000 |" in out


def test_prompt_lookup_copies_a_loop_from_the_context_and_counts_tokens_per_step():
    import ngram_baseline as ng

    # the latest earlier occurrence of the longest matching suffix (3, 2, then 1 tokens) gives the draft
    assert ng.lookup_draft([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert ng.lookup_draft([5, 1, 6, 1, 7, 1], 2) == [7, 1]  # suffix [1]: its latest earlier occurrence
    assert ng.lookup_draft([1, 2, 3], 4) == []
    # prompt [7], response 1 2 3 1 2 3 1 2 3; the prefill wrote the first 1, so 8 tokens are decoded. 7 1, 7 1 2 and
    # 7 1 2 3 have no earlier match: one token a step. 7 1 2 3 1 copies what followed the earlier 1 up to the
    # context's end, 2 3 1, all accepted, + the target's token (4 tokens); 7 1 2 3 1 2 3 1 2 copies 3 1 2 where only
    # the last token, 3, is left to decode: 5 steps for 8 tokens
    loop = ([7, 1, 2, 3, 1, 2, 3, 1, 2, 3], [False] + [True] * 9)
    assert ng.lookup_tau([loop], 15) == {"sequences": 1, "tau": 1.6, "tau_steps": 1.6}
    # K = 1: one token a step for the first 3, then 2 a step (the copied token + the target's), the last one alone
    assert ng.lookup_tau([loop], 1) == {"sequences": 1, "tau": 8 / 6, "tau_steps": 8 / 6}
    nothing = ([4, 5, 6, 8], [False, True, True, True])  # nothing repeats: one token a step
    assert ng.lookup_tau([loop, nothing], 15) == {"sequences": 2, "tau": 1.3, "tau_steps": 10 / 7}


def test_ngram_baseline_reads_stores_without_the_trainer():
    """Reading a store as the trainer does (dflash_train.stages.train.data) loads neither the trainer nor accelerate."""
    import subprocess
    import sys

    code = ("import sys; import ngram_baseline; "  # run from probes/: `python -c` imports from its working folder
            "print(sorted(m for m in sys.modules if m in ('dflash_train.stages.train.trainer', 'accelerate', "
            "'deepspeed', 'wandb', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent / "probes",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_copy_sequences_repeat_one_span_at_a_varying_period_with_loss_on_the_repeats_only():
    import copy_probe
    import torch

    texts = [list(range(100 * t, 100 * t + 90)) for t in range(6)]  # six responses, no token shared
    seqs = copy_probe.copy_sequences(texts, 40, (4, 12), seed=0)
    periods = set()
    for ids, start in seqs:
        L = (len(ids) - start) // 2
        x = ids[start:start + L]
        assert ids[start + L:] == x and 4 <= L <= 12  # the last two X ...
        first = ids.index(x[0])  # ... and the first X, once, before the loss (tokens differ across responses)
        assert ids[first:first + L] == x and ids[:start].count(x[0]) == 1
        assert len({ids[first] // 100, ids[0] // 100}) == 2  # P is another response's start
        periods.add(L)
    assert len(periods) > 3  # the period varies: copying cannot be "N positions back"
    from dflash_train.stages.train.data import collate  # how the probe batches them: one sample a row, right-padded

    batch = collate([[{"input_ids": torch.tensor(ids), "loss_mask": torch.arange(len(ids)) >= start,
                       "hidden_states": torch.ones(len(ids), 3)}] for ids, start in seqs[:2]],
                    max(len(ids) for ids, _ in seqs[:2]))
    n0 = len(seqs[0][0])
    assert batch["input_ids"].shape[0] == 2 and batch["loss_mask"][0].sum() == n0 - seqs[0][1]
    assert not batch["loss_mask"][0, n0:].any() and batch["hidden_states"][0, n0:].abs().sum() == 0
    for bad in ("9-4", "1", "x"):
        with pytest.raises(UserError, match=f"^--period {bad}: wants N or LO-HI"):
            copy_probe.parse_period(bad)
    assert copy_probe.parse_period("32") == (32, 32) and copy_probe.parse_period("4-40") == (4, 40)
    with pytest.raises(UserError, match="^2 responses long enough for --period 4-12"):
        copy_probe.copy_sequences(texts[:2], 1, (4, 12), seed=0)


def test_copy_probe_trains_a_drafter_on_copy_and_real_batches_and_records_both_losses(tmp_path, tiny_target_dir,
                                                                                       tiny_target, capsys):
    import copy_probe
    import torch
    from tiny import make_tiny_drafter
    from transformers import AutoConfig

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.store import StoreWriter

    drafter, config = make_tiny_drafter(AutoConfig.from_pretrained(tiny_target_dir), tiny_target.tokenizer,
                                        block_size=4)
    save_drafter(drafter, config, tmp_path / "start")
    layers = list(config.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    with StoreWriter(tmp_path / "st", target={"name": "tiny"}, target_layer_ids=layers, hidden_size=64) as writer:
        for i in range(16):
            ids = torch.randint(10, 800, (70,), generator=g)
            writer.add(ids, torch.arange(70) >= 6, torch.randn(70, 64 * len(layers), generator=g), id=f"s{i}")
    assert copy_probe.main([str(tmp_path / "st"), "--out", str(tmp_path / "out"), "--start", str(tmp_path / "start"),
                            "--target", str(tiny_target_dir), "--steps", "3", "--period", "4-8", "--samples", "6",
                            "--eval-samples", "3", "--eval-fraction", "0.3", "--anchors", "4",
                            "--eval-every", "2"]) == 0
    record = json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())
    assert [sorted(h) for h in record["history"]] == [["copy", "real", "step"], ["copy", "copy_tau", "real", "step"],
                                                      ["copy", "real", "step"]]  # step 3's eval is copy_tau_after
    assert 1.0 <= record["history"][1]["copy_tau"] <= 4
    assert 1.0 <= record["copy_tau_before"] <= 4 and 1.0 <= record["copy_tau_after"] <= 4
    assert (tmp_path / "out" / "drafter" / "model.safetensors").exists()
    assert "held-out copy tau" in capsys.readouterr().out


# --- make demo's plan -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_prompts(tmp_path_factory):
    import datasets

    from dflash_train.provenance import write_provenance
    from test_capture import make_rows

    out = tmp_path_factory.mktemp("demo_prompts") / "ingested"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(300)),
                          "eval": datasets.Dataset.from_list(make_rows(40))}).save_to_disk(str(out))
    (out / "report.json").write_text("{}")
    write_provenance(out)
    return out


def test_a_budget_too_short_for_this_machine_is_refused_naming_the_budget_that_fits(demo_prompts, tiny_target_dir):
    """The probe's rates on a 2-core AMD EPYC (AVX2, fp32; BENCHMARKS.md): ingest and probe took 490 s and the eval of
    20 prompts alone needs more than the 30-minute budget has left. The refusal prints what was measured and the
    smallest whole-minute budget whose plan leaves capture and training their minimum."""
    import demo

    rates = {"precision": "fp32", "engine_start_s": 99.8, "engine_capture_s_per_prompt": 3.22,
             "engine_prefill_s_per_prompt": 1.73, "capture_batch": 16, "capture_s_per_prompt": 4.08,
             "capture_s_per_prompt_by_quantile": [3.90, 4.26], "capture_new_tok_s": 28.9,
             "capture_mean_new_tokens": 118.0, "capture_mean_tokens": 277.5, "state_bytes_per_token": 5760.0,
             "decode_tok_s": 6.41, "prefill_s": 1.0, "train_step_s": 7.83, "train_online_step_s": 12.2}
    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"])
    with pytest.raises(UserError) as refused:
        demo.make_plan(args, demo_prompts, rates, 490.0)
    message = str(refused.value)
    assert message.startswith("--budget-min 30: the budget leaves -") and "\n" not in message
    assert "measured: compute dtype fp32" in message
    fits = int(re.search(r"--budget-min (\d+) fits$", message).group(1))
    plan = demo.make_plan(demo.parse_args([*map(str, ["--target", tiny_target_dir, "--max-prompt-tokens", 60,
                                                      "--budget-min", fits])]), demo_prompts, rates, 490.0)
    assert 490.0 + sum(plan["stage_s"].values()) <= fits * 60 * (1 - demo.MARGIN) + 1e-6
    with pytest.raises(UserError):
        demo.make_plan(demo.parse_args([*map(str, ["--target", tiny_target_dir, "--max-prompt-tokens", 60,
                                                   "--budget-min", fits - 1])]), demo_prompts, rates, 490.0)


@pytest.mark.parametrize("machine, rates", [  # rates as the demo's probe measured them (BENCHMARKS.md)
    ("AVX-512 BF16", {"capture_s_per_prompt": 1.57, "decode_tok_s": 16.0, "prefill_s": 0.5, "train_step_s": 0.74}),
    ("AVX2, fp32", {"capture_s_per_prompt": 1.70, "decode_tok_s": 15.4, "prefill_s": 0.6, "train_step_s": 1.17}),
    ("a GPU", {"capture_s_per_prompt": 0.02, "decode_tok_s": 150.0, "prefill_s": 0.02, "train_step_s": 0.05}),
])
def test_demo_plan_fits_the_budget(demo_prompts, tiny_target_dir, machine, rates):
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"])
    spent = 140.0  # ingest + probe
    plan = demo.make_plan(args, demo_prompts, rates, spent)
    total = spent + sum(plan["stage_s"].values())
    assert total <= args.budget_min * 60 * (1 - demo.MARGIN) + 1e-6, (machine, plan)
    kept_train = demo.kept_prompts(demo_prompts, "train", 300, str(tiny_target_dir), 60)
    assert 1 <= plan["capture_limit"] <= args.capture_limit and plan["capture_kept"] == kept_train[
        plan["capture_limit"] - 1]
    assert demo.MIN_EVAL_PROMPTS <= plan["eval_prompts"] and plan["eval_limit"] <= args.eval_limit
    steps = demo.demo_recipe(args).train.max_steps
    assert plan["expected_steps"] <= plan["max_steps"] == steps
    assert 1 <= plan["own_eval_prompts"] <= demo.OWN_EVAL_PROMPTS and plan["sweep_budget_s"] > 0
    if machine == "a GPU":  # a fast machine: every prompt offered and the recipe's steps, as before the plan
        assert plan["capture_limit"] == len(kept_train) and plan["expected_steps"] == steps


def test_a_low_precision_eval_plans_the_fp32_rerun_of_its_mismatches(demo_prompts, tiny_target_dir):
    """Where the probe decoded in bf16 it also times fp32 decoding: the eval reruns its bf16 mismatches in fp32
    (the AVX-512 rewrite demo: 17 of 25, unplanned, 143 s over its eval's plan); the plan counts that rerun in the
    eval's stage and takes it from the rest, so the demo still fits its budget."""
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"])
    bf16 = {"capture_s_per_prompt": 1.88, "decode_tok_s": 18.0, "prefill_s": 0.4, "train_step_s": 1.93,
            "engine_start_s": 43.1,
            "engine_capture_s_per_prompt": 0.97, "engine_prefill_s_per_prompt": 0.55}
    plain = demo.make_plan(args, demo_prompts, bf16, 214.0)
    rerun = demo.make_plan(args, demo_prompts, {**bf16, "fp32_decode_tok_s": 15.5, "fp32_prefill_s": 0.5}, 214.0)
    assert plain["fp32_recheck_s"] == 0 < rerun["fp32_recheck_s"]
    grown = rerun["stage_s"]["eval"] - plain["stage_s"]["eval"]  # the rerun, less what the K sweep gave up for it
    assert grown == pytest.approx(rerun["fp32_recheck_s"] + rerun["sweep_budget_s"] - plain["sweep_budget_s"], abs=1)
    assert rerun["train_budget_s"] < plain["train_budget_s"]
    for plan in (plain, rerun):
        assert 214.0 + sum(plan["stage_s"].values()) <= args.budget_min * 60 * (1 - demo.MARGIN) + 1e-6


def test_vllm_requests_are_planned_at_the_rate_and_slowdown_the_probe_measured_in_the_engine(demo_prompts,
                                                                                              tiny_target_dir):
    """Where the probe timed vLLM at batch 1 (plain, and the starting drafter at PROBE_K: the eval's own protocol),
    every vLLM request of the plan costs what it measured: each K its engine's measured start and, per prompt and
    concurrent request, a plain request at the measured rate plus the drafter's (the measured slowdown; prompt
    lookup and suffix decoding at FREE_SLOWDOWN) and the idle before each. An engine measured faster than the
    project's loop leaves the time to training; one measured slower takes it (the plan errs long, never short)."""
    import demo

    base = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--budget-min", "45", "--engine", "vllm",
            "--ngram", "3"]
    args = demo.parse_args(base)
    unmeasured = {**THIS_CPU, "decode_tok_s": 18.0, "prefill_s": 0.4}
    fast = {**unmeasured, "engine_plain_tok_s": 30.0, "engine_spec_slowdown": 0.8, "engine_spec_start_s": 3.0}
    slow = {**fast, "engine_plain_tok_s": 9.0, "engine_spec_slowdown": 2.5, "engine_spec_start_s": 30.0}
    plans = {name: demo.make_plan(args, demo_prompts, rates, 214.0)
             for name, rates in (("unmeasured", unmeasured), ("fast", fast), ("slow", slow))}
    T, n = args.eval_max_new_tokens, plans["fast"]["eval_prompts"]
    per_prompt = n + demo.EVAL_CONCURRENCY / 2
    request_s = T / fast["engine_plain_tok_s"]
    assert plans["fast"]["lookup_s"] == pytest.approx(3.0 + per_prompt * (
        request_s * (1 + demo.FREE_SLOWDOWN) + 2 * demo.IDLE_S), abs=1)
    least_sweep_s = n * request_s + 2 * (3.0 + per_prompt * (request_s * 1.8 + 2 * demo.IDLE_S))
    assert plans["fast"]["sweep_budget_s"] >= least_sweep_s - 1
    assert plans["fast"]["stage_s"]["eval"] < plans["unmeasured"]["stage_s"]["eval"] < plans["slow"]["stage_s"]["eval"]
    assert plans["fast"]["train_budget_s"] > plans["unmeasured"]["train_budget_s"] > plans["slow"]["train_budget_s"]
    for plan in plans.values():
        assert 214.0 + sum(plan["stage_s"].values()) <= 45 * 60 * (1 - demo.MARGIN) + 1e-6
    assert "in vLLM at batch 1 30.0 tokens/s (whole requests), the starting drafter at K = 4 1.25x that" in \
        demo.measured_line({**fast, "precision": "fp32", "capture_batch": 16})


def test_prompt_lookup_in_the_demo_is_planned_and_its_summary_says_which_to_serve(demo_prompts, tiny_target_dir):
    """demo --ngram K,...: the eval times vLLM's prompt lookup beside the drafter whatever its budget, so the plan
    counts it in the eval's stage (each K what a drafter K costs, each after the first an engine start more), out
    of the eval's share first (the K sweep shrinks to its two K), then out of training; the summary gives lookup's
    figures and which of the two to serve."""
    import demo

    rates = {"capture_s_per_prompt": 1.88, "decode_tok_s": 18.0, "prefill_s": 0.4, "train_step_s": 1.93,
             "engine_start_s": 43.1}
    base = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--budget-min", "45"]
    plans = [demo.make_plan(demo.parse_args([*base, *extra]), demo_prompts, rates, 214.0)
             for extra in ([], ["--ngram", "3"], ["--ngram", "2,3"])]
    assert plans[0]["lookup_s"] == 0 < plans[1]["lookup_s"]
    assert plans[2]["lookup_s"] == pytest.approx(2 * plans[1]["lookup_s"] + 43.1, abs=1.5)  # each rounded
    for plain, looked in zip(plans, plans[1:]):
        assert looked["stage_s"]["eval"] - plain["stage_s"]["eval"] == pytest.approx(
            looked["lookup_s"] - plain["lookup_s"] + looked["sweep_budget_s"] - plain["sweep_budget_s"], abs=1)
    # one lookup K: out of the K sweep's time; two: the sweep is down to its two K, training pays the rest
    assert plans[1]["sweep_budget_s"] < plans[0]["sweep_budget_s"]
    assert plans[2]["sweep_budget_s"] == plans[1]["sweep_budget_s"]
    assert plans[2]["train_budget_s"] < plans[1]["train_budget_s"] <= plans[0]["train_budget_s"]
    for plan in plans:
        assert 214.0 + sum(plan["stage_s"].values()) <= 45 * 60 * (1 - demo.MARGIN) + 1e-6
    for bad in (["--ngram", "0"], ["--ngram", "3,3"], ["--ngram", "3", "--engine", "own"], ["--ngram", "x"],
                ["--ngram", ","], ["--suffix", "0"], ["--suffix", "8", "--engine", "own"]):
        with pytest.raises(SystemExit) as exit_:
            demo.parse_args([*base, *bad])
        assert exit_.value.code == 2


def test_suffix_decoding_in_the_demo_is_planned_as_an_engine_of_its_own_per_k(demo_prompts, tiny_target_dir,
                                                                             monkeypatch):
    """demo --suffix K,...: each suffix K costs what a drafter K does plus an engine start (its own process), in the
    eval's stage; the summary ranks it beside the drafter and prompt lookup and names the fastest to serve."""
    import demo

    monkeypatch.setattr(demo, "suffix_problem", lambda: None)  # the plan does not need the package
    rates = {"capture_s_per_prompt": 1.88, "decode_tok_s": 18.0, "prefill_s": 0.4, "train_step_s": 1.93,
             "engine_start_s": 43.1}
    base = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--budget-min", "45", "--ngram", "3"]
    looked, both = (demo.make_plan(demo.parse_args([*base, *extra]), demo_prompts, rates, 214.0)
                    for extra in ([], ["--suffix", "8"]))
    per_k = looked["lookup_s"]  # one lookup K: what a drafter K costs, in the drafter's engine process
    assert both["lookup_s"] == pytest.approx(2 * per_k + 43.1, abs=1.5)
    assert 214.0 + sum(both["stage_s"].values()) <= 45 * 60 * (1 - demo.MARGIN) + 1e-6
    args = demo.parse_args(["--logs", "data/workloads/router_json.jsonl.gz", "--ngram", "4", "--suffix", "8"])
    vllm = {"tau": 1.5, "best_k": 2, "speedup": 0.98, "speedup_interval": [0.94, 1.04], "lossless_mismatches": 0,
            "timing": {}, "ngram": {"k": 4, "tau": 1.4, "speedup": 1.2, "speedup_interval": None},
            "suffix": {"k": 8, "tau": 1.7, "speedup": 1.35, "speedup_interval": None}}
    summary = demo.demo_summary(args, None, runs.Log(), {"engines": {"vllm": vllm}}, 1.0, [])
    assert "- vllm, suffix decoding (no model): tau 1.70, K 8, speedup 1.35x: faster than the drafter here" in summary
    assert "- vllm, prompt lookup (no model): tau 1.40, K 4, speedup 1.20x: faster than the drafter, slower than " \
           "suffix decoding" in summary


@pytest.mark.parametrize("bad,named", [
    (["--budget-min", "nan"], "--budget-min nan must be in (0, 10080]"),  # it ran ingest and died in the plan
    (["--budget-min", "0"], "--budget-min 0.0 must be in (0, 10080]"),  # refused only after the probe
    (["--batch-size", "0"], "--batch-size 0 must be a number >= 1"),  # died in the probe's capture
    (["--capture-limit", "0"], "--capture-limit 0 must be a number >= 1"),  # was called 'no prompts in ...'
    (["--name", "../../outside"], "--name '../../outside' must be letters"),  # wrote outside --workdir
    (["--prompts-name", "a/b"], "--prompts-name 'a/b' must be letters"),
])
def test_the_demo_refuses_a_bad_option_before_any_work(bad, named, capsys):
    import demo

    refused_in_one_line(demo.parse_args, ["--logs", "data/workloads/router.jsonl.gz", *bad], named, capsys)


def test_the_probe_names_max_prompt_tokens_when_no_training_prompt_fits(demo_prompts, tiny_target_dir):
    """It died in the capture's padding (`max() arg is an empty sequence`)."""
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "2", "--capture-limit", "40"])
    with pytest.raises(UserError, match=r"no training prompt of the first 40 in .* fits --max-prompt-tokens 2"):
        demo.probe(args, demo_prompts)

    args = demo.parse_args(["--logs", "data/workloads/router.jsonl.gz", "--ngram", "3"])
    vllm = {"tau": 1.29, "best_k": 2, "speedup": 0.98, "speedup_interval": [0.94, 1.04], "lossless_mismatches": 0,
            "timing": {}}
    lookup = {"k": 3, "tau": 1.46, "speedup": 1.171, "speedup_interval": [1.057, 1.311]}
    summary = demo.demo_summary(args, None, runs.Log(), {"engines": {"vllm": {**vllm, "ngram": lookup}}}, 1.0, [])
    assert ("- vllm, prompt lookup (no model): tau 1.46, K 3, speedup 1.17x [1.06, 1.31]: faster than the drafter "
            "here, serve it instead (the eval report gives its --speculative-config)") in summary
    slower = {**lookup, "speedup": 0.9, "speedup_interval": None}
    summary = demo.demo_summary(args, None, runs.Log(), {"engines": {"vllm": {**vllm, "ngram": slower}}}, 1.0, [])
    assert "K 3, speedup 0.90x: the drafter is the faster" in summary
    assert "prompt lookup" not in demo.demo_summary(args, None, runs.Log(), {"engines": {"vllm": vllm}}, 1.0, [])


def test_time_training_cannot_use_goes_to_capture(demo_prompts, tiny_target_dir):
    """Where the recipe's max_steps take less than training's share, the rest of it captures more conversations."""
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"])
    slow = {"capture_s_per_prompt": 6.0, "decode_tok_s": 15.0, "prefill_s": 0.5, "train_step_s": 1.7}
    steps = demo.demo_recipe(args).train.max_steps
    fast = {**slow, "train_step_s": 60.0 / steps}  # the recipe's steps in a minute
    slow_plan, fast_plan = (demo.make_plan(args, demo_prompts, r, 140.0) for r in (slow, fast))
    assert fast_plan["expected_steps"] == steps > slow_plan["expected_steps"]
    assert fast_plan["capture_kept"] > slow_plan["capture_kept"]
    assert fast_plan["train_budget_s"] >= 60


def test_training_gets_what_the_capture_saved_or_overran():
    import demo

    plan = {"spent_s": 140, "train_budget_s": 700, "stage_s": {"capture": 300.0, "train": 725.0}}
    demo.rebudget_training(plan, 140 + 300 - 90)  # capture ended 90 s early
    assert plan["train_budget_s"] == 790 and plan["stage_s"]["train"] == 815 and plan["capture_end_s"] == 350
    plan = {"spent_s": 140, "train_budget_s": 700, "stage_s": {"capture": 300.0, "train": 725.0}}
    demo.rebudget_training(plan, 140 + 300 + 2000)  # overran by far: training still gets a minute
    assert plan["train_budget_s"] == 60


def test_the_plan_captures_through_whichever_way_stores_more_prompts_here(demo_prompts, tiny_target_dir):
    """The probe times the one-pass capture and the engine capture (vLLM generates, one prefill records the
    states); the plan captures through the one that keeps more prompts in capture's share, start-up included."""
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"])
    one_pass = {"capture_s_per_prompt": 4.0, "decode_tok_s": 16.0, "prefill_s": 0.5, "train_step_s": 3.0}
    engine_faster = {**one_pass, "engine_start_s": 45.0, "engine_capture_s_per_prompt": 1.2}
    engine_slower = {**one_pass, "engine_start_s": 45.0, "engine_capture_s_per_prompt": 3.9}  # start not repaid
    plans = {name: demo.make_plan(args, demo_prompts, rates, 140.0) for name, rates in
             (("one pass", one_pass), ("engine faster", engine_faster), ("engine slower", engine_slower))}
    assert plans["one pass"]["capture_engine"] == "own" == plans["engine slower"]["capture_engine"]
    assert plans["engine faster"]["capture_engine"] == "vllm"
    assert plans["engine faster"]["capture_kept"] > plans["one pass"]["capture_kept"]
    forced = demo.make_plan(demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60",
                                             "--capture-engine", "own"]), demo_prompts, engine_faster, 140.0)
    assert forced["capture_engine"] == "own"


# this CPU's rates (the AVX-512 demo's above; BENCHMARKS.md, online training: an online step 1.84x the stored one,
# the vLLM capture 1.82x faster without the prefill that records the states); samples of 100 tokens
THIS_CPU = {"capture_s_per_prompt": 1.57, "decode_tok_s": 16.0, "prefill_s": 0.5, "train_step_s": 0.74,
            "train_online_step_s": 1.36, "capture_mean_tokens": 100.0, "engine_start_s": 45.0,
            "engine_capture_s_per_prompt": 1.2, "engine_prefill_s_per_prompt": 0.54}
# slow training steps (few epochs in the budget) and an engine capture that is mostly its prefill
FEW_EPOCHS = {**THIS_CPU, "capture_s_per_prompt": 4.0, "train_step_s": 3.0, "train_online_step_s": 3.3,
              "engine_capture_s_per_prompt": 3.0, "engine_prefill_s_per_prompt": 2.4}


def test_the_plan_stores_the_states_or_trains_online_whichever_trains_on_more_data(demo_prompts, tiny_target_dir):
    """The plan sizes both ways and takes dflash_train.measure's rule at the epochs it trains: this CPU trains many
    epochs and stores the states; where a token-only engine capture is cheap and the epochs few it captures
    token-only (more prompts in the same budget) and trains online. Either plan fits the budget."""
    import demo

    base = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--store-topk", "0"]
    args = demo.parse_args(base)
    stored = demo.make_plan(args, demo_prompts, THIS_CPU, 140.0)
    assert stored["hidden_states"] == "stored", stored
    assert "epochs >= the break-even" in stored["hidden_states_reason"]
    assert stored["capture_kept"] == stored["hidden_states_options"]["stored"]["capture_kept"]
    online = demo.make_plan(args, demo_prompts, FEW_EPOCHS, 140.0)
    assert online["hidden_states"] == "online" and "epochs < the break-even" in online["hidden_states_reason"]
    options = online["hidden_states_options"]
    assert online["capture_kept"] == options["online"]["capture_kept"] > options["stored"]["capture_kept"]
    assert online["capture_engine"] == "vllm"  # token-only: no prefill after vLLM's generation
    assert online["expected_steps"] == options["online"]["expected_steps"] < options["stored"]["expected_steps"]
    assert abs(online["expected_steps"] - online["train_budget_s"] / FEW_EPOCHS["train_online_step_s"]) <= 1
    for plan in (stored, online):
        assert 140.0 + sum(plan["stage_s"].values()) <= args.budget_min * 60 * (1 - demo.MARGIN) + 1e-6, plan


def test_hidden_states_stored_when_the_prefill_stays_or_when_forced(demo_prompts, tiny_target_dir):
    import demo

    base = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60"]
    topk = demo.make_plan(demo.parse_args([*base, "--store-topk", "8"]), demo_prompts, FEW_EPOCHS, 140.0)
    assert topk["hidden_states"] == "stored"  # top-k needs the prefill: token-only would save nothing
    assert "break-even 0.00" in topk["hidden_states_reason"]
    forced = demo.make_plan(demo.parse_args([*base, "--store-topk", "0", "--hidden-states", "stored"]), demo_prompts,
                            FEW_EPOCHS, 140.0)
    assert forced["hidden_states"] == "stored" and forced["hidden_states_reason"] == "--hidden-states stored"
    assert forced["capture_kept"] == forced["hidden_states_options"]["stored"]["capture_kept"]
    older = demo.make_plan(demo.parse_args(base), demo_prompts, {k: v for k, v in FEW_EPOCHS.items()
                                                                 if k != "train_online_step_s"}, 140.0)
    assert older["hidden_states"] == "stored" and "measured no online" in older["hidden_states_reason"]


def test_demo_probe_times_a_training_step_with_online_states(demo_prompts, tiny_target_dir):
    import demo

    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--max-new-tokens", "4",
                            "--batch-size", "2", "--capture-engine", "own", "--capture-limit", "40", "--engine", "own"])
    rates = demo.probe(args, demo_prompts)
    assert 0 < rates["train_step_s"] and 0 < rates["train_online_step_s"] and 0 < rates["prefill_s"]
    assert rates["capture_mean_tokens"] > rates["capture_mean_new_tokens"] == 4
    assert rates["state_bytes_per_token"] == 2 * 5 * 64  # bf16, five taps of the tiny target's 64
    plan = demo.make_plan(args, demo_prompts, rates, 140.0)
    assert plan["hidden_states"] in ("stored", "online") and "break-even" in plan["hidden_states_reason"]


@needs_vllm
@pytest.mark.slow
def test_the_probe_times_vllm_requests_plain_and_with_the_starting_drafter_as_the_eval_does(tmp_path):
    """The probe's vLLM measurement runs the eval's own timed job (each request alone and cold, plain and with the
    recipe's starting drafter at PROBE_K) on real vLLM and returns the rates the plan reads."""
    import argparse

    import torch
    from tiny import make_tiny_drafter, make_tiny_target

    import demo
    from dflash_train.device import resolve_precision
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import load_target

    target = load_target(str(make_tiny_target(tmp_path / "target", num_heads=2, num_kv_heads=1)),
                         dtype=torch.float32)
    drafter, config = make_tiny_drafter(target.config, target.tokenizer, num_layers=1, block_size=8,
                                        target_identity=target.identity().to_dict())
    save_drafter(drafter, config, tmp_path / "drafter")
    recipe = argparse.Namespace(drafter=argparse.Namespace(init_from=str(tmp_path / "drafter"), init_revision=None))
    rendered = [[5 + i, 40, 41 + i, 300, 7 * i + 2] for i in range(5)]
    rates = demo.probe_engine_decoding(argparse.Namespace(eval_max_new_tokens=8), target, rendered,
                                       resolve_precision("fp32", "cpu"), recipe)
    assert set(rates) == {"engine_plain_tok_s", "engine_spec_slowdown", "engine_spec_start_s"}
    assert rates["engine_plain_tok_s"] > 0 and 0 < rates["engine_spec_slowdown"] < 20
    assert rates["engine_spec_start_s"] > 0


def test_the_probe_refuses_a_budget_the_eval_alone_overruns_before_its_slower_measurements(demo_prompts,
                                                                                          tiny_target_dir, monkeypatch):
    """On a slow host the eval's share is known once capture and decode are timed: the probe refuses there, and
    neither times training steps nor starts vLLM (8 minutes of probing on the AVX2 host before the old refusal)."""
    import time

    import demo

    from dflash_train import measure

    def not_reached(*a, **kw):
        raise AssertionError("the probe went on to time training steps")

    monkeypatch.setattr(measure, "step_fn", not_reached)
    args = demo.parse_args(["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--max-new-tokens", "4",
                            "--batch-size", "2", "--capture-limit", "40", "--budget-min", "5"])
    with pytest.raises(UserError, match=r"^--budget-min 5: the budget leaves .* fits \(counting ~\d+ s of probe "
                                        r"to come, each engine start at 100 s\)$") as refused:
        demo.probe(args, demo_prompts, demo_started=time.perf_counter() - 290.0)  # ingest took almost the budget
    assert "measured: compute dtype" in str(refused.value) and "a training step" not in str(refused.value)


@pytest.mark.parametrize("host", ["avx2, one lookup K", "avx2, two lookup K", "bf16, its fp32 recheck"])
def test_the_early_refusal_names_a_budget_the_whole_probe_leaves_room_in(demo_prompts, tiny_target_dir, host):
    """The router demo on the AVX2 host (BENCHMARKS, 2026-12-05): refused 160 s in, as soon as capture and decode
    were timed, it named --budget-min 35, and at 35 the full probe (428 s, vLLM's measured start in it) refused
    again naming 40. The early check now names the budget the plan fits with the rest of the probe estimated from
    the capture it timed and every engine start the eval will make (one more per further lookup K, the fp32
    recheck's on a bf16 host) at the slowest measured: a budget the plan with every rate in accepts."""
    import demo

    early = {"precision": "fp32", "capture_batch": 16, "capture_s_per_prompt": 3.80,
             "capture_s_per_prompt_by_quantile": [3.36, 4.25], "decode_tok_s": 10.7, "prefill_s": 1.0}
    if host.startswith("bf16"):  # the eval's mismatches rerun in fp32, at half the rate (the AVX-512 BF16 host)
        early = {**early, "precision": "bf16", "fp32_decode_tok_s": 5.3, "fp32_prefill_s": 2.0}
    # the rest as a probe on that host measured it on 2026-12-02 (vLLM's slowest start)
    rates = {**early, "engine_start_s": 99.8, "engine_capture_s_per_prompt": 3.22, "engine_prefill_s_per_prompt": 1.73,
             "capture_new_tok_s": 28.9, "capture_mean_new_tokens": 118.0, "capture_mean_tokens": 277.5,
             "state_bytes_per_token": 5760.0, "train_step_s": 7.46, "train_online_step_s": 12.27}
    argv = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60",
            "--ngram", "2,3" if host.endswith("two lookup K") else "3"]
    rest = demo.probe_rest_s(demo.parse_args(argv), early)
    spent = 17.0 + 428.0  # ingest, then the whole probe at 35 minutes (the early check came at 160 s)
    assert spent - 160.0 <= rest  # the rest measured, vLLM's start in it, against the estimate

    def named(check) -> int:
        with pytest.raises(UserError) as refused:
            check()
        return int(re.search(r"--budget-min (\d+) fits", str(refused.value)).group(1))

    fits = named(lambda: demo.early_check(demo.parse_args(argv), demo_prompts, early, 160.0))
    assert fits > named(lambda: demo.eval_plan(demo.parse_args(argv), demo_prompts, {**early, "engine_start_s": 0.0},
                                               160.0))  # the old figure, short by the probe's rest and the starts
    plan = demo.make_plan(demo.parse_args([*argv, "--budget-min", str(fits)]), demo_prompts, rates, spent)
    assert spent + sum(plan["stage_s"].values()) <= fits * 60 * (1 - demo.MARGIN) + 1e-6


def test_the_eval_plan_holds_two_k_as_the_avx2_router_demo_timed_them(demo_prompts, tiny_target_dir):
    """The AVX2 router demo (BENCHMARKS, 2026-12-05, --budget-min 43, --ngram 3) planned vLLM's K sweep 974 s: the
    reference pass at the probe's decode rate (124 s) and two K. The pass took ~163 s and K = 2 428 s, so K = 1
    never started: the next K starts only while the budget, counted from the engine's start, still holds the
    costliest one's again (7.6 s plain engine load + 163 + 428 + 428). Every request it times prefills its prompt
    first (0.7-1.2 s for the median router prompt on that host, against 6.2 s for 64 tokens; 1.0 here): counted,
    the plan holds it, and prompt lookup at K = 3 (372 s there), in the budget the refusal of a shorter one names."""
    import demo

    rates = json.loads((Path(__file__).parent.parent / "results" / "demo_router_avx2_lookup" /
                        "demo-plan.json").read_text())["rates"]
    argv = ["--target", str(tiny_target_dir), "--max-prompt-tokens", "60", "--ngram", "3", "--budget-min"]
    rates = {**rates, "prefill_s": 1.0}
    with pytest.raises(UserError, match=r"--budget-min (\d+) fits$") as refused:
        demo.make_plan(demo.parse_args([*argv, "35"]), demo_prompts, rates, 450.0)
    fits = re.search(r"--budget-min (\d+) fits$", str(refused.value)).group(1)
    plan = demo.make_plan(demo.parse_args([*argv, fits]), demo_prompts, rates, 450.0)
    assert plan["eval_prompts"] == 20 and plan["sweep_budget_s"] >= 7.6 + 163 + 2 * 428
    assert plan["lookup_s"] >= 372


@pytest.mark.parametrize("hidden_states", ["stored", "online"])
def test_demo_captures_and_trains_as_its_plan_file_says(tmp_path, monkeypatch, hidden_states):
    """A rerun keeps the plan's choice whatever --hidden-states says: online captures a token-only store
    (`--storage none`) and trains with data.hidden_states=online; stored runs the commands it always ran (a
    complete stage made by another command would be refused)."""
    import demo

    plan = {"capture_limit": 40, "eval_limit": 30, "capture_engine": "vllm", "hidden_states": hidden_states,
            "train_budget_s": 300, "own_eval_prompts": 5, "sweep_budget_s": 200}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "smollm2-demo.demo-plan.json").write_text(json.dumps(plan))
    commands = {}

    def run_stage(name, folder, command, log, env=None, rerun=False):
        commands[name] = command
        if name == "train":
            raise StopIteration

    monkeypatch.setattr(demo.runs, "run_stage", run_stage)
    other = "online" if hidden_states == "stored" else "stored"
    with pytest.raises(StopIteration):
        demo.main(["--workdir", str(tmp_path), "--hidden-states", other])
    capture = commands["capture"]
    assert ("--storage" in capture) == (hidden_states == "online")
    if hidden_states == "online":
        assert capture[capture.index("--storage") + 1] == "none"
    assert ("data.hidden_states=online" in commands["train"]) == (hidden_states == "online")

# --- stored states or online training (benchmarks/bench_online.py) -------------------------------------------------


def test_probe_measures_both_captures_and_both_training_steps(tiny_target):
    import bench_online

    from dflash_train.measure import choose_hidden_states
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    recipe.drafter.num_layers, recipe.drafter.block_size, recipe.objective.num_anchors = 1, 4, 8
    recipe.data.max_length, recipe.train.micro_batch_size = 48, 2
    prompts = [tiny_target.render([{"role": "user", "content": text}]) for text in ("Hi", "Tell me about Rome.")]
    rates = bench_online.probe_rates(tiny_target, prompts, recipe, max_new_tokens=4, batch_size=2, steps=2,
                                     layer_ids=[1, 3, 5])
    for key in ("capture_states_tok_s", "capture_tokens_tok_s", "train_stored_tok_s", "train_online_tok_s"):
        assert 0 < rates[key] < float("inf"), key
    assert rates["state_bytes_per_token"] == 3 * 64 * 2 and rates["token_bytes_per_token"] == 5
    assert choose_hidden_states(rates, 1)[0] in ("stored", "online")


@pytest.mark.parametrize("bad,named", [
    (["--own-k", "a"], "--own-k: expected comma-separated integers"),  # a traceback after the whole vLLM eval
    (["--stopwatch-rounds", "0"], "--stopwatch-rounds 0 must be a number >= 1"),
    (["--out", "README.md"], "--out README.md is a file, not a folder"),  # a traceback at its mkdir
])
def test_bench_serving_refuses_a_bad_option_before_the_eval(bad, named, capsys):
    import bench_serving

    refused_in_one_line(bench_serving.parse_args, ["drafter", *bad], named, capsys)


def test_bench_serving_reusing_an_eval_names_the_command_that_made_it(tmp_path):
    import bench_serving

    from dflash_train.provenance import write_provenance

    out = tmp_path / "eval"
    write_provenance(out)
    made = json.loads((out / "provenance.json").read_text())
    (out / "provenance.json").write_text(json.dumps(
        {**made, "command": ["__main__.py", "eval", "--engine", "both", "--sweep-budget-s", "483"]}))
    (out / "report.json").write_text(json.dumps({"methods": []}))
    args = bench_serving.parse_args(["drafter", "--eval-out", str(out), "--sweep-budget-s", "3600"])
    log: list = []
    assert bench_serving.run_eval(args, out, log) == {"methods": []}
    assert log[0]["reused"] and log[0]["command"] == "dflash-train eval --engine both --sweep-budget-s 483"


def test_drafter_against_lookup_scores_both_at_the_same_anchors(tiny_target_dir, tiny_target):
    import ngram_baseline as ng
    import torch
    from tiny import make_tiny_drafter
    from transformers import AutoConfig

    from dflash_train.objective import simulated_acceptance

    # prompt 9, response 1 2 3 1 2 3 1 2 3 4: anchors at every response token but the last. Anchors 1, 2, 3 have
    # nothing earlier to copy; 4, 5 and 6 copy the 3 tokens their context holds after the earlier match, all right
    # (+ the target's own: 4); 7 copies 2 3 1 where 2 3 4 follows (3); 8 copies 3 1 2 where 3 4 follows (2); 9
    # copies 1 2 3 where 4 follows (1)
    ids, mask = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [False] + [True] * 10
    assert ng.lookup_lengths(ids, mask, 8) == [1, 1, 1, 4, 4, 4, 3, 2, 1]
    drafter, _ = make_tiny_drafter(AutoConfig.from_pretrained(tiny_target_dir), tiny_target.tokenizer,
                                   num_layers=1, block_size=8)
    drafter.eval()
    embed = tiny_target.model.get_input_embeddings().weight.detach()
    H = drafter.config.hidden_size * len(drafter.target_layer_ids)
    sample = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask), "hidden_states": torch.randn(11, H)}
    r = ng.drafter_against_lookup(drafter, embed, embed, [sample])
    drafted = simulated_acceptance(drafter, embed, embed, sample).tolist()
    assert r["anchors"] == 9 and r["lookup"] == 21 / 9 and r["copy_share"] == 4 / 9
    assert r["drafter"] == sum(drafted) / 9 and r["drafter_where_copying"] == sum(drafted[3:7]) / 4
    assert r["drafter_elsewhere"] == (sum(drafted[:3]) + sum(drafted[7:])) / 5
    assert r["better_of_both"] == sum(max(d, c) for d, c in zip(drafted, ng.lookup_lengths(ids, mask, 8))) / 9
