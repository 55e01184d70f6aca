"""What the scripts share (dflash_train/support/runs.py: override/variant parsing, metrics and report parsing into
table rows, the skip-if-complete decision, portable results), the experiments' options (scripts/), the probes
(probes/) and the benchmarks' testable parts (benchmarks/), on synthetic files and tiny models. The demo's tests:
tests/test_demo.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import ablate_sample_efficiency as ablate
import experiment_own_outputs as experiment

from dflash_train import eval_report
from dflash_train.errors import UserError
from dflash_train.eval_report import EvalReport, MethodRow, OwnLoop, Settings
from dflash_train.provenance import INCOMPLETE_MARKER, PROVENANCE_FILE
from dflash_train.support import runs


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
    """An eval report.json as the eval stage writes it: rows with their roles (stages.evaluate.own_loop.ROLES)."""
    methods = [MethodRow(method="plain (target only)", role="plain", block_size=1, tokens_per_s=20.0)]
    for i, d in enumerate(drafters):
        methods.append(MethodRow(method=f"drafter {d.name}", role="drafter" if i == 0 else "baseline",
                                 drafter=str(d), block_size=16, tau_steps=2.0 + i, tau_per_prompt=2.1 + i,
                                 per_position_acceptance=[0.9, 0.5 - 0.1 * i, 0.25, 0.1],
                                 tokens_per_s=10.0 * (i + 1), lossless_mismatches=0))
    methods.append(MethodRow(method="block size 1", role="no_speculation", block_size=1, tokens_per_s=21.0))
    folder.mkdir(parents=True, exist_ok=True)
    eval_report.dump(EvalReport(own=OwnLoop(methods=methods), settings=Settings(num_prompts=3)),
                     folder / "report.json")
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
    (tmp_path / "report.json").write_text(json.dumps({"schema_version": "1.0", "vllm": {"tau_steps": 2.0}}))
    with pytest.raises(UserError, match="no run of the project's loop"):
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
        assert recipe.drafter.draft_vocab_size is None  # the public recipe's whole head (soft labels need it)


# --- the probes (probes/) -----------------------------------------------------------------------------------------


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

    from dflash_train.store.writer import StoreWriter

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


def test_a_combined_rule_walks_the_answer_taking_each_step_from_the_source_it_picks():
    import argparse

    import combined_rule as cr

    # anchors 10..17 of one answer; lookup matched at 12 and 13 only, where it accepts 4 tokens and the drafter 1
    rows = [{"at": a, "drafter": 2, "p": 0.9, "lookup": 1, "n": 0, "suffix": 1, "score": 0.0, "slen": 0}
            for a in range(10, 18)]
    for row in rows[2:4]:
        row.update(drafter=1, lookup=4, n=2, p=0.3)
    always = cr.walk(rows, lambda row: ("drafter", True), k_drafter=9, k_lookup=4)
    assert [s[:2] for s in always] == [("drafter", 2), ("drafter", 1), ("drafter", 1), ("drafter", 2),
                                       ("drafter", 2)]  # anchors 10 12 13 14 16
    matched = cr.walk(rows, lambda row: ("lookup", False) if row["n"] else ("drafter", True), k_drafter=9, k_lookup=4)
    assert matched == [("drafter", 2, True), ("lookup", 4, False), ("drafter", 2, True)]  # 10 -> 12 -> 16 -> (18)
    capped = cr.walk(rows, lambda row: ("lookup", True) if row["n"] else ("drafter", True), k_drafter=9, k_lookup=1)
    assert capped[1] == ("lookup", 2, True)  # at most K + 1 tokens a step
    args = argparse.Namespace(k_drafter=9, k_lookup=4, drafter_cost="1.5,0", lookup_cost="1.0,0", suffix=False)
    by_rule = {r["rule"]: r for r in cr.evaluate_rules([rows], args)}
    unasked = by_rule["lookup where it matched, the drafter not asked there (confidence 1)"]  # the drafter skipped
    assert unasked["tau"] == pytest.approx(8 / 3) and unasked["lookup_share"] == pytest.approx(1 / 3)
    assert unasked["drafter_skipped"] == pytest.approx(1 / 3)
    assert unasked["speedup"] == unasked["speedup_lookup_alone_cost"] == pytest.approx(8 / (2 * 1.5 + 1.0))
    asked = by_rule["lookup where it matched, unless the drafter's first draft has p >= 0.6"]  # the same steps
    assert asked["tau"] == pytest.approx(8 / 3) and asked["drafter_skipped"] == 0
    assert asked["speedup"] == pytest.approx(8 / (3 * 1.5))  # the drafter ran at each
    assert by_rule["drafter always"]["tau"] == pytest.approx(8 / 5)
    # the suffix tree drafts 6 right at anchor 10 with a score of 3: a rule at suffix 2 takes it there, without the
    # drafter's pass (10 -> 17: 7 tokens, then the drafter's 2), one at suffix 4 does not
    rows[0].update(suffix=7, score=3.0, slen=6)
    args.suffix = True
    by_rule = {r["rule"]: r for r in cr.evaluate_rules([rows], args)}
    taken = by_rule["suffix where its score >= 2, else lookup/drafter at confidence 0.6"]
    assert (taken["tau"], taken["suffix_share"], taken["drafter_skipped"]) == (4.5, 0.5, 0.5)
    assert taken["speedup"] == pytest.approx(9 / (1.0 + 1.5))
    assert by_rule["suffix where its score >= 4, else lookup/drafter at confidence 0.6"]["suffix_share"] == 0


def test_two_drafters_walked_under_the_served_rule_are_paired_by_answer():
    import argparse

    import combined_rule as cr

    from dflash_train.spec_decode.lookup import CombinedRule

    def answer(drafter: int) -> list[dict]:  # 6 anchors; nothing free drafts; the drafter commits `drafter` a step
        return [{"at": a, "drafter": drafter, "p": 0.9, "lookup": 1, "n": 0, "suffix": 1, "score": 0.0, "slen": 0}
                for a in range(6)]
    args = argparse.Namespace(k_drafter=7, k_lookup=4, drafter_cost="1.5,0", lookup_cost="1.0,0")
    served = cr.plugin_rule(CombinedRule(confidence=0.6, suffix=1.5))
    paired = cr.against([answer(3), answer(2)], [answer(3), answer(1)], served, args)
    # answer 1: 3 tokens a step either way (6 tokens in 2 steps); answer 2: 2 a step (3 steps) against 1 (6 steps)
    assert (paired["tau"], paired["tau_against"]) == (2.5, 2.0) and paired["tau_ratio"] == pytest.approx(1.25)
    assert paired["speed_ratio"] == pytest.approx((12 / 7.5) / (12 / 12))  # the steps' modelled cost, 1.5 each
    low, high = paired["tau_ratio_interval"]
    assert 1.0 <= low <= 1.25 <= high <= 2.0


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
    from dflash_train.store.writer import StoreWriter

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


# --- the benchmarks (benchmarks/) ---------------------------------------------------------------------------------


def test_probe_measures_both_captures_and_both_training_steps(tiny_target):
    import bench_online

    from dflash_train.stages.train.recipe import Recipe
    from dflash_train.support.measure import choose_hidden_states

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
    assert bench_serving.run_eval(args, out, log).own is None  # read through the schema, an old report too
    assert log[0]["reused"] and log[0]["command"] == "dflash-train eval --engine both --sweep-budget-s 483"


def test_draft_vocabulary_takes_the_answers_ids_first_then_the_prompts_and_always_eos():
    from collections import Counter

    import bench_draft_vocab

    answers, prompts = Counter({7: 5, 9: 3, 4: 1}), Counter({11: 9, 7: 2, 12: 1})
    assert bench_draft_vocab.vocabulary(answers, prompts, 0, [2]) == [2, 4, 7, 9]  # every answer id, and EOS
    assert bench_draft_vocab.vocabulary(answers, prompts, 3, [2]) == [2, 7, 9]  # the answers' most used first
    assert bench_draft_vocab.vocabulary(answers, prompts, 5, [2]) == [2, 4, 7, 9, 11]  # then the prompts' most used


def test_cut_drafter_drafts_with_the_targets_own_rows_at_the_ids_vllm_maps_them_to(tiny_parts, tmp_path):
    import bench_draft_vocab
    import torch
    from safetensors.torch import load_file
    from tiny import make_tiny_drafter

    from dflash_train.model.checkpoint import save_drafter

    config, tokenizer = tiny_parts
    drafter, drafter_config = make_tiny_drafter(config, tokenizer)
    whole = save_drafter(drafter, drafter_config, tmp_path / "whole")
    head = torch.randn(config.vocab_size, config.hidden_size)
    ids = [2, 5, 40, 1000]
    bench_draft_vocab.cut_drafter(whole, head, ids, tmp_path / "cut")
    cut, before = load_file(str(tmp_path / "cut" / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert torch.equal(cut["lm_head.weight"], head[ids].to(cut["lm_head.weight"].dtype))
    assert (torch.arange(len(ids)) + cut["d2t"]).tolist() == ids  # vLLM's DFlash: target id = draft id + d2t
    assert all(torch.equal(cut[k], v) for k, v in before.items()) and set(cut) == {*before, "lm_head.weight", "d2t"}
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["draft_vocab_size"] == len(ids)


def test_draft_vocab_pairs_each_prompts_speedup_by_either_clock():
    import bench_draft_vocab

    def job(*speedups):  # per prompt: the engine's clock at `speedups`, the stopwatch at twice them
        return {"per_prompt": {f"p{i}": {"plain_s": s, "spec_s": 1.0, "plain_wall_s": 2 * s, "spec_wall_s": 1.0}
                               for i, s in enumerate(speedups)}}

    ratio, interval = bench_draft_vocab.against(job(1.5, 3.0), job(1.0, 2.0))
    assert ratio == pytest.approx(1.5) and interval == pytest.approx([1.5, 1.5])
    assert bench_draft_vocab.against(job(1.5, 3.0), job(2.0, 2.0), "wall_")[0] == pytest.approx(4.5 / 4)


def test_the_refresh_demo_runs_each_day_as_one_refresh_command_and_tabulates_the_ledger():
    import refresh_demo

    args = refresh_demo.parse_args(["--train-s", "30,40", "--extra=--eval-limit=4"])
    day1, day2 = (refresh_demo.refresh_command(log, Path("serving"), Path("out"), args, s)
                  for log, s in zip(refresh_demo.DAYS, args.train_s))
    assert day1[3:5] == ["refresh", str(refresh_demo.DAYS[0])] and "--no-push" in day1
    assert "train.time_budget_s=30" in day1 and "train.time_budget_s=40" in day2
    assert day1[-2:] == ["--eval-override=--dtype=fp32", "--eval-limit=4"]  # the extra flags last: they win
    with pytest.raises(SystemExit):
        refresh_demo.parse_args(["--train-s", "30"])
    ledger = {"rounds": [{"number": 1, "logs": [{"name": "day1.jsonl.gz"}], "train": ["a", "b"], "eval": ["c"],
                          "seen": [], "release": {"released": True, "folder": "round-001/release"},
                          "figures": {"drift": {"verdict": "moved down", "tau": 1.5, "tau_interval": [1.3, 1.8],
                                                "card_tau": 2.3},
                                      "against serving (new)": {"traffic": "new", "tau_candidate": 2.0,
                                                                "tau_serving": 1.5, "tau_ratio": 1.333,
                                                                "tau_ratio_interval": [1.2, 1.5],
                                                                "speedup_ratio": 1.25}}}]}
    table = refresh_demo.summary(ledger, [{"day": "day 1", "seconds": 600.0}])
    assert ("| 1 | day1.jsonl.gz | 2 / 1 / 0 | moved down: 1.500 [1.300, 1.800] vs card 2.300 | new: 2.000 vs 1.500, "
            "x1.333 [1.200, 1.500], speed x1.250 | released |") in table
    assert refresh_demo.serving_after(ledger, 1) == Path("round-001/release")
    assert refresh_demo.serving_after(ledger, 2) is None


def test_the_drift_days_are_the_router_then_mostly_triage_with_some_of_day_1_again():
    import gzip

    from conftest import REPO_ROOT

    def lines(name):
        with gzip.open(REPO_ROOT / "data" / "workloads" / name, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def app(line):
        return line["request"]["messages"][0]["content"].split(".")[0]

    day1, day2 = lines("drift_day1.jsonl.gz"), lines("drift_day2.jsonl.gz")
    assert len(day1) == 1200 and {app(line) for line in day1} == {"You are the request router of a chat assistant"}
    apps = {}
    for line in day2:
        apps[app(line)] = apps.get(app(line), 0) + 1
    assert apps == {"You are the triage assistant of a software company's help desk": 900,
                    "You are the request router of a chat assistant": 450}
    again = {json.dumps(line["request"], sort_keys=True) for line in day1}
    # day 1's first 150 again, and a few new router requests whose message a day-1 user had sent too
    assert 150 <= sum(json.dumps(line["request"], sort_keys=True) in again for line in day2) < 170
