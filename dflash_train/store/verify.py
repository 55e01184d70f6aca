"""Checking a finished capture store's bytes: `verify_store` (every problem, for `dflash-train verify`, this
module's command) and `check_hashes` (the first corrupted shard, as training and eval check a store they open;
cached per shard)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.provenance import known_sha256, remember_sha256, sha256_file
from dflash_train.store.format import holds_states
from dflash_train.store.reader import load_manifest, read_shard

# what a Ctrl-C leaves in `dflash-train verify`, this module's command (errors.run_as_command prints it)
INTERRUPTED = "verify only reads the store: nothing was changed; rerun the same command to verify"


def verify_store(path: str | Path) -> list[str]:
    """Every problem found in a store (empty list = sound): re-hashes each shard and checks the manifest."""
    root = Path(path)
    manifest = load_manifest(root)
    problems: list[str] = []
    seen: set[str] = set()
    verified: dict[Path, str] = {}
    total_samples = total_tokens = 0
    from tqdm import tqdm

    for entry in tqdm(manifest["shards"], desc="verify", unit="shard", leave=False):
        name = entry["file"]
        if not (root / name).exists():
            problems.append(f"shard {name}: missing")
            continue
        if (root / name).stat().st_size != entry["bytes"]:
            problems.append(f"shard {name}: {(root / name).stat().st_size} bytes, manifest says {entry['bytes']} "
                            f"(truncated or replaced)")
            continue
        digest = sha256_file(root / name)
        if digest != entry["sha256"]:
            problems.append(f"shard {name}: sha256 {digest[:16]}... does not match the manifest's "
                            f"{entry['sha256'][:16]}... (corrupted)")
            continue
        try:
            shard = read_shard(root, entry, manifest)
        except UserError as err:
            problems.append(str(err))
            continue
        duplicates = seen.intersection(shard.ids)
        if duplicates or len(set(shard.ids)) != len(shard.ids):
            problems.append(f"shard {name}: duplicate sample ids {sorted(duplicates)[:5]}")
        seen.update(shard.ids)
        verified[root / name] = digest
        total_samples += entry["num_samples"]
        total_tokens += entry["num_tokens"]
    if not problems and (total_samples, total_tokens) != (manifest["num_samples"], manifest["num_tokens"]):
        problems.append(f"manifest totals ({manifest['num_samples']} samples, {manifest['num_tokens']} tokens) "
                        f"differ from the shards' ({total_samples}, {total_tokens})")
    if not problems:  # training and eval need not hash these shards again while they are unchanged
        remember_sha256(verified)
    return problems


def check_hashes(path: str | Path, threads: int | None = None, rank: int = 0, world: int = 1) -> dict[str, int]:
    """Re-hash the shards of a finished store against its manifest, as training and eval do when they open one: a
    UserError names the first shard whose bytes are not the ones captured. A shard this machine verified before and
    that has not changed since (same size, mtime and inode) is not hashed again (provenance.known_sha256): the
    capture that wrote it (it hashed each shard as it wrote it), `dflash-train verify` and this check remember the
    digests they computed. Several shards are hashed at once (hashlib releases the GIL); with
    `world` > 1 this process checks only shards i with i % world == rank (the ranks of a run share the work).
    Returns {"hashed": n, "cached": m, "bytes_hashed": b}. `dflash-train verify` always re-hashes everything."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    root = Path(path)
    manifest = load_manifest(root)
    mine = [entry for i, entry in enumerate(manifest["shards"]) if i % world == rank]
    for entry in mine:
        if not (root / entry["file"]).exists():
            raise UserError(f"store {root}: shard {entry['file']} is missing")
    known = known_sha256([root / entry["file"] for entry in mine])
    todo = [entry for entry in mine if known.get(root / entry["file"]) != entry["sha256"]]
    hashed_bytes = sum((root / entry["file"]).stat().st_size for entry in todo)
    verified = {}
    with tqdm(total=hashed_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"check {root.name}",
              leave=False, disable=not todo) as bar, \
            ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        def hash_one(entry):
            shard = root / entry["file"]
            digest = sha256_file(shard)
            bar.update(shard.stat().st_size)
            return entry, digest

        for entry, digest in pool.map(hash_one, todo):
            if digest != entry["sha256"]:
                raise UserError(f"store {root}: shard {entry['file']} is corrupted (its sha256 {digest[:16]}... is not "
                                f"the manifest's {entry['sha256'][:16]}...): recapture it (rerun the capture into a "
                                f"new folder), or restore the file; `dflash-train verify {root}` lists every bad shard")
            verified[root / entry["file"]] = digest
    if verified:
        remember_sha256(verified)
    return {"hashed": len(todo), "cached": len(mine) - len(todo), "bytes_hashed": hashed_bytes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="a store folder written by `dflash-train capture`")


def run(args: argparse.Namespace) -> int:
    problems = verify_store(args.store)
    if problems:
        for problem in problems:
            print(f"FAIL {args.store}: {problem}")
        print(f"verify {args.store}: {len(problems)} problem(s)")
        return 1
    m = load_manifest(Path(args.store))
    size = sum(entry["bytes"] for entry in m["shards"])  # what verify_store checked, file by file
    per_token = size / m["num_tokens"] if m["num_tokens"] else 0.0
    floor = m.get("floor_bytes_per_token")
    floor = floor if isinstance(floor, (int, float)) and floor > 0 else None
    print(f"verify {args.store}: OK: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} "
          f"shard(s), {size / 2**20:.1f} MiB, {per_token:.1f} bytes/token"
          + (f" vs floor {floor} ({100 * (per_token / floor - 1):+.2f}%)" if floor else "")
          + ", "
          f"{m['storage_dtype'] if holds_states(m) else 'token-only (no hidden states)'}, layers "
          f"{m['target_layer_ids']}, dropped {m.get('dropped') or 'none'}")
    return 0
