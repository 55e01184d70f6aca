"""The trainer under `accelerate launch` with DeepSpeed ZeRO-2 on CPU: 1 and 2 processes, kill-and-resume, the
overfit gate, and the data plumbing (rows, packing, eval split, schedule, store/target checks)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_train import trainer as tr
from dflash_train.data import StoreSet
from dflash_train.errors import UserError

REPO = Path(__file__).resolve().parent.parent
LAYERS = [1, 3, 5]
PROMPTS = ["Tell me about the sea.", "Write a poem about Paris.", "How do I add two numbers in Python?",
           "Summarize the article for a marketing team.", "What is the capital of Italy?",
           "Hello! How can you help me today?", "Explain why water boils at 100 degrees.",
           "Give me three bullet points about Rome."]


@torch.no_grad()
def capture_tiny_store(target, out: Path, num_samples: int = 4, response_len: int = 160, layer_ids=LAYERS,
                       seed: int = 0, cycle_len: int = 16) -> Path:
    """A capture from the tiny target with logged responses: each response walks one fixed random cycle of
    `cycle_len` tokens from a different start, and the target's tapped states for every position (HF hidden_states[i+1])
    come from one prefill over prompt + response, as `capture --responses logged` records them.

    The random tiny target's own greedy output collapses into one repeated token, which a drafter with shifted
    labels would predict just as well; on a cycle, the token k steps after the anchor is a fixed function of the
    anchor, so only correctly aligned labels can reach a high acceptance length."""
    from dflash_train.store import StoreWriter

    g = torch.Generator().manual_seed(seed)
    cycle = torch.arange(6, 484)[torch.randperm(478, generator=g)[:cycle_len]].tolist()
    model = target.model
    with StoreWriter(out, target=target.identity().to_dict(), target_layer_ids=layer_ids,
                     hidden_size=model.config.hidden_size,
                     generation={"temperature": 0.0, "responses": "logged", "template_kwargs": {}}) as w:
        for k in range(num_samples):
            prompt = target.render([{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}])
            response = [cycle[(5 * k + i) % cycle_len] for i in range(response_len)]
            ids = torch.tensor(prompt + response)
            hidden = model(ids[None], output_hidden_states=True).hidden_states
            states = torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1).to(torch.bfloat16)
            loss_mask = torch.zeros(len(ids), dtype=torch.bool)
            loss_mask[len(prompt):] = True
            w.add(ids, loss_mask, states, id=f"p{k}", weight=1)
    return out


def poison_store(src: Path, out: Path, bad: list[int]) -> Path:
    """A copy of a store whose samples `bad` have infinite hidden states (what a capture without the
    finiteness filter, or a corrupted shard, would hold; StoreWriter itself drops such samples)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dflash_train.store import StoreWriter, open_store

    store = open_store(src)
    m = store.manifest
    with StoreWriter(out, target=m["target"], target_layer_ids=m["target_layer_ids"], hidden_size=m["hidden_size"],
                     generation=m["generation"]) as w:
        for i in range(len(store)):
            s = store[i]
            w.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"])
    shard = out / open_store(out).manifest["shards"][0]["file"]
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for i in bad:
        tensors["hidden_states"][int(tensors["offsets"][i]):int(tensors["offsets"][i + 1])] = float("inf")
    save_file(tensors, str(shard), metadata=meta)  # same shapes and dtypes: same size, the manifest still fits
    return out


@pytest.fixture(scope="module")
def chain_store(tiny_target, tmp_path_factory) -> Path:
    return capture_tiny_store(tiny_target, tmp_path_factory.mktemp("store") / "chain")


def write_recipe(path: Path, store: Path, out: Path, **sections) -> Path:
    recipe = {
        "name": "test", "output_dir": str(out), "seed": 0,
        "data": {"stores": [str(store)], "eval_store": str(store), "eval_samples": 4, "max_length": 512},
        "drafter": {"num_layers": 2, "block_size": 16},
        "objective": {"num_anchors": 64},
        "optimizer": {"lr": 1.0e-2},
        # one thread per process: on a shared 2-core machine, OpenMP threads waiting on each other cost 10x
        "train": {"max_steps": 150, "micro_batch_size": 4, "device": "cpu", "cpu_threads": 1,
                  "deepspeed": str(REPO / "recipes/deepspeed/zero2.json")},
        "checkpoint": {"every": 1000},
        "eval": {"every": 0},
        "logging": {"progress_bar": False, "wandb_mode": "disabled"},
    }
    for section, values in sections.items():
        recipe[section].update(values)
    import yaml

    path.write_text(yaml.safe_dump(recipe))
    return path


