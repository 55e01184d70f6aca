"""Does a change to the eval's timing protocol measure the same speedups, in less time?

The same `dflash-train eval` twice, one after the other on this machine: once with the package of an OLD source tree
(a clone at the commit before the change), once with this one (or --new), each under a stopwatch, run from the output
folder with the tree and its entry points first on the path (so the eval's paths are given absolute). Then, per
speculator timed (the drafter at its best K, prompt lookup, suffix decoding, the combined speculator): each run's
speedup over plain decoding and its 95% interval, whether the new speedup lies in the old run's interval, each one's
tau, the ranking, the engine's seconds by the eval's own clock and each run's stopwatch.

    python benchmarks/bench_eval_protocol.py --old /tmp/old-clone --out /tmp/NAME \
        -- --engine vllm --drafter $PWD/runs/router_json/drafter --prompts $PWD/data/prompts/router_json ...

Run it on a quiet machine: a speedup measured while something else runs moves (the eval's own host-drift line says
when), and two runs minutes apart are compared here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SPECULATORS = (("drafter", None), ("prompt lookup", "ngram"), ("suffix decoding", "suffix"), ("combined", "combined"))


def package_metadata(tree: Path, folder: Path) -> Path:
    """A dist-info in `folder` carrying the entry points of `tree`'s pyproject.toml: vLLM finds the combined
    speculator's plugin through them, and the installed package's name the plugin where the installed tree has it
    (put first on the path, this one is found before it)."""
    import tomllib

    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    info = folder / f"dflash_train-{project.get('version', '0')}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: "
                                   f"{project.get('version', '0')}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
        for group, points in project.get("entry-points", {}).items()))
    return folder


def run_eval(tree: Path, out: Path, eval_args: list[str]) -> float:
    """`dflash-train eval EVAL_ARGS --out OUT` with the package of source tree `tree` (and its plugin's entry point),
    run from OUT's folder (`python -m` puts the working folder first on the path: a tree's own stale egg-info would
    name another plugin); its stopwatch seconds (its output in OUT.log)."""
    meta = package_metadata(tree, out.parent / f"{out.name}-metadata")
    env = {**os.environ, "PYTHONPATH": f"{meta}:{tree}"}
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run([sys.executable, "-m", "dflash_train", "eval", *eval_args, "--out", str(out)],
                              cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: eval exited with {done.returncode}: see {out.with_suffix('.log')}")
    return time.perf_counter() - started


def entries(report: dict) -> tuple[dict[str, dict], dict]:
    """Each speculator's entry in a report.json (the drafter's is the vLLM entry itself), and the vLLM entry."""
    vllm = report["vllm"]
    return {name: vllm if key is None else vllm[key] for name, key in SPECULATORS
            if key is None or vllm.get(key)}, vllm


def comparison(old_report: dict, new_report: dict, walls: dict[str, float]) -> str:
    """The markdown table and lines the benchmark writes (comparison.md)."""
    old, old_v = entries(old_report)
    new, new_v = entries(new_report)
    lines = ["| speculator | K | old: speedup [95%] | new: speedup [95%] | new in old's interval | old: tau | "
             "new: tau |", "|---|---|---|---|---|---|---|"]
    for name in old.keys() & new.keys():
        o, n = old[name], new[name]
        (lo, hi), (nlo, nhi) = o["speedup_interval"], n["speedup_interval"]
        k = o.get("best_k", o.get("k"))
        lines.append(f"| {name} | {k} | {o['speedup']:.3f} [{lo:.3f}, {hi:.3f}] | {n['speedup']:.3f} "
                     f"[{nlo:.3f}, {nhi:.3f}] | {'yes' if lo <= n['speedup'] <= hi else 'NO'} | "
                     f"{o['tau_steps']:.2f} | {n['tau_steps']:.2f} |")

    def ranked(v: dict) -> str:
        return " > ".join(r["speculator"] for r in v["ranking"])

    lines += ["", f"ranking old: {ranked(old_v)}", f"ranking new: {ranked(new_v)}",
              f"engine seconds (the eval's timing.seconds): old {old_v['timing']['seconds']:.0f}, new "
              f"{new_v['timing']['seconds']:.0f}; host drift old {old_v['timing']['host_drift']:.1%}, new "
              f"{new_v['timing']['host_drift']:.1%}",
              f"stopwatch around each eval command: old {walls['old']:.0f} s, new {walls['new']:.0f} s"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the source tree of the protocol before (a clone)")
    p.add_argument("--new", type=Path, default=HERE, help="the source tree after (default: this one)")
    p.add_argument("--out", type=Path, required=True, help="a folder for both evals and comparison.md")
    p.add_argument("--first", choices=["old", "new"], default="new", help="which runs first (default: new)")
    p.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then the eval's arguments, without --out")
    args = p.parse_args(argv)
    eval_args = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    walls = {}
    for side in (args.first, "old" if args.first == "new" else "new"):
        tree = (args.old if side == "old" else args.new).resolve()
        print(f"bench_eval_protocol: {side} ({tree})", flush=True)
        walls[side] = run_eval(tree, out / side, eval_args)
        print(f"bench_eval_protocol: {side} took {walls[side]:.0f} s", flush=True)
    reports = {side: json.loads((out / side / "report.json").read_text()) for side in ("old", "new")}
    text = comparison(reports["old"], reports["new"], walls)
    (out / "comparison.md").write_text(text)
    (out / "command.json").write_text(json.dumps({"eval_args": eval_args, "first": args.first,
                                                  "walls_s": walls}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
