"""The training stage: fit a DFlash drafter to a capture store, driven by a recipe.

    accelerate launch train.py recipes/NAME.yaml [key=value ...]       (or `dflash-train train RECIPE ...`)

Runs under accelerate with DeepSpeed ZeRO-2 by default (ZeRO-3 or plain DDP by recipe), bf16, gradient
accumulation and optional gradient checkpointing. The target's embedding and LM head are plain frozen tensors
held next to the drafter, never inside the module DeepSpeed wraps: they get no gradient, no optimizer state
and no ZeRO partitioning. Every step is a pure function of (recipe, step): the data order comes from a
per-epoch permutation and the anchors from a generator seeded with (seed, step, micro step, rank), so a run
resumed from a checkpoint reproduces the loss sequence of an uninterrupted one.

Run folder (`output_dir`):
  checkpoints/step-NNNNNNN/   accelerate/DeepSpeed state (model, optimizer, scheduler, RNG) + trainer_state.json
  drafter/                    the final drafter (public DFlash format; config.json names the target) + training_args.json
  metrics.jsonl               one row per logged step and per eval
  recipe.yaml, provenance.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from dflash_train import objective as obj
from dflash_train.errors import UserError
from dflash_train.model.masks import resolve_attention
from dflash_train.provenance import complete_output, start_output, write_json_atomic, write_provenance
from dflash_train.recipe import Recipe, load_recipe
from dflash_train.target import Features, check_fits

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"


# --- data -----------------------------------------------------------------------------------------------------


class StoreSet:
    """Several capture stores that must agree on target, tapped layers and hidden size, seen as one list."""

    def __init__(self, folders: list[str]):
        from dflash_train.store import open_store

        if not folders:
            raise UserError("no capture store given (recipe key data.stores)")
        self.stores = [open_store(f) for f in folders]
        self.folders = [str(f) for f in folders]
        first = self.stores[0].manifest
        for folder, store in zip(self.folders[1:], self.stores[1:]):
            check_fits(f"store {folder}", Features.of_store(store.manifest),
                       f"store {self.folders[0]} (stores trained together must match)", Features.of_store(first))
        self.index = [(s, i) for s, store in enumerate(self.stores) for i in range(len(store))]
        self.manifest = first

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, j = self.index[i]
        return self.stores[s][j]

    def length(self, i: int) -> int:
        s, j = self.index[i]
        return self.stores[s].length(j)

    def ids(self) -> list[str]:
        if not hasattr(self, "_ids"):
            self._ids = [i for store in self.stores for i in store.ids]
        return self._ids

    def summary(self) -> dict[str, Any]:
        return {"stores": [{"path": f, "num_samples": s.manifest["num_samples"], "num_tokens": s.manifest["num_tokens"],
                            "generation": s.manifest.get("generation"), "storage_dtype": s.manifest["storage_dtype"],
                            "ingest_report": s.manifest.get("ingest_report")}
                           for f, s in zip(self.folders, self.stores)],
                "num_samples": len(self), "num_tokens": sum(s.manifest["num_tokens"] for s in self.stores)}


def _hash_fraction(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64


def split_eval(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a sample is held out iff the hash of its id falls below `fraction`."""
    held = [i for i, sid in enumerate(ids) if _hash_fraction("eval:" + sid) < fraction]
    held_set = set(held)
    return [i for i in range(len(ids)) if i not in held_set], held


def make_rows(indices: list[int], lengths: list[int], max_length: int, packing: bool, seed: int) -> list[list[int]]:
    """Training rows as lists of sample indices: one sample per row, or (packing) samples back to back in a
    seeded order while they fit in max_length tokens (a sample longer than max_length is truncated)."""
    if not packing:
        return [[i] for i in indices]
    order = list(indices)
    random.Random(seed).shuffle(order)
    rows, row, used = [], [], 0
    for i in order:
        n = min(lengths[i], max_length)
        if row and used + n > max_length:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    if row:
        rows.append(row)
    return rows


TOPK_KEYS = ("topk_ids", "topk_logprobs")