def launch_cmd(recipe: Path, processes: int, *overrides: str) -> list[str]:
    multi = ["--multi_gpu"] if processes > 1 else []  # on a CPU-only machine this is what starts N processes
    return [sys.executable, "-m", "accelerate.commands.launch", *multi, "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train.py"),
            str(recipe), *overrides]


def launch(recipe: Path, processes: int = 1, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(tr._free_port())}
    return subprocess.run(launch_cmd(recipe, processes, *overrides), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_metrics(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


def checkpoint_states(run: Path) -> dict[int, dict]:
    return {step: json.loads((path / tr.STATE_FILE).read_text()) for step, path in tr.checkpoint_dirs(run)}


# --- the runs -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_process_zero2_overfit_gate(chain_store, tiny_target, tmp_path):
    """A tiny drafter trained on 4 captured samples must reach simulated acceptance >= 0.9 x B on them: only
    right labels and a right mask get there (a shifted label predicts the wrong step of the cycle)."""
    from dflash_train import objective as obj
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.store import open_store

    run = tmp_path / "run"
    proc = launch(write_recipe(tmp_path / "r.yaml", chain_store, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_rows = read_metrics(run)
    assert len(train_rows) == 150
    first, last = train_rows[0], train_rows[-1]
    for key in ("loss", "acc", "lr", "grad_norm", "tokens_per_s"):
        assert first[key] is not None and last[key] is not None, key
    assert len(first["acc"]) == 15
    assert last["loss"] < 0.2 * first["loss"]
    assert first["lr"] < train_rows[10]["lr"] > last["lr"]  # warmup, then cosine decay
    (final_eval,) = read_metrics(run, "eval")
    assert final_eval["eval_sim_tau"] >= 0.9 * 16, final_eval

    # the saved drafter loads and reproduces the acceptance length on the same samples
    drafter, config = load_drafter(run / "drafter", dtype=torch.float32)
    assert config.target_layer_ids == LAYERS
    embed = tiny_target.model.get_input_embeddings().weight.detach()
    store = open_store(chain_store)
    lengths = torch.cat([obj.simulated_acceptance(drafter, embed, embed, store[i]) for i in range(len(store))])
    assert float(lengths.float().mean()) >= 0.9 * 16
    args = json.loads((run / "drafter" / "training_args.json").read_text())
    assert args["recipe"]["objective"]["num_anchors"] == 64 and args["data"]["num_samples"] == 4
    assert config.target == store.manifest["target"]  # the target identity, once: in config.json
    assert not (run / "drafter" / "target.json").exists()
    assert (run / "drafter" / "provenance.json").exists() and not (run / "drafter" / "INCOMPLETE").exists()


@pytest.mark.slow
def test_two_processes_zero2_identical_ranks_and_kill_resume(chain_store, tmp_path):
    """2-process DeepSpeed ZeRO-2 with gradient accumulation: the replicas stay bit-identical, and a run killed
    with SIGKILL then resumed (`resume: auto`) logs exactly the losses of an uninterrupted run."""
    settings = dict(train={"max_steps": 12, "micro_batch_size": 1, "grad_accum_steps": 2},
                    checkpoint={"every": 4, "keep_last": 2}, eval={"every": 0, "at_end": False},
                    optimizer={"lr": 3.0e-3})
    ref = tmp_path / "ref"
    proc = launch(write_recipe(tmp_path / "ref.yaml", chain_store, ref, **settings), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = checkpoint_states(ref)
    assert sorted(states) == [8, 12]  # keep_last 2
    for state in states.values():
        digests = state["rank_parameter_digests"]
        assert len(digests) == 2 and digests[0] == digests[1]
    ref_losses = [r["loss"] for r in read_metrics(ref)]
    assert len(ref_losses) == 12 and all(math.isfinite(x) for x in ref_losses)

    killed = tmp_path / "killed"
    recipe = write_recipe(tmp_path / "killed.yaml", chain_store, killed, **settings)
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(tr._free_port())}
    proc = subprocess.Popen(launch_cmd(recipe, 2), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if (killed / "metrics.jsonl").exists() and any(r["step"] >= 6 for r in read_metrics(killed)):
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "drafter").exists()
    assert 4 in checkpoint_states(killed)

    proc = launch(recipe, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    assert [r["loss"] for r in read_metrics(killed)] == ref_losses


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_abort(chain_store, tmp_path):
    bad_store = poison_store(chain_store, tmp_path / "poisoned", bad=[1, 2, 3])
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", bad_store, run, train={"max_steps": 40, "micro_batch_size": 1,
                                                                      "max_bad_steps": 3},
                          data={"eval_store": None}, checkpoint={"every": 1, "keep_last": 100},
                          eval={"at_end": False})
    proc = launch(recipe)
    assert proc.returncode != 0, proc.stderr[-3000:]  # train.py exits 2; accelerate's launcher reports 1
    assert "3 optimizer steps in a row" in proc.stderr and "non-finite loss" in proc.stderr
    rows = read_metrics(run)
    assert [r["skipped"] for r in rows[-3:]] == [True, True, True]
    assert all(r["loss"] is None for r in rows if r["skipped"])
    assert rows[-1]["bad_steps"] == sum(r["skipped"] for r in rows)
    # a skipped step leaves the drafter untouched
    states = checkpoint_states(run)
    for r in rows:
        if r["skipped"] and r["step"] - 1 in states and r["step"] in states:
            assert states[r["step"]]["rank_parameter_digests"] == states[r["step"] - 1]["rank_parameter_digests"]
        if not r["skipped"] and r["step"] - 1 in states:
            assert states[r["step"]]["rank_parameter_digests"] != states[r["step"] - 1]["rank_parameter_digests"]
    assert not (run / "drafter").exists()


# --- plumbing ----------------------------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine():
    f = [tr.lr_factor(s, 100, 0.04, "cosine", 0.0) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[-1] < 0.01
    assert tr.lr_factor(50, 100, 0.04, "constant", 0.0) == 1.0
    assert tr.lr_factor(99, 100, 0.0, "cosine", 0.1) >= 0.1


def test_lr_schedule_wsd_and_time_budget_progress():
    f = [tr.lr_factor(s, 100, 0.1, "wsd", 0.0, decay_ratio=0.2) for s in range(100)]
    assert f[9] == 1.0 and all(x == 1.0 for x in f[10:80])  # warmup, then stable
    assert all(a > b for a, b in zip(f[80:], f[81:])) and f[-1] < 0.1  # linear decay over the last 20%
    # with a time budget the same shape runs on the fraction of the budget used, whatever the step
    assert tr.lr_factor(3, 10_000, 0.1, "wsd", 0.0, decay_ratio=0.2, progress=0.05) == pytest.approx(0.5)
    assert tr.lr_factor(3, 10_000, 0.1, "wsd", 0.0, decay_ratio=0.2, progress=0.5) == 1.0
    assert tr.lr_factor(3, 10_000, 0.1, "wsd", 0.1, decay_ratio=0.2, progress=0.9) == pytest.approx(0.55)
    assert tr.lr_factor(3, 10_000, 0.0, "cosine", 0.0, progress=1.0) == pytest.approx(0.0)
    clock = tr.TrainClock(budget_s=10.0, already_s=4.0)
    assert clock.progress_at(3, 10_000) == pytest.approx(0.4) and not clock.expired
    # a run that reaches its max_steps before its budget is that far along: the schedule decays on steps then
    assert clock.progress_at(90, 100) == pytest.approx(0.9)
    clock.spent_s = 10.0
    assert clock.expired and tr.TrainClock(None).progress_at(5, 10) is None


def test_context_warmup_covers_the_first_fraction_of_steps_or_of_the_time_budget():
    from dflash_train.recipe import Recipe

    recipe = Recipe()
    recipe.objective.context_warmup_ratio = 0.4
    no_budget = tr.TrainClock(None)
    assert tr.in_context_warmup(recipe, 39, 100, no_budget) and not tr.in_context_warmup(recipe, 40, 100, no_budget)
    assert tr.in_context_warmup(recipe, 500, 10_000, tr.TrainClock(100.0, already_s=39.0))
    assert not tr.in_context_warmup(recipe, 5, 10_000, tr.TrainClock(100.0, already_s=41.0))
    recipe.objective.context_warmup_ratio = 0.0
    assert not tr.in_context_warmup(recipe, 0, 100, no_budget)


@pytest.mark.slow
def test_time_budget_target_init_context_norm_then_fine_tune_from_it(chain_store, tmp_path):
    """The sample-efficiency switches in a real launch: a run that stops on its time budget, on the first 2
    samples, starting from the target with scaled context; then a run that starts from its exported drafter."""
    from dflash_train.model.checkpoint import load_drafter

    run = tmp_path / "a"
    recipe = write_recipe(tmp_path / "a.yaml", chain_store, run, train={"max_steps": 100_000, "time_budget_s": 4.0,
                                                                        "micro_batch_size": 2},
                          drafter={"init": "target", "context_norm": True}, data={"max_samples": 2})
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "drafter" / "training_args.json").read_text())["run"]
    assert 1 <= summary["steps"] < 100_000 and 4.0 <= summary["train_time_s"] < 30, summary
    assert "2 samples" in proc.stdout and "or 4 s of training" in proc.stdout
    rows = read_metrics(run)
    assert rows[-1]["lr"] < rows[len(rows) // 2]["lr"]  # the schedule ran on the budget: it decayed

    # fine-tune from it: with a negligible learning rate the weights stay those of the exported drafter
    run_b = tmp_path / "b"
    recipe_b = write_recipe(tmp_path / "b.yaml", chain_store, run_b, train={"max_steps": 1},
                            drafter={"init_from": str(run / "drafter"), "context_norm": True},
                            optimizer={"lr": 1.0e-12}, eval={"at_end": False})
    proc = launch(recipe_b)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (a, _), (b, _) = load_drafter(run / "drafter"), load_drafter(run_b / "drafter")
    for (name, x), (_, y) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert torch.allclose(x.float(), y.float(), rtol=2e-2, atol=1e-3), name


def test_deepspeed_config_takes_batch_clip_and_precision_from_the_recipe(monkeypatch):
    from dflash_train.recipe import Recipe

    monkeypatch.chdir(REPO)
    recipe = Recipe()
    recipe.data.stores = ["x"]
    recipe.train.micro_batch_size, recipe.train.grad_accum_steps, recipe.optimizer.grad_clip = 3, 5, 0.5
    recipe.train.precision = "bf16"
    cfg = tr.deepspeed_config(recipe)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 5
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    recipe.train.precision, recipe.train.device = "auto", "cpu"  # auto: what this CPU runs natively
    assert tr.deepspeed_config(recipe)["bf16"]["enabled"] is (tr.train_precision(recipe).name == "bf16")
    assert cfg["zero_optimization"]["stage"] == 2
    assert "auto" not in json.dumps(cfg)


def test_store_from_another_target_is_rejected(chain_store, tmp_path):
    from tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", num_layers=6)
    stores = StoreSet([str(chain_store)])
    with pytest.raises(UserError, match="captured from target"):
        tr.check_store_against_target(stores, str(other))


def test_layer_ids_must_match_the_store(chain_store, tiny_target_dir):
    from dflash_train.recipe import Recipe

    recipe = Recipe()
    recipe.drafter.target_layer_ids = [1, 2, 3]
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 2, 3\] differ .*\[1, 3, 5\]"):
        tr.build_drafter(recipe, StoreSet([str(chain_store)]), str(tiny_target_dir))


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_target):
    from test_objective import _synthetic_batch, _tiny_drafter

    from dflash_train import objective as obj

    batch = _synthetic_batch()
    blocks = obj.sample_anchors(batch["loss_mask"], 6, 4, torch.Generator().manual_seed(0))
    results = []
    for checkpointing in (False, True):
        drafter, embed, head = _tiny_drafter(tiny_target, block_size=4)
        if checkpointing:
            drafter.gradient_checkpointing_enable()
        out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=drafter.mask_token_id,
                              gamma=7.0, attention="blockwise")
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(results[0][1], results[1][1]))


def test_a_launch_that_started_fewer_processes_than_asked_is_an_error(monkeypatch):
    from dflash_train.recipe import Recipe

    recipe = Recipe()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what `accelerate launch --num_processes 2` sets, on CPU,
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # before starting a single process
    with pytest.raises(UserError, match="started a single process"):
        tr.make_accelerator(recipe)
