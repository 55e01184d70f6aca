"""The trainer under `accelerate launch` with DeepSpeed ZeRO-2 on CPU: 1 and 2 processes, kill-and-resume, the
overfit gate, and the data plumbing (rows, packing, eval split, store/target checks; the schedule: test_schedule.py)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.errors import UserError
from dflash_train.stages.train.accelerator import _free_port, deepspeed_config, make_accelerator, train_precision
from dflash_train.stages.train.checkpointing import nonfinite_parameters
from dflash_train.stages.train.data import StoreSet, check_store_hashes
from dflash_train.stages.train.drafter import build_drafter, check_store_against_target
from dflash_train.stages.train.run_folder import STATE_FILE, check_resumable, checkpoint_dirs

REPO = Path(__file__).resolve().parent.parent
LAYERS = [1, 3, 5]
PROMPTS = ["Tell me about the sea.", "Write a poem about Paris.", "How do I add two numbers in Python?",
           "Summarize the article for a marketing team.", "What is the capital of Italy?",
           "Hello! How can you help me today?", "Explain why water boils at 100 degrees.",
           "Give me three bullet points about Rome."]


@torch.no_grad()
def capture_tiny_store(target, out: Path, num_samples: int = 4, response_len: int = 160, layer_ids=LAYERS,
                       seed: int = 0, cycle_len: int = 16, id_prefix: str = "p") -> Path:
    """A capture from the tiny target with logged responses: each response walks one fixed random cycle of
    `cycle_len` tokens from a different start, and the target's tapped states for every position (HF hidden_states[i+1])
    come from one prefill over prompt + response, as `capture --responses logged` records them.

    The random tiny target's own greedy output collapses into one repeated token, which a drafter with shifted
    labels would predict just as well; on a cycle, the token k steps after the anchor is a fixed function of the
    anchor, so only correctly aligned labels can reach a high acceptance length."""
    from dflash_train.store.writer import StoreWriter

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
            w.add(ids, loss_mask, states, id=f"{id_prefix}{k}", weight=1)
    return out


def poison_store(src: Path, out: Path, bad: list[int]) -> Path:
    """A copy of a store whose samples `bad` have infinite hidden states (what a capture without the
    finiteness filter, or a corrupted shard, would hold; StoreWriter itself drops such samples)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dflash_train.provenance import sha256_file
    from dflash_train.store.reader import open_store
    from dflash_train.store.writer import StoreWriter

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
    digest = sha256_file(shard)  # as a capture that wrote these states would have hashed them
    for name in ("manifest.json", "journal-r000.json"):
        record = json.loads((out / name).read_text())
        for entry in record["shards"]:
            entry["sha256"] = digest
        (out / name).write_text(json.dumps(record))
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
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(_free_port())}
    return subprocess.run(launch_cmd(recipe, processes, *overrides), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def proc_ok(proc: subprocess.CompletedProcess) -> bool:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return True


def read_metrics(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


def checkpoint_states(run: Path) -> dict[int, dict]:
    return {step: json.loads((path / STATE_FILE).read_text()) for step, path in checkpoint_dirs(run)}


# --- the runs -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_process_zero2_overfit_gate(chain_store, tiny_target, tmp_path):
    """A tiny drafter trained on 4 captured samples must reach simulated acceptance >= 0.9 x B on them: only
    right labels and a right mask get there (a shifted label predicts the wrong step of the cycle)."""
    from dflash_train import objective as obj
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.store.reader import open_store

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
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(_free_port())}
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


def prefill_stores(target, out: Path, num_samples: int = 4, cycle_len: int = 16) -> tuple[Path, Path]:
    """Two stores of the same samples (prompt + a response walking a fixed cycle, as `capture_tiny_store`): one
    with the states `capture --responses logged` records (states.prefill_capture, one sample at a time, in the
    target's dtype, stored as bf16) and one token-only (`capture --storage none`)."""
    from dflash_train.states import prefill_capture
    from dflash_train.store.writer import StoreWriter

    g = torch.Generator().manual_seed(0)
    cycle = torch.arange(6, 484)[torch.randperm(478, generator=g)[:cycle_len]].tolist()
    paths = out / "states", out / "tokens"
    writers = [StoreWriter(path, target=target.identity().to_dict(), target_layer_ids=LAYERS,
                           hidden_size=target.config.hidden_size, storage_dtype=storage,
                           generation={"temperature": 0.0, "responses": "logged", "template_kwargs": {}})
               for path, storage in zip(paths, ("bf16", "none"))]
    for k in range(num_samples):
        prompt = target.render([{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}])
        response = [cycle[(5 * k + i) % cycle_len] for i in range(40 + 9 * k)]
        got = prefill_capture(target.model, [prompt + response], [len(prompt)], LAYERS,
                              target.tokenizer.pad_token_id)[0]
        loss_mask = torch.zeros(len(got.input_ids), dtype=torch.bool)
        loss_mask[len(prompt):] = True
        for writer, states in zip(writers, (got.hidden_states, None)):
            writer.add(torch.tensor(got.input_ids), loss_mask, states, id=f"p{k}")
    for writer in writers:
        writer.close()
    return paths


@pytest.mark.slow
def test_online_states_train_exactly_as_the_stored_ones_in_two_processes(tiny_target_dir, tmp_path):
    """Stored states against states the target computes in training (data.hidden_states: online) on a token-only
    store of the same tokens, same seed, 2 processes, bf16. The tolerance derived from the computation is zero: the
    store holds what capture's prefill gave each sample alone in bf16, and online training runs that very prefill
    (states.prefill_capture) on each micro batch of one sample, same shape, same dtype, so every state is the same
    bits and so are the losses, the held-out loss and simulated tau, and the weights. (Micro batches of several
    samples are left-padded: their states then differ by rounding order, within tolerance.model_tolerance, see
    test_data.py.) A wrong tap, shift or truncation moves the losses by 0.04 to 0.4 after one update."""
    from dflash_train.target import load_target

    states, tokens = prefill_stores(load_target(str(tiny_target_dir), dtype=torch.bfloat16), tmp_path)
    runs = {}
    for source, store in (("stored", states), ("online", tokens)):
        run = tmp_path / source
        proc = launch(write_recipe(tmp_path / f"{source}.yaml", store, run, data={"hidden_states": source,
                                                                                   "eval_samples": 2},
                                   train={"max_steps": 4, "micro_batch_size": 1, "grad_accum_steps": 2,
                                          "precision": "bf16"}, optimizer={"lr": 3.0e-3}), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"hidden states {source}" in proc.stdout
        runs[source] = run
    losses = {source: [r["loss"] for r in read_metrics(run)] for source, run in runs.items()}
    assert len(losses["stored"]) == 4 and all(math.isfinite(x) for x in losses["stored"])
    assert losses["online"] == losses["stored"]
    evals = {source: read_metrics(run, "eval")[-1] for source, run in runs.items()}
    assert evals["online"]["eval_loss"] == evals["stored"]["eval_loss"]
    assert evals["online"]["eval_sim_tau"] == evals["stored"]["eval_sim_tau"]
    digests = {source: checkpoint_states(run)[4]["rank_parameter_digests"] for source, run in runs.items()}
    assert digests["online"] == digests["stored"] and len(set(digests["online"])) == 1
    recorded = json.loads((runs["online"] / "drafter" / "training_args.json").read_text())
    assert recorded["run"]["hidden_states"] == "online" and recorded["run"]["compute_dtype"] == "bf16"
    assert recorded["recipe"]["data"]["hidden_states"] == "online" and recorded["data"]["stores"][0]["kind"] == "tokens"
    stored = json.loads((runs["stored"] / "drafter" / "training_args.json").read_text())["run"]
    assert stored["hidden_states"] == "stored" and "computed_by" not in stored


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


@pytest.mark.slow
def test_time_budget_target_init_context_norm_then_fine_tune_from_it(chain_store, tiny_target, tiny_target_dir,
                                                                    tmp_path):
    """The sample-efficiency switches in a real launch: a run that stops on its time budget, on the first 2
    samples, starting from the target with scaled context, exported with a draft vocabulary; then a run that starts
    from its exported drafter (and, training with the whole head, exports the whole head)."""
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.target import load_embedding_and_head

    run = tmp_path / "a"
    recipe = write_recipe(tmp_path / "a.yaml", chain_store, run, train={"max_steps": 100_000, "time_budget_s": 4.0,
                                                                        "micro_batch_size": 2},
                          drafter={"init": "target", "context_norm": True, "draft_vocab_size": 12},
                          data={"max_samples": 2})
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "drafter" / "training_args.json").read_text())["run"]
    assert 1 <= summary["steps"] < 100_000 and 4.0 <= summary["train_time_s"] < 30, summary
    assert "2 samples" in proc.stdout and "or 4 s of training" in proc.stdout
    # the draft vocabulary: the tiny target's stop tokens, then the ids the answers use most (their cycle has 16),
    # rows the target head's own; the record says what they cover
    vocab = summary["draft_vocab"]
    assert vocab["size"] == 12 and vocab["answer_ids"] == 16 and 0.5 < vocab["answer_tokens_covered"] < 1, vocab
    cut, config = load_drafter(run / "drafter")
    ids = (torch.arange(12) + cut.d2t).tolist()
    assert config.draft_vocab_size == 12 and ids == sorted(ids) and set(tiny_target.stop_token_ids()) <= set(ids)
    head = load_embedding_and_head(str(tiny_target_dir), dtype=torch.float32)[1]
    assert torch.equal(cut.lm_head.weight.float(), head[ids])
    rows = read_metrics(run)
    assert rows[-1]["lr"] < rows[len(rows) // 2]["lr"]  # the schedule ran on the budget: it decayed

    # fine-tune from it: with a negligible learning rate the weights stay those of the exported drafter
    run_b = tmp_path / "b"
    recipe_b = write_recipe(tmp_path / "b.yaml", chain_store, run_b, train={"max_steps": 1},
                            drafter={"init_from": str(run / "drafter"), "context_norm": True},
                            optimizer={"lr": 1.0e-12}, eval={"at_end": False})
    proc = launch(recipe_b)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (a, _), (b, b_config) = load_drafter(run / "drafter"), load_drafter(run_b / "drafter")
    assert b_config.draft_vocab_size is None and b.lm_head is None
    whole = b.state_dict()
    for name, x in a.state_dict().items():
        if name not in ("lm_head.weight", "d2t"):
            assert torch.allclose(x.float(), whole.pop(name).float(), rtol=2e-2, atol=1e-3), name
    assert not whole


def test_deepspeed_config_takes_batch_clip_and_precision_from_the_recipe(monkeypatch):
    from dflash_train.stages.train.recipe import Recipe

    monkeypatch.chdir(REPO)
    recipe = Recipe()
    recipe.data.stores = ["x"]
    recipe.train.micro_batch_size, recipe.train.grad_accum_steps, recipe.optimizer.grad_clip = 3, 5, 0.5
    recipe.train.precision = "bf16"
    cfg = deepspeed_config(recipe)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 5
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    recipe.train.precision, recipe.train.device = "auto", "cpu"  # auto: what this CPU runs natively
    assert deepspeed_config(recipe)["bf16"]["enabled"] is (train_precision(recipe).name == "bf16")
    assert cfg["zero_optimization"]["stage"] == 2
    assert "auto" not in json.dumps(cfg)


def test_store_from_another_target_is_rejected(chain_store, tmp_path):
    from tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", num_layers=6)
    stores = StoreSet([str(chain_store)])
    with pytest.raises(UserError, match="captured from target"):
        check_store_against_target(stores, str(other))


def test_layer_ids_must_match_the_store(chain_store, tiny_target_dir):
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    recipe.drafter.target_layer_ids = [1, 2, 3]
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 2, 3\] differ .*\[1, 3, 5\]"):
        build_drafter(recipe, StoreSet([str(chain_store)]), str(tiny_target_dir))


