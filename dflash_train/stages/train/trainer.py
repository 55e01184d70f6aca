"""The training stage: fit a DFlash drafter to capture stores, driven by a recipe.

    accelerate launch train.py recipes/NAME.yaml [key=value ...]       (or `dflash-train train RECIPE ...`)

`DFlashTrainer` is the recipe, read top to bottom: setup, the loop (train), one optimizer step (train_step),
validation, checkpoints and the final drafter; the helpers it calls follow it. The data it reads (stores, rows,
batches, the held-out split) is dflash_train/stages/train/data.py; the loss is dflash_train/objective.py; the drafter is
dflash_train/model/.

Runs under accelerate with DeepSpeed ZeRO-2 by default (ZeRO-3 or plain DDP by recipe), bf16, gradient
accumulation and optional gradient checkpointing. The target's embedding and LM head are plain frozen tensors
held next to the drafter, never inside the module DeepSpeed wraps: they get no gradient, no optimizer state
and no ZeRO partitioning. With `data.hidden_states: online` the whole target is held the same way, one replica per
rank, and computes the tapped states of every micro batch (data.OnlineStates) instead of reading them from the
store. Every step is a pure function of (recipe, step): the data order comes from a
per-epoch permutation and the anchors from a generator seeded with (seed, step, micro step, rank), so a run
resumed from a checkpoint reproduces the loss sequence of an uninterrupted one.

Run folder (`output_dir`):
  checkpoints/step-NNNNNNN/   accelerate/DeepSpeed state (model, optimizer, scheduler, RNG) + trainer_state.json
                              (with the recipe it was written under)
  drafter/                    the final drafter (public DFlash format: config.json names the target) and
                              training_args.json
  metrics.jsonl               one row per logged step and per eval
  recipe.yaml, provenance.json
  .dflash-train.lock          held by the run writing the folder: a second training into it is refused

Before anything is written, rank 0 claims the folder (a folder of another stage, or a run in progress, is refused)
and compares the recipe with the checkpoint it would resume (RESUMABLE_KEYS may change; anything else is refused);
then the ranks re-hash the stores' shards between them (store.check_hashes, cached). A checkpoint or drafter is never written with non-finite
weights: the run stops with an error naming the newest good checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from dflash_train import objective as obj
from dflash_train.stages.train.data import (OnlineStates, StoreSet, anchor_generator, collate, context_scale,
                                            prepare_data)
from dflash_train.errors import (CommandParser, UserError, decided_by_rank0, in_brief, run_as_command, write_error,
                                 writing)
from dflash_train.model.masks import resolve_attention
from dflash_train.provenance import (OutputClaim, complete_output, config_differences, shown_pair, start_output,
                                     write_json_atomic, write_provenance)
from dflash_train.stages.train.recipe import Recipe, load_recipe
from dflash_train.target import Features, check_fits

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
STAGE = "train"
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("the checkpoints already saved in the run folder are kept; rerun the same command to resume from the "
               "newest (checkpoint.resume: auto, the default)")
# Recipe keys that may change when a run resumes: how it is named, logged, validated, checkpointed and published,
# how long it runs (the schedule then follows the new length, and the run says so), and settings that change speed
# or memory but not the result (threads, gradient checkpointing, the LM-head chunk). Any other change (data, drafter,
# objective, optimizer, batch, precision, DeepSpeed, seed) would make the checkpoint's weights, optimizer state or
# data order mean something else, and is refused before anything is written.
# data.hidden_states (stored or online) may change too: both are the states of the same tokens from the same target
# (its identity and tap ids are checked against the store either way), and they differ only by rounding: the storage
# dtype (bf16, or fp8 with its per-token scale) and the order of the sums in a differently shaped forward. Stores of
# bf16 and of fp8 states already train together as the same data; a run that runs out of disk may go on online.
RESUMABLE_KEYS = ("name", "output_dir", "license", "logging", "eval", "checkpoint", "push", "data.eval_samples",
                  "data.hidden_states", "train.max_steps", "train.epochs", "train.time_budget_s",
                  "train.max_bad_steps", "train.cpu_threads", "train.gradient_checkpointing",
                  "objective.head_chunk_tokens")


# --- the recipe -----------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Where a run is; every checkpoint's trainer_state.json holds it, and a resumed run starts from it."""
    step: int = 0  # optimizer steps done
    bad_in_a_row: int = 0  # steps skipped for a non-finite loss, in a row up to `step`
    bad_total: int = 0


@dataclass
class StepStats:
    """What one optimizer step measured, summed over its micro steps (and, after `summed_over_ranks`, over ranks)."""
    loss_sum: torch.Tensor  # float64 []: the finite micro-step losses (each a weighted mean), summed
    micro_steps: torch.Tensor  # float64 []
    tokens: torch.Tensor  # float64 []: real tokens read (padding excluded)
    correct: torch.Tensor  # float64 [B]: correct greedy predictions per block slot
    counted: torch.Tensor  # float64 [B]: supervised predictions per block slot
    skipped: bool = False  # a non-finite loss (on any rank): no optimizer step was taken
    grad_norm: torch.Tensor | float | None = None  # as clip_grad_norm_ returns it (None when skipped)
    kl: torch.Tensor | None = None  # the last micro batch's KL to the target's top-k (this rank's), or None
    lr: float = 0.0  # the learning rate the step used
    seconds: float = 0.0

    @classmethod
    def zeros(cls, block_size: int) -> "StepStats":
        zero = torch.zeros((), dtype=torch.float64)
        return cls(zero.clone(), zero.clone(), zero.clone(), torch.zeros(block_size, dtype=torch.float64),
                   torch.zeros(block_size, dtype=torch.float64))

    SUMMED = ("loss_sum", "micro_steps", "tokens", "correct", "counted")

    def summed_over_ranks(self, accelerator) -> "StepStats":
        """The counters summed over all ranks, in one all-reduce."""
        parts = [getattr(self, name).reshape(-1) for name in self.SUMMED]
        total = accelerator.reduce(torch.cat(parts).to(accelerator.device), reduction="sum").cpu()
        summed = dict(zip(self.SUMMED, total.split([p.numel() for p in parts])))
        return dataclasses.replace(self, **{k: v.reshape(getattr(self, k).shape) for k, v in summed.items()})

    @property
    def loss(self) -> float:
        """Mean micro-step loss; NaN for a skipped step."""
        return math.nan if self.skipped else float(self.loss_sum / self.micro_steps)

    def accuracy(self) -> list[float | None]:
        """Greedy accuracy of block slots 1..B-1 (slot 0, the anchor, is not predicted)."""
        return [round(float(c / n), 4) if n else None for c, n in zip(self.correct[1:], self.counted[1:])]