def _common_topk(samples: list[list[dict[str, Any]]]) -> int:
    """The top-k width all samples carry (the smallest: each top-k row is sorted), 0 if any sample has none."""
    return min(s["topk_ids"].shape[-1] if "topk_ids" in s else 0 for row in samples for s in row)


def collate(samples: list[list[dict[str, Any]]], max_length: int) -> dict[str, torch.Tensor]:
    """Rows of samples -> a padded batch with input_ids, loss_mask, hidden_states, position_ids, doc_start, and
    topk_ids / topk_logprobs [b, S, K] when every sample has them (padding: ids 0, log-probs -inf).

    Samples in one row are packed back to back; positions restart at each sample and doc_start marks where
    each token's sample begins, so blocks never see another sample's context. Padding has loss_mask False."""
    topk = _common_topk(samples)
    keys = ("input_ids", "loss_mask", "hidden_states") + (TOPK_KEYS if topk else ())
    rows = []
    for row in samples:
        parts = [{k: s[k][:max_length, :topk] if k in TOPK_KEYS else s[k][:max_length] for k in keys} for s in row]
        budget, kept = max_length, []
        for p in parts:
            if budget <= 0:
                break
            kept.append({k: v[:budget] for k, v in p.items()})
            budget -= len(kept[-1]["input_ids"])
        rows.append(kept)
    S = max(sum(len(p["input_ids"]) for p in row) for row in rows)
    b = len(rows)
    width = rows[0][0]["hidden_states"].shape[-1]
    batch = {
        "input_ids": torch.zeros(b, S, dtype=torch.long),
        "loss_mask": torch.zeros(b, S, dtype=torch.bool),
        "hidden_states": torch.zeros(b, S, width, dtype=rows[0][0]["hidden_states"].dtype),
        "position_ids": torch.zeros(b, S, dtype=torch.long),
        "doc_start": torch.zeros(b, S, dtype=torch.long),
    }
    if topk:
        batch["topk_ids"] = torch.zeros(b, S, topk, dtype=torch.long)
        batch["topk_logprobs"] = torch.full((b, S, topk), float("-inf"))
    num_tokens = 0
    for r, row in enumerate(rows):
        at = 0
        for p in row:
            n = len(p["input_ids"])
            batch["input_ids"][r, at:at + n] = p["input_ids"]
            batch["loss_mask"][r, at:at + n] = p["loss_mask"]
            batch["hidden_states"][r, at:at + n] = p["hidden_states"]
            for k in TOPK_KEYS if topk else ():
                batch[k][r, at:at + n] = p[k]
            batch["position_ids"][r, at:at + n] = torch.arange(n)
            batch["doc_start"][r, at:at + n] = at
            at += n
        batch["position_ids"][r, at:] = torch.arange(S - at) + (at and int(batch["position_ids"][r, at - 1]) + 1)
        batch["doc_start"][r, at:] = at
        num_tokens += at
    batch["num_tokens"] = torch.tensor(num_tokens)
    return batch


def check_soft_labels(recipe: Recipe, stores: StoreSet) -> None:
    """objective.soft_label_weight > 0 needs every training store to carry the target's top-k soft labels."""
    weight = recipe.objective.soft_label_weight
    missing = [f for f, s in zip(stores.folders, stores.stores) if not s.manifest.get("topk")]
    if weight > 0 and missing:
        raise UserError(f"recipe key objective.soft_label_weight is {weight}, but store(s) {', '.join(missing)} "
                        f"hold no top-k soft labels: recapture with `dflash-train capture ... --store-topk K` "
                        f"(e.g. 8) or set objective.soft_label_weight: 0")


