"""The eval's timed protocol with the idle wait before each timed run (old) and without it on CPU (new), on the same
drafter and held-out requests: each speculator's speedup and tau with their 95% intervals, the ranking, and the
eval's seconds by its own clock.

    python results/eval_idle_wait/compare.py OLD_EVAL_DIR NEW_EVAL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def entries(report: dict) -> dict[str, dict]:
    v = report["engines"]["vllm"] if "engines" in report else report["vllm"]
    found = {"drafter": v}
    for key, name in (("ngram", "prompt lookup"), ("suffix", "suffix decoding"), ("combined", "combined")):
        if v.get(key):
            found[name] = v[key]
    return found, v


def main(old_dir: str, new_dir: str) -> None:
    old, old_v = entries(json.loads((Path(old_dir) / "report.json").read_text()))
    new, new_v = entries(json.loads((Path(new_dir) / "report.json").read_text()))
    print("| speculator | K | old: speedup [95%] | new: speedup [95%] | new in old's interval | old: tau | new: tau |")
    print("|---|---|---|---|---|---|---|")
    for name in old:
        o, n = old[name], new[name]
        lo, hi = o["speedup_interval"]
        nlo, nhi = n["speedup_interval"]
        print(f"| {name} | {o.get('k', o.get('best_k'))} | {o['speedup']:.3f} [{lo:.3f}, {hi:.3f}] | {n['speedup']:.3f} [{nlo:.3f}, {nhi:.3f}]"
              f" | {'yes' if lo <= n['speedup'] <= hi else 'NO'} | {o.get('tau_steps', o.get('tau')):.2f} | "
              f"{n.get('tau_steps', n.get('tau')):.2f} |")
    rank = lambda v: " > ".join(r["speculator"] for r in v["ranking"])  # noqa: E731
    print(f"\nranking old: {rank(old_v)}\nranking new: {rank(new_v)}")
    print(f"engine seconds (the eval's timing.seconds): old {old_v['timing']['seconds']:.0f}, "
          f"new {new_v['timing']['seconds']:.0f}; host drift old {old_v['timing']['host_drift']:.1%}, "
          f"new {new_v['timing']['host_drift']:.1%}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