class DFlashTrainer:
    """The training recipe. `setup` builds every part from the recipe (accelerator, data, drafter, the target's
    frozen embedding and LM head, optimizer, schedule) and resumes from the newest checkpoint; `train` runs the
    loop; one optimizer step is `train_step`; `validate` measures the held-out samples; `save_checkpoint` and
    `save_drafter` write the run folder; `cleanup` ends the process group."""

    def __init__(self, recipe: Recipe, recipe_path: str | None = None, overrides: tuple[str, ...] = ()):
        self.recipe, self.recipe_path, self.overrides = recipe, recipe_path, tuple(overrides)
        self.run_dir = Path(recipe.output_dir)
        self.started = time.time()
        self.last_loss = math.nan
        self.last_eval: dict[str, Any] = {}
        self.last_checkpoint_step: int | None = None
        self.claim: OutputClaim | None = None
        self.online: OnlineStates | None = None  # data.hidden_states: online (setup loads the target)

    # -- setup ----------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        recipe = self.recipe
        warnings.filterwarnings("ignore", message=r".*`torch.distributed.\w+` is deprecated")  # DeepSpeed internals
        self.accelerator = accelerator = make_accelerator(recipe)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.main, self.device = accelerator.is_main_process, accelerator.device
        self.precision = train_precision(recipe)
        self.claim = decided_by_rank0(self.claim_run_folder, self.rank, self.world)
        try:  # every rank hashes its share of the shards (a large store would outlast a collective's timeout)
            check_store_hashes([*recipe.data.stores, *([recipe.data.eval_store] if recipe.data.eval_store else [])],
                               self.rank, self.world)
        except UserError:
            if self.claim is not None:
                self.claim.release(failed=True)
            raise
        if self.main:
            self.write_run_records()
        accelerator.wait_for_everyone()

        self.data = prepare_data(recipe, self.world)
        self.plan = self.data.plan
        self.total_steps = recipe.train.max_steps if recipe.train.max_steps is not None else \
            max(1, int(recipe.train.epochs * self.plan.steps_per_epoch))
        self.target_name = target_name = recipe.drafter.target or self.data.stores.manifest["target"]["name"]
        check_store_against_target(self.data.stores, target_name)
        self.online = self.load_online_target(target_name) if recipe.data.hidden_states == "online" else None
        drafter, self.drafter_config = build_drafter(recipe, self.data.stores, target_name, self.data.train_indices,
                                                     self.online)
        if recipe.train.gradient_checkpointing:
            drafter.gradient_checkpointing_enable()
        self.embed, self.head = self.load_target_parts(target_name)

        opt = recipe.optimizer
        # fused: one kernel per step instead of a dozen passes per tensor (4x faster on CPU; CUDA has it too)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                      weight_decay=opt.weight_decay, fused=True)
        self.model, self.optimizer = accelerator.prepare(drafter, optimizer)
        self.clock = TrainClock(recipe.train.time_budget_s)
        schedule = functools.partial(lr_factor, total_steps=self.total_steps, warmup_ratio=opt.warmup_ratio,
                                     schedule=opt.schedule, min_ratio=opt.min_lr_ratio, decay_ratio=opt.decay_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: schedule(s, progress=self.clock.progress_at(s, self.total_steps)))
        accelerator.register_for_checkpointing(self.scheduler)
        self.core = accelerator.unwrap_model(self.model)  # the plain DFlashDraftModel (validation, export)
        self.attention = resolve_attention(recipe.objective.attention, self.device)
        uses_deepspeed = recipe.train.deepspeed is not None
        self.zero_stage = deepspeed_config(recipe).get("zero_optimization", {}).get("stage", 0) \
            if uses_deepspeed else 0

        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main)
        self.state, self.resumed_from = self.resume()
        self.metrics.wandb_run = start_wandb(recipe, self.run_dir, self.main)
        if self.main:
            n_params = sum(p.numel() for p in self.core.parameters())
            print(f"training {n_params / 1e6:.2f}M drafter parameters on {len(self.data.train_indices)} samples "
                  f"({len(self.plan.rows)} rows, {self.plan.steps_per_epoch} steps/epoch), {self.total_steps} steps"
                  + (f" or {recipe.train.time_budget_s:g} s of training" if recipe.train.time_budget_s else "")
                  + f", {self.world} process(es) on {self.device.type}, attention={self.attention}, "
                  f"deepspeed={recipe.train.deepspeed}, hidden states {self.state_source()['hidden_states']}",
                  flush=True)

    def claim_run_folder(self) -> OutputClaim:
        """Rank 0, before anything is written: claim and lock the run folder, and refuse a resume whose recipe
        changed what matters."""
        recipe = self.recipe
        claim = OutputClaim(self.run_dir, STAGE, legacy=is_run_folder)
        try:
            checkpoint = find_resume_checkpoint(recipe, self.run_dir)
            if checkpoint is not None:
                check_resumable(checkpoint, recipe, self.run_dir, self.world)
        except BaseException:
            claim.release(failed=True)
            raise
        return claim

    def write_run_records(self) -> None:
        """Main process, once the inputs are checked: recipe.yaml and provenance.json of the run folder."""
        recipe = self.recipe
        (self.run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        write_provenance(self.run_dir, config=recipe.to_dict(), stage=STAGE, recipe_file=self.recipe_path,
                         overrides=list(self.overrides), world_size=self.world, precision=self.precision.as_dict())
        print(f"train: compute dtype {self.precision.describe()}", flush=True)

    def load_online_target(self, target_name: str) -> OnlineStates:
        """data.hidden_states: online: this rank's own replica of the whole target, frozen (eval mode, no gradients)
        in the run's compute dtype on this rank's device, held next to the drafter like the embedding and LM head
        (under ZeRO-3, transformers would build it partitioned by DeepSpeed's zero.Init: it is loaded with DeepSpeed's
        config hidden from transformers, then the config is restored)."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

        from dflash_train.target import load_target

        plugin = self.accelerator.state.deepspeed_plugin
        zero3 = plugin is not None and is_deepspeed_zero3_enabled()
        if zero3:
            unset_hf_deepspeed_config()
        try:
            target = load_target(target_name, dtype=self.precision.dtype, device=self.device)
        finally:
            if zero3:
                plugin.set_deepspeed_weakref()
        return OnlineStates(target, self.data.stores.manifest["target_layer_ids"], self.recipe.data.max_length)

    def state_source(self) -> dict[str, Any]:
        """Where the drafter's input states come from, as the run records it (training_args.json, provenance)."""
        if self.online is None:
            return {"hidden_states": "stored"}
        return {"hidden_states": "online", "computed_by": self.target_name, "compute_dtype": self.precision.name}

    def load_target_parts(self, target_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and LM head: plain frozen tensors next to the drafter, never inside the module
        DeepSpeed wraps (no gradient, no optimizer state, no ZeRO partitioning)."""
        from dflash_train.target import load_embedding_and_head

        embed, head = load_embedding_and_head(target_name, dtype=self.precision.dtype)
        tied = head is embed
        embed = embed.to(self.device)
        head = embed if tied else head.to(self.device)
        config = self.drafter_config
        if head.shape[1] != config.hidden_size or embed.shape[0] <= config.mask_token_id:
            raise UserError(f"target {target_name!r}: embedding/LM head shapes {tuple(embed.shape)}/"
                            f"{tuple(head.shape)} do not fit the drafter (hidden {config.hidden_size})")
        return embed, head

    def resume(self) -> tuple[TrainState, Path | None]:
        """The state of the newest checkpoint (checkpoint.resume), its model/optimizer/scheduler/RNG loaded; a
        fresh state (and a fresh metrics.jsonl) otherwise."""
        resume_from = find_resume_checkpoint(self.recipe, self.run_dir)
        if resume_from is None:
            if self.main and self.metrics.path.exists():
                self.metrics.path.unlink()
            return TrainState(), None
        try:
            self.accelerator.load_state(str(resume_from))
        except Exception as err:  # truncated or overwritten files: safetensors', torch's or DeepSpeed's own errors
            raise UserError(f"checkpoint {resume_from} cannot be loaded ({in_brief(err)}): delete it to resume from "
                            f"an earlier one, or set checkpoint.resume: never to start over") from None
        saved = json.loads((resume_from / STATE_FILE).read_text())
        state = TrainState(step=saved["step"], bad_in_a_row=saved["bad_in_a_row"], bad_total=saved["bad_total"])
        self.clock.spent_s = float(saved.get("train_time_s", 0.0))
        if saved.get("last_loss") is not None:  # a rerun of a finished run takes no step: its loss is the saved one
            self.last_loss = float(saved["last_loss"])
        self.last_eval = saved.get("last_eval") or {}  # and its eval: not run (and logged) a second time
        if saved.get("total_steps") != self.total_steps and self.main:
            print(f"note: the checkpoint was written for {saved.get('total_steps')} total steps, this run has "
                  f"{self.total_steps}; the learning-rate schedule follows this run", flush=True)
        self.metrics.truncate_after(state.step)
        if self.main:
            print(f"resuming from {resume_from} at step {state.step}", flush=True)
        self.last_checkpoint_step = state.step
        return state, resume_from

    # -- the loop -------------------------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Optimizer steps until max steps (or the time budget); validation and checkpoints on their schedule;
        then the final drafter. Returns the run summary."""
        from tqdm import tqdm

        recipe, state = self.recipe, self.state
        bar = tqdm(total=self.total_steps, initial=state.step, desc="train", dynamic_ncols=True,
                   disable=not (self.main and recipe.logging.progress_bar))
        self.model.train()
        self.clock.start()
        while state.step < self.total_steps and not self.clock.expired:
            stats = self.train_step(state.step)
            state.step += 1
            bar.update(1)
            state.bad_in_a_row = state.bad_in_a_row + 1 if stats.skipped else 0
            state.bad_total += int(stats.skipped)
            self.last_loss = stats.loss
            if state.step % recipe.logging.log_every == 0 or state.step == self.total_steps:
                self.log_step(stats)
                bar.set_postfix(loss=f"{self.last_loss:.3f}", acc1=stats.accuracy()[0],
                                sim_tau=self.last_eval.get("eval_sim_tau"))
            if state.bad_in_a_row >= recipe.train.max_bad_steps:
                bar.close()
                self.stop_diverged()
            done = state.step >= self.total_steps or self.clock.expired
            self.clock.pause()  # validation and checkpoints do not count against the training time budget
            if self.data.eval_samples and ((recipe.eval.every and state.step % recipe.eval.every == 0)
                                           or (recipe.eval.at_end and done)):
                self.validate()
                bar.set_postfix(loss=f"{self.last_loss:.3f}", sim_tau=self.last_eval["eval_sim_tau"])
            if state.step % recipe.checkpoint.every == 0 or done:
                self.save_checkpoint()
            self.clock.start()
        self.clock.pause()
        bar.close()
        if recipe.eval.at_end and self.data.eval_samples and not self.last_eval:
            self.validate()  # a run of zero steps (train.max_steps: 0) measures the drafter it starts from
        return self.save_drafter()

    def train_step(self, step: int) -> StepStats:
        """One optimizer step: grad_accum_steps micro batches of this rank's rows, anchors drawn from a generator
        keyed on (seed, step, micro step, rank). A non-finite loss on any rank skips the step on all of them."""
        recipe, plan, accelerator = self.recipe, self.plan, self.accelerator
        B = recipe.drafter.block_size
        stats = StepStats.zeros(B)
        stats.lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.time()
        for micro in range(plan.grad_accum):
            rows = [[self.data.stores[i] for i in row] for row in plan.rows_for(step, micro, self.rank)]
            if self.online is not None:
                rows = self.online.add(rows)
            batch = collate(rows, recipe.data.max_length)
            num_tokens = int(batch.pop("num_tokens"))
            batch = {k: v.to(self.device) for k, v in batch.items()}
            blocks = obj.sample_anchors(batch["loss_mask"], recipe.objective.num_anchors, B,
                                        anchor_generator(recipe.seed, step, micro, self.rank), batch["doc_start"],
                                        anchor_weights(batch, recipe.objective.copy_anchor_weight))
            if in_context_warmup(recipe, step, self.total_steps, self.clock):
                blocks = dataclasses.replace(blocks, context_window=recipe.objective.context_warmup_window)
            with accelerator.accumulate(self.model):
                out = obj.dflash_loss(self.model, self.embed, self.head, batch, blocks,
                                      mask_token_id=self.drafter_config.mask_token_id, gamma=recipe.decay_gamma,
                                      attention=self.attention, head_chunk_tokens=recipe.objective.head_chunk_tokens,
                                      soft_label_weight=recipe.objective.soft_label_weight)
                finite = torch.tensor(float(torch.isfinite(out.loss.detach())), device=self.device)
                finite = accelerator.reduce(finite, reduction="sum") if self.world > 1 else finite
                loss = out.loss
                if finite < self.world:
                    stats.skipped = True
                    # Make every gradient non-finite on purpose: DeepSpeed (check_grad_overflow) then skips the
                    # optimizer step and clears the gradients on all ranks, as the code below does without it.
                    loss = out.loss * float("nan")
                accelerator.backward(loss)
                if accelerator.sync_gradients and not stats.skipped:
                    # DeepSpeed clipped inside backward's engine.step(); this only reads its norm
                    stats.grad_norm = accelerator.clip_grad_norm_(self.model.parameters(),
                                                                  recipe.optimizer.grad_clip or float("inf"))
                if recipe.train.deepspeed is not None or not stats.skipped:
                    self.optimizer.step()  # under DeepSpeed a no-op wrapper: the engine stepped (or skipped) already
                self.optimizer.zero_grad(set_to_none=True)
            if not stats.skipped:
                stats.loss_sum += float(out.loss.detach())
            stats.micro_steps += 1
            stats.tokens += num_tokens
            stats.correct += out.correct.double().cpu()
            stats.counted += out.counted.double().cpu()
        stats.kl = out.kl
        self.scheduler.step()
        if self.world > 1:
            stats = stats.summed_over_ranks(accelerator)
        stats.seconds = time.time() - t0
        return stats

    def log_step(self, stats: StepStats) -> None:
        gn = stats.grad_norm.item() if isinstance(stats.grad_norm, torch.Tensor) else stats.grad_norm
        acc = stats.accuracy()
        self.metrics.log({
            "kind": "train", "step": self.state.step, "epoch": round(self.state.step / self.plan.steps_per_epoch, 4),
            "loss": None if stats.skipped else stats.loss, "acc": acc, "acc_1": acc[0], "lr": stats.lr,
            "kl": None if stats.kl is None else float(stats.kl),
            "grad_norm": None if gn is None or (isinstance(gn, float) and not math.isfinite(gn)) else gn,
            "tokens_per_s": float(stats.tokens) / stats.seconds, "skipped": stats.skipped,
            "bad_steps": self.state.bad_total, "time": round(time.time() - self.started, 2),
            "train_time": round(self.clock.elapsed, 2)})

    def stop_diverged(self) -> None:
        newest = checkpoint_dirs(self.run_dir)
        where = f"{newest[-1][1]} (step {newest[-1][0]})" if newest else "none yet"
        raise UserError(f"{self.state.bad_in_a_row} optimizer steps in a row (up to step {self.state.step}) had a "
                        f"non-finite loss: training diverged and was stopped. Newest checkpoint: {where}. Lower "
                        f"optimizer.lr, check the store for bad samples, or raise train.max_bad_steps")

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Held-out loss (anchors drawn with a fixed seed) and simulated acceptance length `eval_sim_tau` (a block
        at every anchor, objective.simulated_acceptance, walked as greedy decoding walks the answer:
        objective.decoded_steps; per sample the mean over its steps, then over samples, as the eval counts tau),
        logged as an "eval" row of metrics.jsonl with `eval_anchor_tau`, the mean over every anchor (this
        project's eval_sim_tau before 2026-12-05, which overstates tau where easy and hard stretches alternate)."""
        drafter, recipe = self.core, self.recipe
        samples = self.data.eval_samples
        was_training = drafter.training
        drafter.eval()
        B = recipe.drafter.block_size
        mask_id = self.drafter_config.mask_token_id
        loss_sum, weight_sum = 0.0, 0.0
        correct, counted = torch.zeros(B), torch.zeros(B)
        lengths, walked = [], []
        for i, sample in enumerate(samples):
            rows = [[sample]] if self.online is None else self.online.add([[sample]])
            batch = {k: v.to(self.device) for k, v in collate(rows, recipe.data.max_length).items()}
            blocks = obj.sample_anchors(batch["loss_mask"], recipe.objective.num_anchors, B,
                                        anchor_generator(recipe.seed, -1, i, 0))
            out = obj.dflash_loss(drafter, self.embed, self.head, batch, blocks, mask_token_id=mask_id,
                                  gamma=recipe.decay_gamma, attention=self.attention,
                                  head_chunk_tokens=recipe.objective.head_chunk_tokens)
            w = float(out.weight_sum)
            if w > 0:
                loss_sum += float(out.loss) * w
                weight_sum += w
            correct += out.correct.cpu()
            counted += out.counted.cpu()
            trimmed = {k: batch[k][0] for k in ("input_ids", "loss_mask", "hidden_states")}
            lengths.append(obj.simulated_acceptance(drafter, self.embed, self.head, trimmed, B, mask_id,
                                                    attention=self.attention))
            if steps := obj.decoded_steps(trimmed, lengths[-1].tolist(), B):
                walked.append(sum(steps) / len(steps))
        drafter.train(was_training)
        all_lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
        result = {
            "eval_loss": loss_sum / weight_sum if weight_sum else math.nan,
            "eval_sim_tau": sum(walked) / len(walked) if walked else math.nan,
            "eval_anchor_tau": float(all_lengths.float().mean()) if all_lengths.numel() else math.nan,
            "eval_acc": [round(float(c / n), 4) if n else None for c, n in zip(correct[1:], counted[1:])],
            "eval_anchors": int(all_lengths.numel()),
            "eval_samples": len(samples),
        }
        self.last_eval = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
        self.metrics.log({"kind": "eval", "step": self.state.step, **self.last_eval,
                          "time": round(time.time() - self.started, 2), "train_time": round(self.clock.elapsed, 2)})
        return result

    # -- outputs --------------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: the accelerate/DeepSpeed state and trainer_state.json (TrainState, the schedule's
        length, the data position and every rank's parameter digest)."""
        step, plan = self.state.step, self.plan
        self.check_weights_finite("checkpoint")
        digests = check_replicas(self.accelerator, self.model, step, self.zero_stage)
        trainer_state = {
            **dataclasses.asdict(self.state), "total_steps": self.total_steps, "epoch": step / plan.steps_per_epoch,
            "world_size": self.world, "train_time_s": self.clock.elapsed, "last_loss": self.final_loss(),
            "last_eval": self.last_eval,
            "data_position": {"epoch": step // plan.steps_per_epoch, "step_in_epoch": step % plan.steps_per_epoch},
            "rank_parameter_digests": digests, "recipe": self.recipe.to_dict()}
        path = save_checkpoint(self.accelerator, self.run_dir, step, trainer_state, self.recipe.checkpoint.keep_last)
        self.last_checkpoint_step = step
        return path

    def final_loss(self) -> float | None:
        """The last step's training loss; None before any step (NaN is not JSON)."""
        return None if math.isnan(self.last_loss) else self.last_loss

    def save_drafter(self) -> dict[str, Any]:
        """drafter/: the final drafter in the public DFlash format, in the target's dtype (what engines serve the
        pair in, whatever precision trained it; all ranks gather the weights under ZeRO-3), with
        training_args.json and provenance.json. Returns the run summary."""
        state = self.state
        self.check_weights_finite("drafter")
        state_dict = self.accelerator.get_state_dict(self.model)
        summary = {"steps": state.step, "final_train_loss": self.final_loss(),
                   "train_time_s": round(self.clock.elapsed, 1),
                   **{f"final_{k}": v for k, v in self.last_eval.items()},
                   "bad_steps": state.bad_total, "wall_time_s": round(time.time() - self.started, 1),
                   "world_size": self.world, "device": self.device.type,
                   "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                   "last_checkpoint_step": self.last_checkpoint_step}
        if self.main:
            out = self.run_dir / "drafter"
            with writing(out, "The drafter folder stays marked INCOMPLETE and the final checkpoint is kept: free "
                              "space and rerun the same command"):
                self.export(out, state_dict, summary)
            wandb_run = self.metrics.wandb_run
            if wandb_run is not None:
                wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
                wandb_run.finish()
            print(f"done: {state.step} steps in {summary['wall_time_s']} s; final loss {self.last_loss:.4f}"
                  + (f", simulated tau {self.last_eval.get('eval_sim_tau')}" if self.last_eval else "")
                  + f"; drafter in {self.run_dir / 'drafter'}", flush=True)
        return summary

    def export(self, out: Path, state_dict: dict[str, torch.Tensor], summary: dict[str, Any]) -> None:
        """Main process: the drafter folder (weights in the target's dtype), training_args.json, provenance.json."""
        from dflash_train.model.checkpoint import create_drafter, save_drafter
        from dflash_train.target import checkpoint_dtype

        recipe = self.recipe
        start_output(out, STAGE)
        final = create_drafter(self.drafter_config)
        final.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()}, strict=True)
        final.set_context_scale(self.core.context_scale)  # save_drafter folds it into fc
        dtype = checkpoint_dtype(self.target_name) or self.precision.dtype
        save_drafter(final.to(dtype), self.drafter_config, out)
        recorded = {**summary, "precision": self.precision.as_dict(), **self.state_source()}
        write_json_atomic(out / "training_args.json",
                          {"recipe": recipe.to_dict(), "data": self.data.stores.summary(), "run": recorded})
        write_provenance(out, config=recipe.to_dict(), stage=STAGE, run=recorded, stores=self.data.stores.folders)
        complete_output(out)

    def check_weights_finite(self, what: str) -> None:
        """Every rank: stop (UserError on all of them) before a checkpoint or the drafter is written with NaN or inf
        weights; the checkpoints already written are kept, and the message names the newest."""
        bad = nonfinite_parameters(self.core)
        count = torch.tensor(float(len(bad)), device=self.device)
        if self.world > 1:
            count = self.accelerator.reduce(count, reduction="sum")
        if float(count) == 0:
            return
        newest = checkpoint_dirs(self.run_dir)
        where = f"{newest[-1][1]} (step {newest[-1][0]})" if newest else "none (no checkpoint was written yet)"
        named = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
        raise UserError(f"step {self.state.step}: the drafter's weights hold NaN or inf{named}: training diverged, so "
                        f"no {what} was written. Newest good checkpoint: {where}. Lower optimizer.lr (this run: "
                        f"{self.recipe.optimizer.lr:g}) or optimizer.grad_clip and train again")

    def cleanup(self) -> None:
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        if self.claim is not None:
            self.claim.release()
            self.claim = None


def train(recipe: Recipe, recipe_path: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    trainer = DFlashTrainer(recipe, recipe_path, overrides)
    try:
        trainer.setup()
        summary = trainer.train()
        trainer.cleanup()
    finally:
        if trainer.claim is not None:
            trainer.claim.release()
    return summary


# --- schedule -------------------------------------------------------------------------------------------------


def lr_factor(step: int, total_steps: int, warmup_ratio: float, schedule: str, min_ratio: float,
              decay_ratio: float = 0.2, progress: float | None = None) -> float:
    """Linear warmup over warmup_ratio of the run, then cosine to min_ratio, constant, or wsd (constant, then a
    linear decay to min_ratio over the last decay_ratio of the run). The run's position is step / total_steps, or
    `progress` (the fraction of a time budget used) when given."""
    if progress is None:
        warmup = int(math.ceil(warmup_ratio * total_steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = step / max(1, total_steps)
        after = (step - warmup) / max(1, total_steps - warmup)
    else:
        progress = min(1.0, max(0.0, progress))
        if progress < warmup_ratio:
            return max(progress / warmup_ratio, 1.0 / max(1, total_steps))
        after = (progress - warmup_ratio) / max(1e-9, 1 - warmup_ratio)
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = 1.0 - decay_ratio
        if progress <= start:
            return 1.0
        return min_ratio + (1 - min_ratio) * max(0.0, 1 - (progress - start) / decay_ratio)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, after)))


def anchor_weights(batch: dict, copy_weight: float) -> torch.Tensor | None:
    """Anchor sampling weights [b, S]: copy_weight where the context holds the anchor's last two tokens already
    (objective.repeats_context), 1 elsewhere; None (uniform) when copy_weight is 1."""
    if copy_weight == 1.0:
        return None
    repeats = obj.repeats_context(batch["input_ids"], batch["doc_start"])
    return 1.0 + (copy_weight - 1.0) * repeats.float()


def in_context_warmup(recipe: Recipe, step: int, total_steps: int, clock: "TrainClock") -> bool:
    """Whether this step's blocks see only the last context_warmup_window context positions (the first
    objective.context_warmup_ratio of the run)."""
    progress = clock.progress_at(step, total_steps)
    return (progress if progress is not None else step / max(1, total_steps)) < recipe.objective.context_warmup_ratio


class TrainClock:
    """Training time (evals and checkpoints excluded) against an optional budget; survives resume."""

    def __init__(self, budget_s: float | None, already_s: float = 0.0):
        self.budget_s = budget_s
        self.spent_s = already_s
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.time()

    def pause(self) -> None:
        if self._since is not None:
            self.spent_s += time.time() - self._since
            self._since = None

    @property
    def elapsed(self) -> float:
        return self.spent_s + (time.time() - self._since if self._since is not None else 0.0)

    def progress_at(self, step: int, total_steps: int) -> float | None:
        """Where a budgeted run stands: the larger of the time and the step fraction, since it ends at whichever
        limit comes first (so the schedule decays either way); None without a budget (the schedule counts steps)."""
        if self.budget_s is None:
            return None
        return max(self.elapsed / self.budget_s, step / max(1, total_steps))

    @property
    def expired(self) -> bool:
        return self.budget_s is not None and self.elapsed >= self.budget_s


# --- setup ------------------------------------------------------------------------------------------------------


def train_precision(recipe: Recipe):
    """The compute precision of this run: the recipe's train.precision, `auto` resolved for the device it trains on."""
    from dflash_train.device import resolve_precision

    device = "cuda" if recipe.train.device != "cpu" and torch.cuda.is_available() else "cpu"
    return resolve_precision(recipe.train.precision, device)


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe's DeepSpeed JSON with every "auto" filled from the recipe."""
    path = Path(recipe.train.deepspeed)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    t = recipe.train
    cfg["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    cfg["gradient_accumulation_steps"] = t.grad_accum_steps
    cfg.pop("train_batch_size", None)
    cfg["gradient_clipping"] = recipe.optimizer.grad_clip
    bf16 = train_precision(recipe).name == "bf16"
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bf16}
    if bf16:  # a non-finite gradient makes DeepSpeed skip the step (see the NaN handling in the loop)
        cfg["bf16"]["check_grad_overflow"] = True
    cfg["fp16"] = {"enabled": False}
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 2 ** 31)
    return cfg


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    t = recipe.train
    cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    if t.device == "cuda" and not torch.cuda.is_available():
        raise UserError("recipe sets train.device: cuda but no CUDA device is available")
    env = os.environ
    if "WORLD_SIZE" not in env and "MASTER_ADDR" in env and "ACCELERATE_USE_CPU" in env:
        # accelerate's simple launcher sets MASTER_ADDR only when asked for several processes, yet starts one
        raise UserError("`accelerate launch --num_processes N` (N > 1) started a single process: on a machine "
                        "without GPUs add --multi_gpu (it launches N processes with torchrun; they use gloo)")
    if "LOCAL_RANK" not in env:  # a single process without a distributed launcher: DeepSpeed needs a group
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=env.get("MASTER_PORT") or str(_free_port()))
    kwargs: dict[str, Any] = {}
    if cpu:  # NCCL does not exist on CPU; accelerate would otherwise pick a backend that needs oneCCL or MPI
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    if t.deepspeed is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=deepspeed_config(recipe))
    # With DeepSpeed, accelerate must not be told cpu=True (it then ignores the plugin); without a GPU the
    # device is the CPU anyway. Without DeepSpeed, cpu=True selects accelerate's multi-CPU (gloo DDP) mode.
    bf16 = train_precision(recipe).name == "bf16"
    accelerator = Accelerator(cpu=cpu and t.deepspeed is None, mixed_precision="bf16" if bf16 else "no",
                              gradient_accumulation_steps=t.grad_accum_steps, **kwargs)
    if cpu and accelerator.device.type != "cpu":
        raise UserError("recipe sets train.device: cpu with DeepSpeed on a machine with GPUs: hide them with "
                        "CUDA_VISIBLE_DEVICES= or set train.deepspeed: null")
    if accelerator.device.type == "cpu":
        # accelerate's launchers export OMP_NUM_THREADS=1 by default, which would leave cores idle
        local = int(env.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(t.cpu_threads or max(1, (os.cpu_count() or 1) // local))
    launched = int(env.get("WORLD_SIZE", "1"))
    seen = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if accelerator.num_processes != launched or seen != launched:
        raise UserError(f"the launcher started {launched} process(es) (WORLD_SIZE) but this process sees "
                        f"{accelerator.num_processes} (accelerate) / {seen} (torch.distributed): the processes did "
                        f"not join one process group and would train as independent copies. Launch with "
                        f"`accelerate launch --num_processes N train.py RECIPE`")
    return accelerator


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_store_hashes(folders: list[str], rank: int = 0, world: int = 1) -> None:
    """Re-hash the shards of every store the run reads (store.check_hashes: shards verified before on this machine
    and unchanged since are not hashed again), each rank its share; a corrupted shard stops every rank with one
    error naming it."""
    from dflash_train.store import check_hashes

    started, problem = time.time(), None
    totals = {"hashed": 0, "cached": 0, "bytes_hashed": 0}
    try:
        for folder in dict.fromkeys(folders):
            for key, value in check_hashes(folder, rank=rank, world=world).items():
                totals[key] += value
    except UserError as err:
        problem = str(err)
    reports = [(problem, totals)]
    if world > 1:
        from accelerate.utils import gather_object

        reports = gather_object(reports)
    problems = [p for p, _ in reports if p]
    if problems:
        err = UserError(problems[0])
        err.from_rank0 = rank != 0  # the same line on every rank: printed once
        raise err
    if rank == 0:
        hashed, cached, nbytes = (sum(t[k] for _, t in reports) for k in ("hashed", "cached", "bytes_hashed"))
        print(f"train: shard hashes of {len(dict.fromkeys(folders))} store(s) checked: {hashed} shard(s) hashed "
              f"({nbytes / 2**30:.2f} GiB in {time.time() - started:.1f} s), {cached} unchanged since verified",
              flush=True)


def nonfinite_parameters(model) -> list[str]:
    """Names of the parameters that hold NaN or inf (under ZeRO-3: in this rank's partition)."""
    bad = []
    for name, p in model.named_parameters():
        part = getattr(p, "ds_tensor", None)
        values = part if part is not None and p.numel() == 0 else p
        if values.numel() and not bool(torch.isfinite(values.detach()).all()):
            bad.append(name)
    return bad


def is_run_folder(out: Path) -> bool:
    """A run folder train wrote before folders recorded their stage: a checkpoint's trainer state or the drafter's
    training_args.json (a recipe.yaml alone may be the user's own)."""
    return any(out.glob(f"checkpoints/step-*/{STATE_FILE}")) or (out / "drafter" / "training_args.json").exists()


def check_resumable(checkpoint: Path, recipe: Recipe, run_dir: Path, world: int) -> None:
    """Refuse to resume `checkpoint` under a recipe that changed what matters (anything outside RESUMABLE_KEYS) or
    with another number of processes; a UserError listing every such change, raised before anything is written."""
    state_file = checkpoint / STATE_FILE
    try:
        saved = json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {state_file} ({err}): the checkpoint cannot be resumed") from None
    if not isinstance(saved, dict):
        raise UserError(f"{state_file} holds a JSON {type(saved).__name__}, not an object: the checkpoint cannot be "
                        f"resumed")
    old = saved.get("recipe")
    source = state_file
    written_by = checkpoint.parent.parent / "recipe.yaml"  # checkpoints written before they kept their recipe
    if old is None and written_by.exists():
        old, source = yaml.safe_load(written_by.read_text()), written_by
    changes = []
    if saved.get("world_size") not in (None, world):
        changes.append(f"processes {saved['world_size']} -> {world} (the batch per step and the data order depend "
                       f"on it)")
    if isinstance(old, dict):
        for key, before, now in config_differences(old, recipe.to_dict()):
            if not any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
                shown = shown_pair(before, now, width=40)
                changes.append(f"{key} {shown[0]} -> {shown[1]}")
    if changes:
        raise UserError(f"{run_dir} would resume {checkpoint} with a changed recipe ({'; '.join(changes)}; as "
                        f"recorded in {source}): these change what the checkpoint means. Restore them to resume, or "
                        f"train into a new output_dir (or set checkpoint.resume: never to start over). Only "
                        f"{', '.join(RESUMABLE_KEYS)} may change on resume; nothing was written")


def check_store_against_target(stores: StoreSet, target_name: str) -> None:
    """The target named by the recipe must be the target the store was captured from."""
    from dflash_train.target import resolve_target, target_identity

    identity = target_identity(resolve_target(target_name), target_name)
    check_fits(f"store {stores.folders[0]} (captured from target {stores.manifest['target'].get('name')!r})",
               Features.of_store(stores.manifest), f"target {target_name!r} (set drafter.target to the captured "
               f"target)", Features(identity, None, identity.hidden_size))


def build_drafter(recipe: Recipe, stores: StoreSet, target_name: str, train_indices: list[int] | None = None,
                  online: OnlineStates | None = None):
    """(model, config) of the drafter this recipe starts from: shaped like the target, tapping the store's layers,
    random (seeded), from the target's top layers, or from a published drafter (`drafter.init_from`, whose shape
    it takes; its source is recorded in config.json as `fine_tuned_from`). `online`: the states drafter.context_norm
    measures are computed."""
    from transformers import AutoConfig

    from dflash_train.model.checkpoint import create_drafter, init_from_target, load_decoder_layers, load_start
    from dflash_train.model.configuration import DFlashConfig
    from dflash_train.model.published import drafter_to_start_from
    from dflash_train.target import checkpoint_stop_token_ids, load_tokenizer, resolve_target

    d = recipe.drafter
    store_layers = list(stores.manifest["target_layer_ids"])
    if d.target_layer_ids is not None and list(d.target_layer_ids) != store_layers:
        raise UserError(f"recipe drafter.target_layer_ids {d.target_layer_ids} differ from the layers store "
                        f"{stores.folders[0]} captured ({store_layers}): remove the key or capture the layers you want")
    path = resolve_target(target_name)
    target_config, tokenizer = AutoConfig.from_pretrained(path), load_tokenizer(str(path))
    start = None
    if d.init_from is not None:
        start = drafter_to_start_from(d.init_from, d.init_revision, {"num_layers": d.num_layers,
                                      "mask_token_id": d.mask_token_id, "target_layer_ids": d.target_layer_ids},
                                      d.block_size, Features.of_store(stores.manifest), target_name, target_config,
                                      tokenizer, checkpoint_stop_token_ids(path, tokenizer))
        config = start.config
        config.extra["fine_tuned_from"] = start.source.record()
    else:
        config = DFlashConfig.from_target(target_config, num_layers=d.num_layers or NEW_DRAFTER_LAYERS,
                                          block_size=d.block_size, target_layer_ids=store_layers,
                                          mask_token_id=d.mask_token_id, tokenizer=tokenizer,
                                          target_identity=stores.manifest["target"])
    torch.manual_seed(recipe.seed)
    drafter = create_drafter(config)
    if d.context_norm:
        drafter.set_context_scale(context_scale(stores, train_indices or list(range(len(stores))), online=online))
    if start is not None:
        load_start(drafter, start.state)
    elif d.init == "target":
        n, k = config.num_target_layers, config.num_hidden_layers
        layers, final_norm = load_decoder_layers(target_name, list(range(n - k, n)))
        init_from_target(drafter, layers, final_norm)
    return drafter, config


NEW_DRAFTER_LAYERS = 5  # drafter.num_layers left unset on a new drafter: the reference drafters' depth


# --- checkpoints --------------------------------------------------------------------------------------------------


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (they have trainer_state.json; temporary folders never do), oldest first."""
    found = []
    for path in (run_dir / "checkpoints").glob(CHECKPOINT_PREFIX + "*"):
        suffix = path.name[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and (path / STATE_FILE).exists():
            found.append((int(suffix), path))
    return sorted(found)


def find_resume_checkpoint(recipe: Recipe, run_dir: Path) -> Path | None:
    mode = recipe.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        found = checkpoint_dirs(run_dir)
        return found[-1][1] if found else None
    path = Path(mode)
    if not (path / STATE_FILE).exists():
        raise UserError(f"recipe checkpoint.resume names {path}, which is not a complete checkpoint (no {STATE_FILE})")
    return path


def parameter_digest(model) -> str:
    """sha256 over every parameter's bytes: equal on all ranks iff their replicas are bit-identical."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_replicas(accelerator, model, step: int, zero_stage: int) -> list[str] | None:
    """Data parallelism (and ZeRO-1/2) keeps a full copy of the drafter on every rank; they must be identical.
    Returns every rank's digest (None under ZeRO-3, whose ranks hold different shards by design)."""
    if zero_stage >= 3:
        return None
    from accelerate.utils import gather_object

    digests = gather_object([parameter_digest(model)]) if accelerator.num_processes > 1 else [parameter_digest(model)]
    if len(set(digests)) != 1:
        raise RuntimeError(f"step {step}: the drafter's parameters differ between ranks ({digests}); the processes "
                           f"are not training one model")
    return digests


def save_checkpoint(accelerator, run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoints/step-N atomically (a temporary folder renamed when complete), then prune old ones."""
    final = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json_atomic(tmp / STATE_FILE, state)
    except (OSError, RuntimeError) as err:  # torch's writer reports a full disk as RuntimeError (basic_ios::clear)
        newest = checkpoint_dirs(run_dir)
        user = write_error(err, tmp, f"The half-written checkpoint was removed; the newest complete one is "
                                     f"{newest[-1][1] if newest else 'none yet'}. Free space and rerun the same "
                                     f"command: it resumes from there")
        shutil.rmtree(tmp, ignore_errors=True)
        if user is None:
            raise
        raise user from None
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# --- metrics ------------------------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (main process) and wandb (when enabled)."""

    def __init__(self, path: Path, enabled: bool, wandb_run=None):
        self.path = path
        self.enabled = enabled
        self.wandb_run = wandb_run

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows a killed run logged after the checkpoint it resumes from."""
        if not self.enabled or not self.path.exists():
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
        self.path.write_text("".join(r + "\n" for r in kept))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])


def start_wandb(recipe: Recipe, run_dir: Path, enabled: bool):
    mode = os.environ.get("WANDB_MODE") or recipe.logging.wandb_mode
    if not enabled or mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        raise UserError("recipe logging.wandb_mode is not 'disabled' but wandb is not installed "
                        "(pip install wandb, or set logging.wandb_mode: disabled)") from None
    return wandb.init(project=recipe.logging.wandb_project, name=recipe.logging.wandb_run_name or recipe.name,
                      config=recipe.to_dict(), mode=mode, dir=str(run_dir), resume="allow",
                      id=hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16])


# --- entry points -------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override recipe keys, dotted: train.max_steps=100 objective.num_anchors=64")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    train(recipe, recipe_path=args.recipe, overrides=tuple(args.overrides))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="train.py", description="train a DFlash drafter from a recipe (run under "
                           "`accelerate launch`)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_as_command("train", lambda: run(args), __name__)