@dataclass
class DataPlan:
    """Which rows every (step, micro step, rank) trains on: a seeded permutation of the rows per epoch."""
    rows: list[list[int]]
    world: int
    micro_batch: int
    grad_accum: int
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.world * self.micro_batch * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.rows_per_step

    def epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def rows_for(self, step: int, micro: int, rank: int) -> list[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        base = k * self.rows_per_step + (micro * self.world + rank) * self.micro_batch
        return [self.rows[order[base + i]] for i in range(self.micro_batch)]


@dataclass
class TrainData:
    stores: StoreSet
    train_indices: list[int]
    plan: DataPlan
    eval_samples: list[dict[str, Any]]


def prepare_data(recipe: Recipe, world: int) -> TrainData:
    """Open the stores, hold out the eval samples, and lay out the rows every step trains on."""
    stores = StoreSet(recipe.data.stores)
    check_soft_labels(recipe, stores)
    if recipe.data.eval_store:
        eval_set = StoreSet([recipe.data.eval_store])
        check_fits(f"eval store {recipe.data.eval_store}", Features.of_store(eval_set.manifest),
                   "the training stores", Features.of_store(stores.manifest))
        train_idx = list(range(len(stores)))
        eval_samples = [eval_set[i] for i in range(min(len(eval_set), recipe.data.eval_samples))]
    else:
        train_idx, held = split_eval(stores.ids(), recipe.data.eval_fraction)
        eval_samples = [stores[i] for i in held[:recipe.data.eval_samples]]
    if recipe.data.max_samples is not None:
        train_idx = train_idx[:recipe.data.max_samples]
    if not train_idx:
        raise UserError(f"no training samples left in {', '.join(stores.folders)} after holding out the eval split")
    lengths = [stores.length(i) for i in range(len(stores))]
    rows = make_rows(train_idx, lengths, recipe.data.max_length, recipe.data.batching == "packing", recipe.seed)
    plan = DataPlan(rows=rows, world=world, micro_batch=recipe.train.micro_batch_size,
                    grad_accum=recipe.train.grad_accum_steps, seed=recipe.seed)
    if plan.steps_per_epoch < 1:
        raise UserError(f"{len(rows)} training rows are fewer than one optimizer step needs ({plan.rows_per_step} = "
                        f"{world} processes x micro_batch_size {plan.micro_batch} x grad_accum_steps "
                        f"{plan.grad_accum})")
    return TrainData(stores=stores, train_indices=train_idx, plan=plan, eval_samples=eval_samples)


def anchor_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    key = hashlib.sha256(f"anchors:{seed}:{step}:{micro}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "big") & (2 ** 63 - 1))


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


def in_context_warmup(recipe: Recipe, step: int, total_steps: int, clock: "TrainClock") -> bool:
    """Whether this step's blocks see only the last context_warmup_window context positions (the first
    objective.context_warmup_ratio of the run)."""
    progress = clock.progress if clock.progress is not None else step / max(1, total_steps)
    return progress < recipe.objective.context_warmup_ratio


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

    @property
    def progress(self) -> float | None:
        return None if self.budget_s is None else self.elapsed / self.budget_s

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


def check_store_against_target(stores: StoreSet, target_name: str) -> None:
    """The target named by the recipe must be the target the store was captured from."""
    from dflash_train.target import resolve_target, target_identity

    identity = target_identity(resolve_target(target_name), target_name)
    check_fits(f"store {stores.folders[0]} (captured from target {stores.manifest['target'].get('name')!r})",
               Features.of_store(stores.manifest), f"target {target_name!r} (set drafter.target to the captured "
               f"target)", Features(identity, None, identity.hidden_size))


def build_drafter(recipe: Recipe, stores: StoreSet, target_name: str, train_indices: list[int] | None = None):
    """(model, config) of the drafter this recipe starts from: shaped like the target, tapping the store's layers,
    random (seeded), from the target's top layers, or from another drafter."""
    from transformers import AutoConfig

    from dflash_train.model.checkpoint import (create_drafter, init_from_target, load_decoder_layers,
                                               start_from_drafter)
    from dflash_train.model.configuration import DFlashConfig
    from dflash_train.target import load_tokenizer, resolve_target

    store_layers = list(stores.manifest["target_layer_ids"])
    wanted = recipe.drafter.target_layer_ids
    if wanted is not None and list(wanted) != store_layers:
        raise UserError(f"recipe drafter.target_layer_ids {wanted} differ from the layers store {stores.folders[0]} "
                        f"captured ({store_layers}): remove the key or capture the layers you want")
    path = resolve_target(target_name)
    config = DFlashConfig.from_target(AutoConfig.from_pretrained(path), num_layers=recipe.drafter.num_layers,
                                      block_size=recipe.drafter.block_size, target_layer_ids=store_layers,
                                      mask_token_id=recipe.drafter.mask_token_id,
                                      tokenizer=load_tokenizer(str(path)), target_identity=stores.manifest["target"])
    torch.manual_seed(recipe.seed)
    drafter = create_drafter(config)
    if config.hidden_size != stores.manifest["hidden_size"]:
        raise UserError(f"drafter hidden size {config.hidden_size} != store hidden_size "
                        f"{stores.manifest['hidden_size']}")
    if recipe.drafter.context_norm:
        drafter.set_context_scale(context_scale(stores, train_indices or list(range(len(stores)))))
    if recipe.drafter.init_from is not None:
        start_from_drafter(drafter, config, recipe.drafter.init_from)
    elif recipe.drafter.init == "target":
        n = config.num_target_layers
        layers, final_norm = load_decoder_layers(target_name, list(range(n - recipe.drafter.num_layers, n)))
        init_from_target(drafter, layers, final_norm)
    return drafter, config


def context_scale(stores: StoreSet, indices: list[int], max_samples: int = 64) -> torch.Tensor:
    """Per-channel RMS of the tapped states over (up to) the first `max_samples` training samples, [n*H].

    Position 0 is left out: its states (the attention sink) are hundreds of times larger than any other
    position's and would set the scale of the channels they touch."""
    total, count = None, 0
    for i in indices[:max_samples]:
        states = stores[i]["hidden_states"][1:].float()
        sq = states.pow(2).sum(dim=0)
        total = sq if total is None else total + sq
        count += states.shape[0]
    if not count:
        raise UserError("drafter.context_norm needs training samples of at least 2 tokens")
    return (total / count).sqrt().clamp(min=1e-3)


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
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(tmp / STATE_FILE, state)
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


# --- eval ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(drafter, embed, head, samples: list[dict[str, Any]], recipe: Recipe, attention: str,
             device) -> dict[str, Any]:
    """Held-out loss (anchors drawn with a fixed seed) and simulated acceptance length (blocks at every anchor)."""
    was_training = drafter.training
    drafter.eval()
    B = recipe.drafter.block_size
    mask_id = drafter.mask_token_id
    loss_sum, weight_sum = 0.0, 0.0
    correct = torch.zeros(B)
    counted = torch.zeros(B)
    lengths = []
    for i, sample in enumerate(samples):
        batch = {k: v.to(device) for k, v in collate([[sample]], recipe.data.max_length).items()}
        blocks = obj.sample_anchors(batch["loss_mask"], recipe.objective.num_anchors, B,
                                    anchor_generator(recipe.seed, -1, i, 0))
        out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id, gamma=recipe.decay_gamma,
                              attention=attention, head_chunk_tokens=recipe.objective.head_chunk_tokens)
        w = float(out.weight_sum)
        if w > 0:
            loss_sum += float(out.loss) * w
            weight_sum += w
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        trimmed = {k: batch[k][0] for k in ("input_ids", "loss_mask", "hidden_states")}
        lengths.append(obj.simulated_acceptance(drafter, embed, head, trimmed, B, mask_id, attention=attention))
    drafter.train(was_training)
    all_lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
    return {
        "eval_loss": loss_sum / weight_sum if weight_sum else math.nan,
        "eval_tau": float(all_lengths.float().mean()) if all_lengths.numel() else math.nan,
        "eval_acc": [round(float(c / n), 4) if n else None for c, n in zip(correct[1:], counted[1:])],
        "eval_anchors": int(all_lengths.numel()),
        "eval_samples": len(samples),
    }


