"""Training data from capture stores: which samples train and which are held out, how they form rows and batches,
and which rows every (step, micro step, rank) reads.

    stores = StoreSet(["data/store/a"], ["data/store/r0"])  stores that must agree (check_fits), one list, replay last
    train_idx, held = split_eval(stores.ids(), 0.1)          held out by a hash of the sample id: stable across runs
    replay = choose_replay(ids, candidates, 1000)            earlier rounds' samples that train too: by a hash of the id
    rows = make_rows(train_idx, lengths, 1024, packing, seed) one sample per row, or samples packed back to back
    plan = DataPlan(rows, world, micro_batch, grad_accum, seed)  a seeded permutation of the rows per epoch
    batch = collate([[stores[i] for i in row] for row in plan.rows_for(step, micro, rank)], max_length)

Every choice is a pure function of (recipe, step, micro step, rank), anchors included (`anchor_generator`; their
weights: `anchor_weights`), so a run resumed from a checkpoint reads exactly what an uninterrupted run reads. Before
a run reads its stores, its ranks re-hash their shards between them (`check_store_hashes`). This module reads
stores only: no accelerate (but for check_store_hashes across ranks), no DeepSpeed (probes/ngram_baseline.py uses
it to read a store as the trainer does).

With `data.hidden_states: online` the samples' states come from the target instead (`OnlineStates`, one batched
prefill per micro batch, the prefill the capture stage stores); token-only stores hold none.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass

import torch

from dflash_train import objective as obj
from dflash_train.errors import UserError
from dflash_train.model.checkpoint import DataSummary
from dflash_train.stages.train.recipe import Recipe
from dflash_train.store.format import Sample, holds_states, store_kind
from dflash_train.target import Features, check_fits


class StoreSet:
    """Several capture stores that must agree on target, tapped layers and hidden size, seen as one list: the
    training stores, then the replay stores (earlier rounds' samples, recipe data.replay_stores), whose samples are
    the indices from `replay_start` on."""

    def __init__(self, folders: list[str], replay: list[str] = ()):
        from dflash_train.store.reader import open_store

        if not folders:
            raise UserError("no capture store given (recipe key data.stores)")
        self.folders = [str(f) for f in [*folders, *replay]]
        self.stores = [open_store(f) for f in self.folders]
        self.num_replay_stores = len(replay)
        first = self.stores[0].manifest
        for k, (folder, store) in enumerate(zip(self.folders[1:], self.stores[1:]), start=1):
            what = f"replay store {folder} (data.replay_stores)" if self.is_replay(k) else f"store {folder}"
            check_fits(what, Features.of_store(store.manifest),
                       f"store {self.folders[0]} (stores trained together must match)", Features.of_store(first))
        self.index = [(s, i) for s, store in enumerate(self.stores) for i in range(len(store))]
        self.replay_start = sum(len(store) for store in self.stores[:len(self.stores) - self.num_replay_stores])
        self.manifest = first

    def is_replay(self, s: int) -> bool:
        """Whether store number `s` is a replay store."""
        return s >= len(self.stores) - self.num_replay_stores

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Sample:
        s, j = self.index[i]
        return self.stores[s][j]

    def length(self, i: int) -> int:
        s, j = self.index[i]
        return self.stores[s].length(j)

    def ids(self) -> list[str]:
        if not hasattr(self, "_ids"):
            self._ids = [i for store in self.stores for i in store.ids]
        return self._ids

    def summary(self, train_indices: list[int] | None = None) -> DataSummary:
        """Every store's counts and settings, and the totals; with replay stores, how many of their samples trained
        (of `train_indices`) out of how many they hold."""
        summary: DataSummary = {
            "stores": [{"path": f, "num_samples": s.manifest["num_samples"], "num_tokens": s.manifest["num_tokens"],
                        "generation": s.manifest.get("generation"), "storage_dtype": s.manifest["storage_dtype"],
                        "kind": store_kind(s.manifest), "replay": self.is_replay(k),
                        "ingest_report": s.manifest.get("ingest_report"), "prompts": s.manifest.get("prompts")}
                       for k, (f, s) in enumerate(zip(self.folders, self.stores))],
            "num_samples": len(self), "num_tokens": sum(s.manifest["num_tokens"] for s in self.stores)}
        if self.num_replay_stores and train_indices is not None:
            summary["replay_samples_trained"] = sum(i >= self.replay_start for i in train_indices)
            summary["replay_samples_total"] = len(self) - self.replay_start
        return summary


def _hash_fraction(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64


def split_eval(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a sample is held out iff the hash of its id falls below `fraction`."""
    held = [i for i, sid in enumerate(ids) if _hash_fraction("eval:" + sid) < fraction]
    held_set = set(held)
    return [i for i in range(len(ids)) if i not in held_set], held


def choose_replay(ids: list[str], candidates: list[int], limit: int | None) -> list[int]:
    """The replay samples that train (recipe data.replay_samples): at most `limit` of `candidates` (all where None),
    those whose id hashes lowest, in index order. A pure function of the ids, so the same samples train in every
    run and resume whatever the order of the replay stores."""
    if limit is None or limit >= len(candidates):
        return list(candidates)
    ranked = sorted(candidates, key=lambda i: (_hash_fraction("replay:" + ids[i]), ids[i]))
    return sorted(ranked[:limit])


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


def _common_topk(samples: list[list[Sample]]) -> int:
    """The top-k width all samples carry (the smallest: each top-k row is sorted), 0 if any sample has none."""
    return min(s["topk_ids"].shape[-1] if "topk_ids" in s else 0 for row in samples for s in row)


def collate(samples: list[list[Sample]], max_length: int) -> dict[str, torch.Tensor]:
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
    states = rows[0][0]["hidden_states"]  # on the CPU as stored, or where the target computed them (online)
    batch = {
        "input_ids": torch.zeros(b, S, dtype=torch.long),
        "loss_mask": torch.zeros(b, S, dtype=torch.bool),
        "hidden_states": torch.zeros(b, S, states.shape[-1], dtype=states.dtype, device=states.device),
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


def check_state_source(recipe: Recipe, stores: list[StoreSet]) -> None:
    """data.hidden_states: stored reads every store's states: a token-only store is one clear line."""
    if recipe.data.hidden_states != "stored":
        return
    for folder, store in ((f, s) for stores_ in stores for f, s in zip(stores_.folders, stores_.stores)):
        if not holds_states(store.manifest):
            raise UserError(f"store {folder} is token-only (captured with --storage none): it holds no hidden "
                            f"states, so recipe key data.hidden_states: stored cannot train on it; set "
                            f"data.hidden_states: online (the target computes the states during training)")


class OnlineStates:
    """data.hidden_states: online. The frozen target (eval mode, no gradients, the run's compute dtype, this rank's
    own replica on its device, never inside the module DeepSpeed wraps) computes the tapped states of the samples a
    step reads: one batched prefill per micro batch (`states.prefill_capture`, the computation `capture
    --responses logged` stores), every position, prompt included. Each sample is cut to max_length first: collate
    keeps no more, and under causal attention a prefix's states are those the whole sample would give it. States a
    store holds are replaced, never read."""

    def __init__(self, target, layer_ids: list[int], max_length: int):
        self.target, self.layer_ids, self.max_length = target, list(layer_ids), max_length

    def add(self, rows: list[list[Sample]]) -> list[list[Sample]]:
        """The same rows of samples, each with its computed `hidden_states` [min(S, max_length), n*H]."""
        from dflash_train.states import prefill_capture

        flat = [sample for row in rows for sample in row]
        got = prefill_capture(self.target.model, [s["input_ids"][:self.max_length].tolist() for s in flat],
                              [0] * len(flat), self.layer_ids, self.target.tokenizer.pad_token_id, on_device=True)
        states = iter(g.hidden_states for g in got)
        return [[{**sample, "hidden_states": next(states)} for sample in row] for row in rows]


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
    eval_samples: list[Sample]


def check_store_hashes(folders: list[str], rank: int = 0, world: int = 1) -> None:
    """Re-hash the shards of every store the run reads (store.verify.check_hashes: shards verified before on this
    machine and unchanged since are not hashed again), each rank its share; a corrupted shard stops every rank with
    one error naming it."""
    from dflash_train.store.verify import check_hashes

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


def prepare_data(recipe: Recipe, world: int) -> TrainData:
    """Open the stores, hold out the eval samples, choose the replay samples, and lay out the rows every step trains
    on. The eval split, the eval store and max_samples concern data.stores alone; the replay samples that train are
    added after them, none whose id is held out."""
    stores = StoreSet(recipe.data.stores, recipe.data.replay_stores)
    check_soft_labels(recipe, stores)
    eval_set = StoreSet([recipe.data.eval_store]) if recipe.data.eval_store else None
    check_state_source(recipe, [stores] + ([eval_set] if eval_set else []))
    ids, new = stores.ids(), range(stores.replay_start)
    if eval_set is not None:
        check_fits(f"eval store {recipe.data.eval_store}", Features.of_store(eval_set.manifest),
                   "the training stores", Features.of_store(stores.manifest))
        train_idx, held_ids = list(new), set(eval_set.ids())
        eval_samples = [eval_set[i] for i in range(min(len(eval_set), recipe.data.eval_samples))]
    else:
        train_idx, held = split_eval(ids[:stores.replay_start], recipe.data.eval_fraction)
        held_ids = {ids[i] for i in held}
        eval_samples = [stores[i] for i in held[:recipe.data.eval_samples]]
    if recipe.data.max_samples is not None:
        train_idx = train_idx[:recipe.data.max_samples]
    if not train_idx:
        raise UserError(f"no training samples left in {', '.join(recipe.data.stores)} after holding out the eval "
                        f"split")
    replay = [i for i in range(stores.replay_start, len(stores)) if ids[i] not in held_ids]
    train_idx += choose_replay(ids, replay, recipe.data.replay_samples)
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


def anchor_weights(batch: dict, copy_weight: float) -> torch.Tensor | None:
    """Anchor sampling weights [b, S]: copy_weight where the context holds the anchor's last two tokens already
    (objective.repeats_context), 1 elsewhere; None (uniform) when copy_weight is 1."""
    if copy_weight == 1.0:
        return None
    repeats = obj.repeats_context(batch["input_ids"], batch["doc_start"])
    return 1.0 + (copy_weight - 1.0) * repeats.float()


def context_scale(stores: StoreSet, indices: list[int], max_samples: int = 64,
                  online: OnlineStates | None = None) -> torch.Tensor:
    """Per-channel RMS of the tapped states over (up to) the first `max_samples` training samples, [n*H]: the
    stored ones, or those `online` computes.

    Position 0 is left out: its states (the attention sink) are hundreds of times larger than any other
    position's and would set the scale of the channels they touch."""
    total, count = None, 0
    for i in indices[:max_samples]:
        sample = online.add([[stores[i]]])[0][0] if online is not None else stores[i]
        states = sample["hidden_states"][1:].float().cpu()
        sq = states.pow(2).sum(dim=0)
        total = sq if total is None else total + sq
        count += states.shape[0]
    if not count:
        raise UserError("drafter.context_norm needs training samples of at least 2 tokens")
    return (total / count).sqrt().clamp(min=1e-3)
