"""Reading a finished capture store (the format: store/format.py): `open_store` checks the manifest and every
shard's header against it, and returns a `Store`, a memory-mapped sequence of samples."""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash_train.errors import UserError
from dflash_train.provenance import INCOMPLETE_MARKER, check_made_by
from dflash_train.store.format import (FORMAT, MANIFEST, STAGE, STORAGE_CHOICES, Manifest, Sample, ShardEntry,
                                       dequantize_fp8, holds_states, is_store_folder, read_json)


@dataclass
class _Shard:
    path: Path
    ids: list[str]
    offsets: torch.Tensor  # int64 [N+1]
    weights: torch.Tensor  # int64 [N]


class Store(Sequence):
    """A read-only store: `store[i]` -> {input_ids, loss_mask, hidden_states, id, weight} (no hidden_states in a
    token-only store), plus topk_ids (int64 [S, K]) and topk_logprobs (float32 [S, K]) when the store was captured
    with --store-topk K; memory-mapped.

    Each item reads only its own token range from its shard (safetensors slices over an mmap), so random
    access costs the sample's bytes, not the shard's. Safe to use from DataLoader workers: file handles are
    opened lazily per process."""

    def __init__(self, root: Path, manifest: Manifest, shards: list[_Shard]):
        self.root = root
        self.manifest = manifest
        self._shards = shards
        self._starts = [0]
        for shard in shards:
            self._starts.append(self._starts[-1] + len(shard.ids))
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()
        self.fp8 = manifest["storage_dtype"] == "fp8"
        self.has_states = holds_states(manifest)
        self.topk = int(manifest.get("topk", 0))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for a store of {len(self)}")
        s = bisect.bisect_right(self._starts, index) - 1
        return s, index - self._starts[s]

    def _handle(self, s: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked into a worker: mmaps are not shared safely, reopen
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            self._handles[s] = safe_open(str(self._shards[s].path), framework="pt")
        return self._handles[s]

    def length(self, index: int) -> int:
        """Token count of sample `index` without reading it (for length-bucketed batching)."""
        s, j = self._locate(index)
        offsets = self._shards[s].offsets
        return int(offsets[j + 1] - offsets[j])

    @property
    def ids(self) -> list[str]:
        return [i for shard in self._shards for i in shard.ids]

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        s, j = self._locate(index)
        shard = self._shards[s]
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        f = self._handle(s)
        item: Sample = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "id": shard.ids[j],
            "weight": int(shard.weights[j]),
        }
        if self.has_states:
            states = f.get_slice("hidden_states")[a:b]
            item["hidden_states"] = dequantize_fp8(states, f.get_slice("scales")[a:b]) if self.fp8 else states
        if self.topk:
            item["topk_ids"] = f.get_slice("topk_ids")[a:b].long()
            item["topk_logprobs"] = f.get_slice("topk_logprobs")[a:b].float()
        return item

    def tokens(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """(input_ids, loss_mask, weight) of every sample in order, without reading a state: each shard's token
        tensors are read once."""
        for s, shard in enumerate(self._shards):
            f = self._handle(s)
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            for j in range(len(shard.ids)):
                a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
                yield ids[a:b], mask[a:b], int(shard.weights[j])

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


REQUIRED_KEYS = ("format", "target", "target_layer_ids", "hidden_size", "num_tapped", "storage_dtype",
                 "generation", "num_samples", "num_tokens", "shards")


def load_manifest(root: Path) -> Manifest:
    """The manifest of a finished store folder, its values checked; a UserError says what the folder lacks."""
    if not root.exists():
        raise UserError(f"store {root} does not exist (run `dflash-train capture --out {root}` first)")
    if not root.is_dir():
        raise UserError(f"store {root} is a file: a store is the folder `dflash-train capture --out` writes")
    check_made_by(root, STAGE)
    if (root / INCOMPLETE_MARKER).exists() or (not (root / MANIFEST).exists() and is_store_folder(root)):
        raise UserError(f"store {root} is incomplete (no manifest.json, or an {INCOMPLETE_MARKER} marker): "
                        f"rerun the capture command that wrote it to finish it")
    if not (root / MANIFEST).exists():
        raise UserError(f"{root} is not a capture store (no {MANIFEST}): pass a folder `dflash-train capture --out` "
                        f"wrote")
    manifest = read_json(root / MANIFEST)
    missing = [k for k in REQUIRED_KEYS if k not in manifest] if isinstance(manifest, dict) else list(REQUIRED_KEYS)
    if missing or manifest.get("format") != FORMAT:
        raise UserError(f"{root / MANIFEST} is not a {FORMAT} manifest (missing keys: {', '.join(missing)})")
    if problem := _manifest_problem(manifest):
        raise UserError(f"{root / MANIFEST}: {problem}")
    if manifest["storage_dtype"] not in STORAGE_CHOICES:
        raise UserError(f"{root / MANIFEST}: unknown storage_dtype {manifest['storage_dtype']!r}")
    topk = manifest.get("topk", 0)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise UserError(f"{root / MANIFEST}: 'topk' must be an integer >= 0, got {topk!r}")
    return manifest


def _manifest_problem(manifest: Manifest) -> str | None:
    """What is wrong with the values the readers take from a manifest (a hand-edited or damaged one), or None."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in ("hidden_size", "num_tapped", "num_samples", "num_tokens"):
        if not count(manifest[key]):
            return f"{key!r} must be an integer >= 0, got {manifest[key]!r}"
    if not isinstance(manifest["target_layer_ids"], list) or not all(map(count, manifest["target_layer_ids"])):
        return f"'target_layer_ids' must be a list of layer numbers, got {manifest['target_layer_ids']!r}"
    if not isinstance(manifest["shards"], list):
        return f"'shards' must be a list, got {type(manifest['shards']).__name__}"
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict):
            return f"shards[{i}] is not an object"
        name = entry.get("file")
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            return f"shards[{i}] 'file' must be a file name inside the store, got {name!r}"
        for key in ("num_samples", "num_tokens", "bytes"):
            if not count(entry.get(key)):
                return f"shards[{i}] ({name}) {key!r} must be an integer >= 0, got {entry.get(key)!r}"
        if not isinstance(entry.get("sha256"), str):
            return f"shards[{i}] ({name}) has no 'sha256' string"
    return None


def read_shard(root: Path, entry: ShardEntry, manifest: Manifest) -> _Shard:
    """Open one shard's header and index, checking it against its manifest entry (size, counts, shapes)."""
    from safetensors import SafetensorError, safe_open

    path = root / entry["file"]
    if not path.exists():
        raise UserError(f"store {root}: shard {entry['file']} is missing")
    if path.stat().st_size != entry["bytes"]:
        raise UserError(f"store {root}: shard {entry['file']} has {path.stat().st_size} bytes, the manifest says "
                        f"{entry['bytes']} (truncated or replaced)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            ids = json.loads(meta["ids"])
            offsets = f.get_tensor("offsets")
            weights = f.get_tensor("weights")
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise UserError(f"store {root}: shard {entry['file']} is unreadable ({type(err).__name__}: {err})") from None
    n, t = entry["num_samples"], entry["num_tokens"]
    width = manifest["num_tapped"] * manifest["hidden_size"]
    expected = {"input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,), "weights": (n,)}
    if holds_states(manifest):
        expected["hidden_states"] = (t, width)
    if manifest["storage_dtype"] == "fp8":
        expected["scales"] = (t,)
    if manifest.get("topk", 0):
        expected["topk_ids"] = expected["topk_logprobs"] = (t, manifest["topk"])
    problems = [f"{k} has shape {shapes.get(k)}, expected {v}" for k, v in expected.items() if shapes.get(k) != v]
    if len(ids) != n:
        problems.append(f"{len(ids)} ids for {n} samples")
    if n and (int(offsets[0]) != 0 or int(offsets[-1]) != t or bool((offsets[1:] <= offsets[:-1]).any())):
        problems.append("offsets are not increasing from 0 to the token count")
    if problems:
        raise UserError(f"store {root}: shard {entry['file']} does not match the manifest: {'; '.join(problems)}")
    return _Shard(path=path, ids=ids, offsets=offsets, weights=weights)


def open_store(path: str | Path) -> Store:
    """Open a finished store folder for reading. Raises UserError naming the folder (and shard) if it is
    missing, incomplete or inconsistent. Cheap: reads the manifest and each shard's header and index only;
    `dflash-train verify` re-hashes the data."""
    root = Path(path)
    manifest = load_manifest(root)
    shards = [read_shard(root, entry, manifest) for entry in manifest["shards"]]
    if sum(len(s.ids) for s in shards) != manifest["num_samples"]:
        raise UserError(f"store {root}: the shards hold {sum(len(s.ids) for s in shards)} samples, the manifest "
                        f"says {manifest['num_samples']}")
    return Store(root, manifest, shards)