# --- the loop ---------------------------------------------------------------------------------------------------


def train(recipe: Recipe, recipe_path: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    from tqdm import tqdm

    from dflash_train.target import load_embedding_and_head

    started = time.time()
    warnings.filterwarnings("ignore", message=r".*`torch.distributed.\w+` is deprecated")  # DeepSpeed internals
    accelerator = make_accelerator(recipe)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    device = accelerator.device
    run_dir = Path(recipe.output_dir)
    precision = train_precision(recipe)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        write_provenance(run_dir, config=recipe.to_dict(), recipe_file=recipe_path, overrides=list(overrides),
                         world_size=world, precision=precision.as_dict())
        print(f"train: compute dtype {precision.describe()}", flush=True)
    accelerator.wait_for_everyone()

    data = prepare_data(recipe, world)
    stores, plan = data.stores, data.plan
    total_steps = recipe.train.max_steps or max(1, int(recipe.train.epochs * plan.steps_per_epoch))

    # model, frozen target parts, optimizer
    target_name = recipe.drafter.target or stores.manifest["target"]["name"]
    check_store_against_target(stores, target_name)
    drafter, drafter_config = build_drafter(recipe, stores, target_name, data.train_indices)
    if recipe.train.gradient_checkpointing:
        drafter.gradient_checkpointing_enable()
    embed, head = load_embedding_and_head(target_name, dtype=precision.dtype)
    tied = head is embed
    embed = embed.to(device)
    head = embed if tied else head.to(device)
    if head.shape[1] != drafter_config.hidden_size or embed.shape[0] <= drafter_config.mask_token_id:
        raise UserError(f"target {target_name!r}: embedding/LM head shapes {tuple(embed.shape)}/{tuple(head.shape)} "
                        f"do not fit the drafter (hidden {drafter_config.hidden_size})")
    opt = recipe.optimizer
    # fused: one kernel per step instead of a dozen passes per tensor (4x faster on CPU; CUDA has it too)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay, fused=True)
    model, optimizer = accelerator.prepare(drafter, optimizer)
    clock = TrainClock(recipe.train.time_budget_s)
    schedule = functools.partial(lr_factor, total_steps=total_steps, warmup_ratio=opt.warmup_ratio,
                                 schedule=opt.schedule, min_ratio=opt.min_lr_ratio, decay_ratio=opt.decay_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, progress=clock.progress))
    accelerator.register_for_checkpointing(scheduler)
    core = accelerator.unwrap_model(model)  # the plain DFlashDraftModel (for eval and for its weights)
    attention = resolve_attention(recipe.objective.attention, device)
    uses_deepspeed = recipe.train.deepspeed is not None
    zero_stage = deepspeed_config(recipe).get("zero_optimization", {}).get("stage", 0) if uses_deepspeed else 0

    # resume
    start_step, bad_in_a_row, bad_total = 0, 0, 0
    resume_from = find_resume_checkpoint(recipe, run_dir)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=main)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = json.loads((resume_from / STATE_FILE).read_text())
        start_step, bad_in_a_row, bad_total = state["step"], state["bad_in_a_row"], state["bad_total"]
        clock.spent_s = float(state.get("train_time_s", 0.0))
        if state.get("total_steps") != total_steps and main:
            print(f"note: the checkpoint was written for {state.get('total_steps')} total steps, this run has "
                  f"{total_steps}; the learning-rate schedule follows this run", flush=True)
        metrics.truncate_after(start_step)
        if main:
            print(f"resuming from {resume_from} at step {start_step}", flush=True)
    elif main and metrics.path.exists():
        metrics.path.unlink()
    wandb_run = start_wandb(recipe, run_dir, main)
    metrics.wandb_run = wandb_run

    if main:
        n_params = sum(p.numel() for p in core.parameters())
        print(f"training {n_params / 1e6:.2f}M drafter parameters on {len(data.train_indices)} samples "
              f"({len(plan.rows)} rows, "
              f"{plan.steps_per_epoch} steps/epoch), {total_steps} steps"
              + (f" or {recipe.train.time_budget_s:g} s of training" if recipe.train.time_budget_s else "")
              + f", {world} process(es) on {device.type}, "
              f"attention={attention}, deepspeed={recipe.train.deepspeed}", flush=True)
    bar = tqdm(total=total_steps, initial=start_step, disable=not (main and recipe.logging.progress_bar),
               desc="train", dynamic_ncols=True)
    B = recipe.drafter.block_size
    mask_id = drafter_config.mask_token_id
    last_eval: dict[str, Any] = {}
    last_loss = math.nan

    def checkpoint_state(step: int) -> dict[str, Any]:
        return {"step": step, "total_steps": total_steps, "epoch": step / plan.steps_per_epoch,
                "bad_in_a_row": bad_in_a_row, "bad_total": bad_total, "world_size": world,
                "train_time_s": clock.elapsed,
                "data_position": {"epoch": step // plan.steps_per_epoch, "step_in_epoch": step % plan.steps_per_epoch}}

    step = start_step
    last_checkpoint_step = start_step if resume_from is not None else None
    model.train()
    clock.start()
    while step < total_steps and not clock.expired:
        t0 = time.time()
        lr_now = optimizer.param_groups[0]["lr"]
        sums = torch.zeros(3 + 2 * B, dtype=torch.float64)  # loss*n, n (micro steps), tokens, correct[B], counted[B]
        bad = False
        grad_norm = None
        for micro in range(plan.grad_accum):
            rows_now = plan.rows_for(step, micro, rank)
            batch = collate([[stores[i] for i in row] for row in rows_now], recipe.data.max_length)
            num_tokens = int(batch.pop("num_tokens"))
            batch = {k: v.to(device) for k, v in batch.items()}
            blocks = obj.sample_anchors(batch["loss_mask"], recipe.objective.num_anchors, B,
                                        anchor_generator(recipe.seed, step, micro, rank), batch["doc_start"])
            if in_context_warmup(recipe, step, total_steps, clock):
                blocks = dataclasses.replace(blocks, context_window=recipe.objective.context_warmup_window)
            with accelerator.accumulate(model):
                out = obj.dflash_loss(model, embed, head, batch, blocks, mask_token_id=mask_id,
                                      gamma=recipe.decay_gamma, attention=attention,
                                      head_chunk_tokens=recipe.objective.head_chunk_tokens,
                                      soft_label_weight=recipe.objective.soft_label_weight)
                finite = torch.tensor(float(torch.isfinite(out.loss.detach())), device=device)
                finite = accelerator.reduce(finite, reduction="sum") if world > 1 else finite
                loss = out.loss
                if finite < world:
                    bad = True
                    # Make every gradient non-finite on purpose: DeepSpeed (check_grad_overflow) then skips the
                    # optimizer step and clears the gradients on all ranks, as the loop below does without it.
                    loss = out.loss * float("nan")
                accelerator.backward(loss)
                if accelerator.sync_gradients and not bad:
                    # DeepSpeed clipped inside backward's engine.step(); this only reads its norm
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), opt.grad_clip or float("inf"))
                if uses_deepspeed or not bad:
                    optimizer.step()  # under DeepSpeed a no-op wrapper: the engine stepped (or skipped) already
                optimizer.zero_grad(set_to_none=True)
            if not bad:
                sums[0] += float(out.loss.detach())
            sums[1] += 1
            sums[2] += num_tokens
            sums[3:3 + B] += out.correct.double().cpu()
            sums[3 + B:] += out.counted.double().cpu()
        scheduler.step()
        if world > 1:
            sums = accelerator.reduce(sums.to(device), reduction="sum").cpu()
        step += 1
        bar.update(1)
        bad_in_a_row = bad_in_a_row + 1 if bad else 0
        bad_total += int(bad)
        elapsed = time.time() - t0
        good_micro = sums[1] if not bad else 0
        last_loss = float(sums[0] / good_micro) if good_micro else math.nan
        if step % recipe.logging.log_every == 0 or step == total_steps:
            acc = [round(float(c / n), 4) if n else None for c, n in zip(sums[3 + 1:3 + B], sums[3 + B + 1:])]
            gn = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            row = {"kind": "train", "step": step, "epoch": round(step / plan.steps_per_epoch, 4),
                   "loss": None if bad else last_loss, "acc": acc, "acc_1": acc[0], "lr": lr_now,
                   "kl": None if out.kl is None else float(out.kl),  # the last micro batch's, this rank's
                   "grad_norm": None if gn is None or (isinstance(gn, float) and not math.isfinite(gn)) else gn,
                   "tokens_per_s": float(sums[2]) / elapsed, "skipped": bad, "bad_steps": bad_total,
                   "time": round(time.time() - started, 2), "train_time": round(clock.elapsed, 2)}
            metrics.log(row)
            bar.set_postfix(loss=f"{last_loss:.3f}", acc1=acc[0], tau=last_eval.get("eval_tau"))
        if bad_in_a_row >= recipe.train.max_bad_steps:
            newest = checkpoint_dirs(run_dir)
            where = f"{newest[-1][1]} (step {newest[-1][0]})" if newest else "none yet"
            bar.close()
            raise UserError(f"{bad_in_a_row} optimizer steps in a row (up to step {step}) had a non-finite loss: "
                            f"training diverged and was stopped. Newest checkpoint: {where}. Lower optimizer.lr, "
                            f"check the store for bad samples, or raise train.max_bad_steps")
        done = step >= total_steps or clock.expired
        want_eval = (recipe.eval.every and step % recipe.eval.every == 0) or (recipe.eval.at_end and done)
        clock.pause()  # evals and checkpoints do not count against the training time budget
        if want_eval and data.eval_samples:
            result = evaluate(core, embed, head, data.eval_samples, recipe, attention, device)
            last_eval = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
            metrics.log({"kind": "eval", "step": step, **last_eval, "time": round(time.time() - started, 2),
                         "train_time": round(clock.elapsed, 2)})
            bar.set_postfix(loss=f"{last_loss:.3f}", tau=last_eval["eval_tau"])
        if step % recipe.checkpoint.every == 0 or done:
            digests = check_replicas(accelerator, model, step, zero_stage)
            save_checkpoint(accelerator, run_dir, step, {**checkpoint_state(step), "rank_parameter_digests": digests},
                            recipe.checkpoint.keep_last)
            last_checkpoint_step = step
        clock.start()
    clock.pause()
    bar.close()

    # final drafter (all ranks take part in gathering the weights under ZeRO-3)
    state_dict = accelerator.get_state_dict(model)
    summary = {"steps": step, "final_train_loss": last_loss, "train_time_s": round(clock.elapsed, 1),
               **{f"final_{k}": v for k, v in last_eval.items()},
               "bad_steps": bad_total, "wall_time_s": round(time.time() - started, 1), "world_size": world,
               "device": device.type, "resumed_from": str(resume_from) if resume_from else None,
               "last_checkpoint_step": last_checkpoint_step}
    if main:
        save_final_drafter(run_dir / "drafter", core, drafter_config, state_dict, recipe, stores,
                           {**summary, "precision": precision.as_dict()}, target_name)
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            wandb_run.finish()
        print(f"done: {step} steps in {summary['wall_time_s']} s; final loss {last_loss:.4f}"
              + (f", eval tau {last_eval.get('eval_tau')}" if last_eval else "")
              + f"; drafter in {run_dir / 'drafter'}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def save_final_drafter(out_dir: Path, core, config, state_dict: dict[str, torch.Tensor], recipe: Recipe,
                       stores: StoreSet, summary: dict[str, Any], target_name: str) -> None:
    """The drafter in the target's dtype (what engines serve the pair in, whatever precision trained it)."""
    from dflash_train.model.checkpoint import create_drafter, save_drafter
    from dflash_train.target import checkpoint_dtype

    out = start_output(out_dir)
    dtype = checkpoint_dtype(target_name) or train_precision(recipe).dtype
    final = create_drafter(config)
    final.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()}, strict=True)
    final.set_context_scale(core.context_scale)  # save_drafter folds it into fc
    save_drafter(final.to(dtype), config, out)
    write_json_atomic(out / "training_args.json", {"recipe": recipe.to_dict(), "data": stores.summary(),
                                                   "run": summary})
    write_provenance(out, config=recipe.to_dict(), run=summary, stores=stores.folders)
    complete_output(out)


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
    parser = argparse.ArgumentParser(prog="train.py", description="train a DFlash drafter from a recipe "
                                     "(run under `accelerate launch`)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as err:
        print(f"train: error: {err}", file=sys.stderr, flush=True)
        return 2