# --- warm starts from published drafters ------------------------------------------------------------------------


def shaped_like(config, **changes):
    """A target config that differs from `config` in `changes` (hidden size, vocabulary): another target."""
    from types import SimpleNamespace

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "num_hidden_layers")
    return SimpleNamespace(**{**{k: getattr(config, k) for k in keys}, **changes})


def warm_start_recipe(store: Path, init_from: str, tmp_path: Path, **drafter):
    from dflash_train.stages.train.recipe import load_recipe

    return load_recipe(write_recipe(tmp_path / "warm.yaml", store, tmp_path / "run",
                                    drafter={"num_layers": None, "init_from": init_from, **drafter}))


def test_a_warm_start_is_held_against_the_target_and_the_store_in_one_line(chain_store, tiny_target, tiny_parts,
                                                                          tmp_path):
    """A published drafter (z-lab's layout, written by its reference code) that does not fit is refused before any
    training: another target's shape, another vocabulary, taps the target cannot give, another target's identity
    (a drafter this project trained records it), and a recipe key that contradicts the drafter."""
    from tiny import make_tiny_drafter, make_tiny_target, reference_drafter

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import target_identity

    config, tokenizer = tiny_parts
    folders = {
        "hidden": reference_drafter(tmp_path / "hidden", shaped_like(config, hidden_size=32, intermediate_size=64,
                                                                    num_attention_heads=2, num_key_value_heads=1),
                                    LAYERS, 1000),
        "vocab": reference_drafter(tmp_path / "vocab", shaped_like(config, vocab_size=2048), LAYERS, 1000),
        "taps": reference_drafter(tmp_path / "taps", config, [1, 3, 7], 1000),
        "eos": reference_drafter(tmp_path / "eos", config, LAYERS, tokenizer.eos_token_id),
    }
    other = target_identity(make_tiny_target(tmp_path / "other", seed=1)).to_dict()
    drafter, dconfig = make_tiny_drafter(config, tokenizer, target_layer_ids=LAYERS, target_identity=other)
    folders["identity"] = save_drafter(drafter, dconfig, tmp_path / "identity")
    expected = {"hidden": "its hidden size 32 != 64", "vocab": "vocab size 2048 != the target's embedding rows 1024",
                "taps": "layer id 7 is not a layer a 8-layer target can tap",
                "eos": f"mask_token_id {tokenizer.eos_token_id} is the target's pad or EOS token",
                "identity": "its target's weights differ"}
    stores = StoreSet([str(chain_store)])
    for case, message in expected.items():
        with pytest.raises(UserError, match=re.escape(message)) as err:
            build_drafter(warm_start_recipe(chain_store, str(folders[case]), tmp_path), stores,
                             str(tiny_target.path))
        assert "\n" not in str(err.value) and str(err.value).startswith(f"drafter.init_from {case} ")
    with pytest.raises(UserError, match=r"recipe drafter.num_layers is 3, the drafter's is 2"):
        build_drafter(warm_start_recipe(chain_store, str(folders["vocab"]).replace("vocab", "eos"), tmp_path,
                                           num_layers=3), stores, str(tiny_target.path))


