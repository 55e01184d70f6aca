"""The training stage's recipe: `DFlashTrainer` fits a DFlash drafter to capture stores.

    accelerate launch train.py recipes/NAME.yaml [key=value ...]       (or `dflash-train train RECIPE ...`)

`DFlashTrainer` is the recipe, read top to bottom: setup, the loop (train), one optimizer step (train_step),
validation, checkpoints and the final drafter. The command that runs it is command.py; the helpers it calls live
beside it, in the order a run meets them: accelerator.py (precision, DeepSpeed, the process group), run_folder.py
(the run folder, its claim, the checkpoint to resume), data.py (stores, rows, batches, the held-out split, anchors),
drafter.py (the drafter the run starts from), schedule.py (learning rate, time budget, context warm-up), metrics.py
(step stats, metrics.jsonl, wandb), validation.py (held-out loss and simulated tau) and checkpointing.py (checkpoints
written and loaded). The loss is dflash_train/objective.py; the drafter is dflash_train/model/.

Runs under accelerate with DeepSpeed ZeRO-2 by default (ZeRO-3 or plain DDP by recipe), bf16, gradient
accumulation and optional gradient checkpointing. The target's embedding and LM head are plain frozen tensors
held next to the drafter, never inside the module DeepSpeed wraps: they get no gradient, no optimizer state
and no ZeRO partitioning. With `data.hidden_states: online` the whole target is held the same way, one replica per
rank, and computes the tapped states of every micro batch (data.OnlineStates) instead of reading them from the
store. Every step is a pure function of (recipe, step): the data order comes from a
per-epoch permutation and the anchors from a generator seeded with (seed, step, micro step, rank), so a run
resumed from a checkpoint reproduces the loss sequence of an uninterrupted one.

Before anything is written, rank 0 claims the run folder (run_folder.py) and compares the recipe with the checkpoint
it would resume; then the ranks re-hash the stores' shards between them (data.check_store_hashes, cached). A
checkpoint or drafter is never written with non-finite weights: the run stops with an error naming the newest good
checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from pathlib import Path

import torch

from dflash_train import objective as obj
from dflash_train.errors import UserError, decided_by_rank0, writing
from dflash_train.model.checkpoint import DraftVocabulary, RunSummary
from dflash_train.model.masks import resolve_attention
from dflash_train.provenance import OutputClaim, complete_output, start_output, write_json_atomic, write_provenance
from dflash_train.stages.train.accelerator import deepspeed_config, make_accelerator, train_precision
from dflash_train.stages.train.checkpointing import (TrainerState, TrainState, check_replicas, check_weights_finite,
                                                     load_checkpoint, save_checkpoint)
from dflash_train.stages.train.data import (OnlineStates, anchor_generator, anchor_weights, check_store_hashes,
                                            collate, prepare_data)
from dflash_train.stages.train.drafter import build_drafter, check_store_against_target
from dflash_train.stages.train.metrics import MetricsLog, StepStats, start_wandb
from dflash_train.stages.train.recipe import Recipe
from dflash_train.stages.train.run_folder import (STAGE, checkpoint_dirs, claim_run_folder, find_resume_checkpoint,
                                                  write_run_records)
from dflash_train.stages.train.schedule import TrainClock, in_context_warmup, lr_factor
from dflash_train.stages.train.validation import HeldOutMetrics, held_out_metrics


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
        self.last_eval: HeldOutMetrics = {}
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
        self.claim = decided_by_rank0(functools.partial(claim_run_folder, recipe, self.run_dir, self.world),
                                      self.rank, self.world)
        try:  # every rank hashes its share of the shards (a large store would outlast a collective's timeout)
            check_store_hashes([*recipe.data.stores, *recipe.data.replay_stores,
                                *([recipe.data.eval_store] if recipe.data.eval_store else [])], self.rank, self.world)
        except UserError:
            if self.claim is not None:
                self.claim.release(failed=True)
            raise
        if self.main:
            write_run_records(self.run_dir, recipe, self.recipe_path, self.overrides, self.world, self.precision)
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
        self.vocab = self.choose_draft_vocabulary() if recipe.drafter.draft_vocab_size is not None else None
        self.embed, self.head = self.load_target_parts(target_name)
        # a draft vocabulary: the loss and the validation score only its rows of the head (self.head)
        self.draft_ids = None if self.vocab is None else torch.tensor(self.vocab["ids"], device=self.device)
        self.label_rows = None if self.vocab is None else obj.draft_rows(self.draft_ids, self.embed.shape[0])
        self.prepare_optimizer(drafter)
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

    def prepare_optimizer(self, drafter) -> None:
        """The optimizer over the drafter's parameters and its learning-rate schedule (lr_factor, against the
        training clock), both handed to accelerate: the model, optimizer and schedule are saved with each
        checkpoint."""
        opt, accelerator = self.recipe.optimizer, self.accelerator
        # fused: one kernel per step instead of a dozen passes per tensor (4x faster on CPU; CUDA has it too)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                      weight_decay=opt.weight_decay, fused=True)
        self.model, self.optimizer = accelerator.prepare(drafter, optimizer)
        self.clock = TrainClock(self.recipe.train.time_budget_s)
        schedule = functools.partial(lr_factor, total_steps=self.total_steps, warmup_ratio=opt.warmup_ratio,
                                     schedule=opt.schedule, min_ratio=opt.min_lr_ratio, decay_ratio=opt.decay_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: schedule(s, progress=self.clock.progress_at(s, self.total_steps)))
        accelerator.register_for_checkpointing(self.scheduler)

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

    def state_source(self) -> RunSummary:
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
        if self.vocab is not None:  # the draft vocabulary's rows only: a smaller matmul in every step
            head = head[torch.tensor(self.vocab["ids"], device=head.device)].contiguous()
        return embed, head

    def resume(self) -> tuple[TrainState, Path | None]:
        """The state of the newest checkpoint (checkpoint.resume), its model/optimizer/scheduler/RNG loaded; a
        fresh state (and a fresh metrics.jsonl) otherwise."""
        resume_from = find_resume_checkpoint(self.recipe, self.run_dir)
        if resume_from is None:
            if self.main and self.metrics.path.exists():
                self.metrics.path.unlink()
            return TrainState(), None
        saved = load_checkpoint(self.accelerator, resume_from)
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

    def train(self) -> RunSummary:
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
                                      soft_label_weight=recipe.objective.soft_label_weight,
                                      label_rows=self.label_rows)
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

    def validate(self) -> HeldOutMetrics:
        """Held-out loss and simulated acceptance length (validation.held_out_metrics), logged as an "eval" row of
        metrics.jsonl."""
        result = held_out_metrics(self.core, self.embed, self.head, self.data.eval_samples, self.recipe, self.online,
                                  self.device, self.drafter_config.mask_token_id, self.attention, self.draft_ids)
        self.last_eval = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
        self.metrics.log({"kind": "eval", "step": self.state.step, **self.last_eval,
                          "time": round(time.time() - self.started, 2), "train_time": round(self.clock.elapsed, 2)})
        return result

    # -- outputs --------------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: the accelerate/DeepSpeed state and trainer_state.json (TrainState, the schedule's
        length, the data position and every rank's parameter digest)."""
        step, plan = self.state.step, self.plan
        check_weights_finite(self.core, self.accelerator, self.run_dir, step, self.recipe.optimizer.lr, "checkpoint")
        digests = check_replicas(self.accelerator, self.model, step, self.zero_stage)
        trainer_state: TrainerState = {
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

    def save_drafter(self) -> RunSummary:
        """drafter/: the final drafter in the public DFlash format, in the target's dtype (what engines serve the
        pair in, whatever precision trained it; all ranks gather the weights under ZeRO-3), with
        training_args.json and provenance.json. Returns the run summary."""
        state = self.state
        check_weights_finite(self.core, self.accelerator, self.run_dir, state.step, self.recipe.optimizer.lr, "drafter")
        state_dict = self.accelerator.get_state_dict(self.model)
        summary: RunSummary = {"steps": state.step, "final_train_loss": self.final_loss(),
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

    def export(self, out: Path, state_dict: dict[str, torch.Tensor], summary: RunSummary) -> None:
        """Main process: the drafter folder (weights in the target's dtype; with a draft vocabulary, the target
        head's rows for it and d2t: checkpoint.draft_vocabulary), training_args.json, provenance.json."""
        from dflash_train.model.checkpoint import create_drafter, draft_vocabulary, save_drafter
        from dflash_train.target import checkpoint_dtype, load_embedding_and_head

        recipe = self.recipe
        start_output(out, STAGE)
        config, state = self.drafter_config, {k: v.detach().cpu() for k, v in state_dict.items()}
        dtype = checkpoint_dtype(self.target_name) or self.precision.dtype  # what engines serve the pair in
        vocab = self.vocab
        if vocab is not None:  # the rows read again in that dtype, unchanged
            config, rows = draft_vocabulary(config, load_embedding_and_head(self.target_name, dtype=dtype)[1],
                                            vocab["ids"])
            state.update(rows)
        final = create_drafter(config)
        final.load_state_dict(state, strict=True)
        final.set_context_scale(self.core.context_scale)  # save_drafter folds it into fc
        save_drafter(final.to(dtype), config, out)
        recorded = {**summary, "precision": self.precision.as_dict(), **self.state_source(),
                    **({"draft_vocab": {k: v for k, v in vocab.items() if k != "ids"}} if vocab else {})}
        data = self.data.stores.summary(self.data.train_indices)
        write_json_atomic(out / "training_args.json", {"recipe": recipe.to_dict(), "data": data, "run": recorded})
        write_provenance(out, config=recipe.to_dict(), stage=STAGE, run=recorded, stores=self.data.stores.folders)
        complete_output(out)

    def choose_draft_vocabulary(self) -> DraftVocabulary | None:
        """The draft vocabulary of recipe drafter.draft_vocab_size, chosen from the samples that train
        (stages/train/draft_vocab.py) before the first step: training scores its rows of the head, the export ships
        them. None where they use every id (the whole head is kept)."""
        from dflash_train.stages.train.draft_vocab import choose_draft_vocabulary
        from dflash_train.target import checkpoint_stop_token_ids, load_tokenizer, resolve_target

        path = resolve_target(self.target_name)
        stops = checkpoint_stop_token_ids(path, load_tokenizer(str(path)))
        vocab = choose_draft_vocabulary(self.data.stores, self.data.train_indices,
                                        self.recipe.drafter.draft_vocab_size, stops)
        V = self.drafter_config.vocab_size
        if self.main:
            print(f"draft vocabulary: the training samples use all {V:,} ids: the whole head is kept"
                  if vocab["size"] >= V else f"draft vocabulary: {vocab['size']:,} of the target's {V:,} ids, "
                  f"{vocab['answer_tokens_covered']:.1%} of the training answers' tokens", flush=True)
        return None if vocab["size"] >= V else vocab

    def cleanup(self) -> None:
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        if self.claim is not None:
            self.claim.release()
            self.claim = None
