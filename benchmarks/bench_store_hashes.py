"""What checking a store's shard hashes costs when training and eval open it (store.verify.check_hashes), cold and cached.

    python benchmarks/bench_store_hashes.py data/store/smollm2-demo [--threads N] [--repeats 3]

In this process, `--repeats` times each (the fastest counts: the machine may be shared): `open_store` alone (headers
and indexes, what opening a store cost before), `check_hashes` with an empty cache (every shard hashed, several at
once), `check_hashes` again with that cache (nothing changed: only stat calls), and hashlib's sha256 of the same bytes
in one thread. The shard files are read from the OS page cache after the first pass (the machine is shared, so the
cache is not dropped); a cold read adds the disk's read time. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def fastest(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="hashing threads (default: check_hashes' own)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from dflash_train.provenance import DIGEST_CACHE, sha256_file
    from dflash_train.store.reader import open_store
    from dflash_train.store.verify import check_hashes

    store = open_store(args.store)
    shards = [args.store / s["file"] for s in store.manifest["shards"]]
    nbytes = sum(p.stat().st_size for p in shards)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["DFLASH_TRAIN_CACHE"] = cache
        cache_file = Path(cache) / DIGEST_CACHE

        def cold():
            cache_file.unlink(missing_ok=True)
            return check_hashes(args.store, threads=args.threads)

        t_open, _ = fastest(lambda: open_store(args.store), args.repeats)
        t_cold, counts = fastest(cold, args.repeats)
        t_cached, cached = fastest(lambda: check_hashes(args.store, threads=args.threads), args.repeats)
        t_one, _ = fastest(lambda: [sha256_file(p) for p in shards], 1)
    assert counts["hashed"] == len(shards) and cached["hashed"] == 0, (counts, cached)
    gib = nbytes / 2**30
    print(f"store {args.store}: {store.manifest['num_samples']} samples, {store.manifest['num_tokens']:,} tokens, "
          f"{len(shards)} shard(s), {gib:.2f} GiB; {os.cpu_count()} CPU(s)")
    print()
    print("| what | seconds | GiB/s |")
    print("|---|---|---|")
    print(f"| open_store (headers and indexes only) | {t_open:.3f} | - |")
    print(f"| check_hashes, nothing verified yet (every shard hashed) | {t_cold:.2f} | {gib / t_cold:.2f} |")
    print(f"| check_hashes again, shards unchanged (cache) | {t_cached:.4f} | - |")
    print(f"| sha256 of the same files, one thread | {t_one:.2f} | {gib / t_one:.2f} |")


if __name__ == "__main__":
    main()