def test_a_warm_start_from_damaged_or_oversized_weights_is_one_line_naming_the_file(chain_store, tiny_target,
                                                                                   tiny_parts, tmp_path):
    """A starting drafter with an inf in its weights is named by file and tensor (not "training diverged ... lower
    optimizer.lr" at step 0), and one whose config.json claims a billion layers by file and key, at once (not
    minutes of allocation ending in a MemoryError)."""
    import shutil

    from safetensors.torch import save_file
    from tiny import reference_drafter

    zlab = reference_drafter(tmp_path / "zlab", tiny_parts[0], LAYERS, 1000)
    damaged = Path(shutil.copytree(zlab, tmp_path / "damaged"))
    state = load_file(str(damaged / "model.safetensors"))
    state["fc.weight"][3, 5] = float("inf")
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    huge = Path(shutil.copytree(zlab, tmp_path / "huge"))
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    expected = {damaged: f"{damaged / 'model.safetensors'}: tensor fc.weight holds 0 NaN and 1 inf value(s): the "
                         f"drafter's weights are damaged",
                huge: f"{huge / 'config.json'}: num_hidden_layers is 1000000000, not an integer from 1 to 1024"}
    for folder, message in expected.items():
        with pytest.raises(UserError) as err:
            build_drafter(warm_start_recipe(chain_store, str(folder), tmp_path), StoreSet([str(chain_store)]),
                             str(tiny_target.path))
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def speculators_copy(zlab: Path, out: Path) -> Path:
    """The z-lab drafter in speculators' layout (as its DFlash converter writes one): aux ids = z-lab ids + 1."""
    config = json.loads((zlab / "config.json").read_text())
    layer = {k: v for k, v in config.items() if k not in ("architectures", "block_size", "dflash_config",
                                                          "num_target_layers")}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "transformer_layer_config": layer,
        "draft_vocab_size": layer["vocab_size"], "block_size": 16, "mask_token_id": 1000,
        "aux_hidden_state_layer_ids": [i + 1 for i in config["dflash_config"]["target_layer_ids"]]}))
    (out / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
    return out


def test_warm_starts_from_a_hub_repo_id_and_a_speculators_folder_train_on(chain_store, tiny_parts, tmp_path):
    """The published drafter as a user starts from it: a Hub repo id (the loopback Hub) of a drafter written by the
    reference code, and the same drafter in speculators' layout, each continue training under `accelerate launch`;
    the exported drafter records where it started (repo, revision, layout, weights sha256), and its first loss
    is the source drafter's."""
    from test_published import UPLOAD, hub_env
    from tiny import reference_drafter

    from dflash_train.model.published import fetch_drafter, read_drafter
    from dflash_train.support.hub_server import LoopbackHub

    zlab = reference_drafter(tmp_path / "zlab", tiny_parts[0], LAYERS, 1000, dtype=torch.bfloat16)
    zlab_sha = read_drafter(fetch_drafter(str(zlab))).source.weights_sha256
    with LoopbackHub(tokens={"hf_test"}) as hub:
        env = hub_env(hub, tmp_path)
        commit = subprocess.run([sys.executable, "-c", UPLOAD, "org/general", str(zlab)], env=env, text=True,
                                capture_output=True, check=True).stdout.strip()
        runs = {"hub": ("org/general", env), "speculators": (str(speculators_copy(zlab, tmp_path / "spec")), None)}
        first_losses = []
        for name, (source, run_env) in runs.items():
            run = tmp_path / name
            recipe = write_recipe(tmp_path / f"{name}.yaml", chain_store, run, train={"max_steps": 3},
                                  drafter={"num_layers": None, "init_from": source}, eval={"at_end": False})
            proc = subprocess.run(launch_cmd(recipe, 1), cwd=REPO, capture_output=True, text=True, timeout=300,
                                  env={**(run_env or os.environ), "WANDB_MODE": "disabled",
                                       "MASTER_PORT": str(_free_port())})
            assert proc.returncode == 0, proc.stderr[-3000:]
            started = json.loads((run / "drafter" / "config.json").read_text())["dflash_train"]["fine_tuned_from"]
            assert started["weights_sha256"] == zlab_sha and len(read_metrics(run)) == 3
            first_losses.append(read_metrics(run)[0]["loss"])
        assert started["layout"] == "speculators"
    hub_start = json.loads((tmp_path / "hub" / "drafter" / "config.json").read_text())["dflash_train"]["fine_tuned_from"]
    assert (hub_start["repo"], hub_start["revision"], hub_start["layout"]) == ("org/general", commit, "z-lab")
    assert first_losses[0] == first_losses[1]  # the same weights and taps, read from two layouts


def test_a_warm_start_that_trains_zero_steps_reproduces_the_source_drafters_eval(chain_store, tiny_parts,
                                                                               tiny_target_dir, tmp_path):
    """`train.max_steps: 0` exports the starting drafter as it is: the project's own eval of the export and of the
    published folder it started from agree exactly (tau, every prompt's tau, the tokens drafted)."""
    from tiny import reference_drafter

    from dflash_train.stages.evaluate.command import evaluate
    from dflash_train.stages.evaluate.config import EvalConfig

    zlab = reference_drafter(tmp_path / "zlab", tiny_parts[0], LAYERS, 1000, dtype=torch.bfloat16)
    run = tmp_path / "run"
    proc = launch(write_recipe(tmp_path / "r.yaml", chain_store, run, train={"max_steps": 0},
                               drafter={"num_layers": None, "init_from": str(zlab)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, export = load_file(str(zlab / "model.safetensors")), load_file(str(run / "drafter" / "model.safetensors"))
    assert source.keys() == export.keys() and all(torch.equal(source[k], export[k]) for k in source)
    exported = json.loads((run / "drafter" / "config.json").read_text())
    assert exported["dflash_config"] == json.loads((zlab / "config.json").read_text())["dflash_config"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS[4:]))
    reports = [evaluate(EvalConfig(drafter=str(d), prompts=str(prompts), out="-", target=str(tiny_target_dir),
                                   max_new_tokens=24, dtype="fp32", engine="own", warmup=False))
               for d in (zlab, run / "drafter")]
    source_eval, export_eval = (r.own for r in reports)
    assert source_eval.acceptance() == export_eval.acceptance()  # tau both ways, acceptance, histogram, steps
    assert source_eval.lossless_mismatches == export_eval.lossless_mismatches
    assert [list(r.tau.values()) for r in source_eval.per_prompt] == \
        [list(r.tau.values()) for r in export_eval.per_prompt]
    assert source_eval.num_steps == export_eval.num_steps > 0


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
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what `accelerate launch --num_processes 2` sets, on CPU,
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # before starting a single process
    with pytest.raises(UserError, match="started a single process"):
        make_accelerator(recipe)


# --- the run folder: claimed, resumed only under the same recipe, never written with non-finite weights ----------


def test_a_training_into_an_output_dir_another_run_is_writing_is_refused(chain_store, tmp_path):
    from dflash_train.provenance import OutputClaim

    run = tmp_path / "run"
    running = OutputClaim(run, "train")  # what a training that is still running holds (a file lock)
    proc = launch(write_recipe(tmp_path / "r.yaml", chain_store, run, train={"max_steps": 1}))
    running.release()
    assert proc.returncode != 0
    assert f"train: error: {run} is being written by another run right now" in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in run.iterdir()] == [".dflash-train.lock"]  # no recipe.yaml, metrics or checkpoint


@pytest.mark.slow
def test_resume_with_a_changed_recipe_is_refused_before_anything_is_written(chain_store, tmp_path):
    from dflash_train.stages.train.recipe import load_recipe

    run = tmp_path / "run"
    recipe_file = write_recipe(tmp_path / "r.yaml", chain_store, run, train={"max_steps": 2, "micro_batch_size": 1},
                               checkpoint={"every": 1}, eval={"at_end": True})
    proc = launch(recipe_file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step, checkpoint), = checkpoint_dirs(run)[-1:]
    assert step == 2 and json.loads((checkpoint / STATE_FILE).read_text())["recipe"]["optimizer"]["lr"] == 0.01
    written = {name: (run / name).read_bytes() for name in ("recipe.yaml", "provenance.json", "metrics.jsonl")}

    # what may change: how long it runs, how it logs, validates and checkpoints
    check_resumable(checkpoint, load_recipe(recipe_file, ["train.max_steps=4", "logging.log_every=2",
                                                             "eval.every=1", "checkpoint.keep_last=5"]), run, 1)
    # what may not: anything that changes what the checkpoint's weights, optimizer state or data order mean
    for override, named in (("optimizer.lr=0.02", "optimizer.lr 0.01 -> 0.02"),
                            ("drafter.num_layers=3", "drafter.num_layers 2 -> 3"),
                            ("seed=1", "seed 0 -> 1")):
        with pytest.raises(UserError, match=re.escape(named)):
            check_resumable(checkpoint, load_recipe(recipe_file, [override]), run, 1)
    with pytest.raises(UserError, match=r"processes 1 -> 2"):
        check_resumable(checkpoint, load_recipe(recipe_file), run, 2)

    proc = launch(recipe_file, 1, "optimizer.lr=0.02", "drafter.num_layers=3")
    assert proc.returncode != 0
    line = next(x for x in proc.stderr.splitlines() if x.startswith("train: error:"))
    assert "optimizer.lr 0.01 -> 0.02" in line and "drafter.num_layers 2 -> 3" in line and "nothing was written" in line
    # refused before the checkpoint's state_dict is loaded (accelerate >= 1.16 wraps the child's stderr in a
    # RuntimeError of its own after the line, so the check names torch's load error, not the exception type)
    assert "Error(s) in loading state_dict" not in proc.stderr and "size mismatch" not in proc.stderr
    assert {name: (run / name).read_bytes() for name in written} == written

    # the same command again: the finished run resumes at its last step and takes none; the drafter keeps its loss
    # (it was rewritten with NaN, not JSON, as the final training loss) and its eval at the end (a rerun ran and
    # logged it again)
    loss = json.loads((run / "drafter" / "training_args.json").read_text())["run"]["final_train_loss"]
    assert isinstance(loss, float) and len(read_metrics(run, "eval")) == 1
    assert proc_ok(launch(recipe_file))
    assert json.loads((run / "drafter" / "training_args.json").read_text())["run"]["final_train_loss"] == loss
    assert len(read_metrics(run, "eval")) == 1

    # a checkpoint cut short (a full disk, a copy that stopped) is one line naming it, not torch's traceback
    weights = checkpoint / "pytorch_model" / "mp_rank_00_model_states.pt"  # DeepSpeed's model states
    weights.write_bytes(weights.read_bytes()[:500])
    proc = launch(recipe_file)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("train: error:"))
    assert f"checkpoint {checkpoint} cannot be loaded (" in line and "delete it to resume from an earlier" in line
    # and a trainer state that is not an object
    (checkpoint / STATE_FILE).write_text("[1]")
    with pytest.raises(UserError, match=r"holds a JSON list, not an object: the checkpoint cannot be resumed"):
        check_resumable(checkpoint, load_recipe(recipe_file), run, 1)


@pytest.mark.slow
def test_a_run_whose_weights_turn_non_finite_writes_no_checkpoint_and_no_drafter(chain_store, tmp_path):
    """lr 1e39 is a finite recipe value, but the first update overflows float32: the weights turn infinite. The run
    stops before writing a checkpoint or a drafter of them (it used to export an all-NaN drafter with exit 0)."""
    run = tmp_path / "run"
    proc = launch(write_recipe(tmp_path / "r.yaml", chain_store, run, train={"max_steps": 3, "micro_batch_size": 1},
                               optimizer={"lr": 1.0e39, "warmup_ratio": 0.0}, checkpoint={"every": 1},
                               eval={"at_end": False}))
    assert proc.returncode != 0
    line = next(x for x in proc.stderr.splitlines() if x.startswith("train: error:"))
    assert "step 1: the drafter's weights hold NaN or inf" in line and "no checkpoint was written" in line, line
    assert checkpoint_dirs(run) == [] and not (run / "drafter").exists()


def test_a_run_may_resume_with_the_states_computed_instead_of_stored(tmp_path):
    """data.hidden_states changes the states only by rounding (the same target's states of the same tokens), so it
    may change on resume (a run that runs out of disk goes on online); the stores themselves may not."""
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    recipe.data.stores = ["data/store/a"]
    checkpoint = tmp_path / "checkpoints" / "step-0000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 2, "world_size": 1, "recipe": recipe.to_dict()}))
    recipe.data.hidden_states = "online"
    check_resumable(checkpoint, recipe, tmp_path, 1)
    recipe.data.stores = ["data/store/a-tokens"]
    with pytest.raises(UserError, match=r'data.stores.0 "data/store/a" -> "data/store/a-tokens"'):
        check_resumable(checkpoint, recipe, tmp_path, 1)


def test_nonfinite_parameters_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert nonfinite_parameters(model) == []
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    assert nonfinite_parameters(model) == ["1.bias"]


def test_training_refuses_a_store_with_a_corrupted_shard(chain_store, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(chain_store, copy)
    check_store_hashes([str(copy)])  # sound: hashed once, then remembered
    shard = next(copy.glob("shard-r000-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x40  # a flip in the states that stays finite: it would have been trained on
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"shard {shard.name} is corrupted"):
        check_store_hashes([str(copy)])


def test_store_from_a_fine_tune_of_the_target_is_refused(chain_store, tiny_target_dir, tmp_path):
    """Same config, tokenizer and chat template, other weights: a store of one trains against the other no more."""
    import shutil

    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "fine-tuned"
    shutil.copytree(tiny_target_dir, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    key = next(k for k in weights if k.endswith("layers.3.mlp.up_proj.weight"))
    weights[key] = weights[key] * 1.01
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"its target's weights differs"):
        check_store_against_target(StoreSet([str(chain_store)]), str(tuned))
    check_store_against_target(StoreSet([str(chain_store)]), str(tiny_target_dir))  # the store's own target


def direct_train_cmd(recipe: Path) -> list[str]:
    """train.py without a launcher: one process, its own exit code and error line."""
    return [sys.executable, str(REPO / "train.py"), str(recipe)]


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_save_is_one_line(chain_store, tmp_path):
    """A real full disk (a 400 KiB tmpfs holds the run's records but not its first checkpoint): torch's writer fails
    (`basic_ios::clear`); the run says which checkpoint could not be written, and why, in one line."""
    from sandbox import run_with_mount

    disk = tmp_path / "disk"
    recipe = write_recipe(tmp_path / "r.yaml", chain_store, disk / "run", train={"max_steps": 2, "micro_batch_size": 1},
                          checkpoint={"every": 1}, eval={"at_end": False})
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(_free_port())}
    proc = run_with_mount(direct_train_cmd(recipe), disk, size="400k", cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train: error: cannot write {disk / 'run' / 'checkpoints' / 'step-0000001.tmp'}: disk full")
    assert "Free space and rerun the same command" in last


def test_read_only_run_folder_is_one_line(chain_store, tmp_path):
    from sandbox import run_with_mount

    ro = tmp_path / "ro"
    recipe = write_recipe(tmp_path / "r.yaml", chain_store, ro, train={"max_steps": 1})
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(_free_port())}
    proc = run_with_mount(direct_train_cmd(recipe), ro, read_only=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"train: error: cannot write {ro}: read-only file system. Choose a writable folder"


def test_a_user_error_is_one_line_exit_2_and_accelerate_launch_turns_the_exit_into_1(tmp_path):
    """What the launchers do with the stage's exit 2 (README, "User errors under accelerate launch"): train.py alone
    exits 2 with the one line; accelerate's single-process launcher prints the same line, then (without -q) a
    CalledProcessError traceback of its own, and exits 1 whatever the child's code."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("data: {stores: [s]}\noptimizer: {lr: .inf}\n")
    line = f"train: error: recipe {recipe}: key 'optimizer.lr' must be a finite number, got inf"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    direct = subprocess.run(direct_train_cmd(recipe), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert direct.returncode == 2 and direct.stderr.strip() == line, direct.stderr
    quiet = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                            str(REPO / "train.py"), str(recipe)], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert quiet.returncode == 1 and quiet.stderr.strip() == line, quiet.stderr


def test_a_run_with_a_replay_store_records_how_many_of_its_samples_trained(chain_store, tiny_target, tmp_path):
    old = capture_tiny_store(tiny_target, tmp_path / "old", num_samples=3, seed=1, id_prefix="r")
    recipe = write_recipe(tmp_path / "r.yaml", chain_store, tmp_path / "run", train={"max_steps": 1},
                          data={"replay_stores": [str(old)], "replay_samples": 2})
    proc = subprocess.run(direct_train_cmd(recipe), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled", "MASTER_PORT": str(_free_port())})
    assert proc_ok(proc) and "on 6 samples" in proc.stdout
    data = json.loads((tmp_path / "run" / "drafter" / "training_args.json").read_text())["data"]
    assert [s["replay"] for s in data["stores"]] == [False, True]
    assert (data["replay_samples_trained"], data["replay_samples_total"]) == (2, 3)
