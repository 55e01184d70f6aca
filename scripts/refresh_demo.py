"""`make refresh-demo`: two days of one service's logs, each a `dflash-train refresh` round, as an operator runs them.

    python scripts/refresh_demo.py [--workdir .] [--capture-limit 240] [--train-s 330,360]

Day 1 (data/workloads/drift_day1.jsonl.gz) is the router under its schema; the drafter serving is the shipped general
one. Day 2 (drift_day2.jsonl.gz) is mostly a second structured application gone live, a help desk's ticket triage under
its own schema, beside new router requests and some of day 1's again. Each day is one command:

    dflash-train refresh data/workloads/drift_day1.jsonl.gz --serving drafters/smollm2-135m-instruct-general ...
    dflash-train refresh data/workloads/drift_day2.jsonl.gz --serving <day 1's release, or the general drafter> ...

and then day 2's command once more, which finds its round done and makes no new one. Every round measures the
serving drafter's drift on its new held-out requests, trains a candidate warm-started from it (day 2 replaying day
1's answers), evaluates both side by side in vLLM on the new held-out requests and on day 1's, and releases the
candidate only where it wins. The releases are folders (refresh --no-push: no Hub here; `tests/test_refresh_command.py`
pushes to a loopback Hub). A day killed anywhere reruns to the same result: rerun the demo.

At the end: the rounds' table (drift, the candidate against the serving drafter on each traffic, the decision) and
each day's wall time, in WORKDIR/results/refresh-demo/results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_train.errors import CommandParser, UserError
from dflash_train.options import int_list
from dflash_train.support import runs

REPO = runs.REPO
DAYS = [REPO / "data" / "workloads" / "drift_day1.jsonl.gz", REPO / "data" / "workloads" / "drift_day2.jsonl.gz"]
GENERAL = REPO / "drafters" / "smollm2-135m-instruct-general"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=".", help="where refresh/ and results/ go (default: the repo's root)")
    p.add_argument("--capture-limit", type=int, default=240, help="new training prompts each day captures")
    p.add_argument("--train-s", type=int_list, default=[330, 360], metavar="S1,S2",
                   help="each day's training budget in seconds (train.time_budget_s)")
    p.add_argument("--eval-limit", type=int, default=20, help="held-out requests of each traffic in each eval")
    p.add_argument("--eval-dtype", default="fp32", choices=["auto", "bf16", "fp32"],
                   help="the evals' dtype: fp32 checks losslessness in fp32 at once (in bf16 a near-tie can flip a "
                        "token, and every prompt that differs is rerun in fp32: a minute an eval on a CPU)")
    p.add_argument("--extra", action="append", default=[], metavar="FLAG",
                   help="one more flag for every refresh command, repeatable (e.g. --extra=--eval-limit=10)")
    args = p.parse_args(argv)
    if len(args.train_s) != len(DAYS):
        p.error(f"--train-s: give one budget per day ({len(DAYS)})")
    return args


def refresh_command(log: Path, serving: Path, out: Path, args: argparse.Namespace, train_s: int) -> list[str]:
    return [runs.PY, "-m", "dflash_train", "refresh", str(log), "--serving", str(serving), "--no-push",
            "--out", str(out), "--capture-limit", str(args.capture_limit), "--max-new-tokens", "128",
            "--eval-limit", str(args.eval_limit), "--train-override", f"train.time_budget_s={train_s}",
            "--train-override", "eval.every=0", f"--eval-override=--dtype={args.eval_dtype}", *args.extra]


def run_day(name: str, command: list[str], days: list[dict]) -> None:
    """Run one refresh command (its own stages print as they go), timed; a failure stops the demo with its error."""
    import shlex
    import subprocess

    print(f"\n######## {name}: {runs.display_command(command)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"stopped: {name} failed (exit {result.returncode}) after {seconds:.0f} s; its error is "
                         f"above. Rerun the demo to resume it.\ncommand: {shlex.join(command)}")
    days.append({"day": name, "command": runs.display_command(command), "seconds": round(seconds, 1)})


def serving_after(ledger: dict, number: int) -> Path | None:
    """The release folder of round `number`, where it released one."""
    rnd = ledger["rounds"][number - 1] if len(ledger["rounds"]) >= number else None
    if rnd and (rnd.get("release") or {}).get("released"):
        return Path(rnd["release"]["folder"])
    return None


def summary(ledger: dict, days: list[dict]) -> str:
    def num(x, digits=3):
        return "?" if x is None else f"{x:.{digits}f}"

    def iv(x):
        return f" [{num(x[0])}, {num(x[1])}]" if x else ""

    rows = []
    for r in ledger["rounds"]:
        figures, release = r.get("figures") or {}, r.get("release") or {}
        drift = figures.get("drift") or {}
        compared = [v for k, v in figures.items() if k.startswith("against serving")]
        rows.append([f"{r['number']}", ", ".join(log["name"] for log in r["logs"]),
                     f"{len(r['train'])} / {len(r['eval'])} / {len(r['seen'])}",
                     f"{drift.get('verdict', '-')}: {num(drift.get('tau'))}{iv(drift.get('tau_interval'))} vs card "
                     f"{num(drift.get('card_tau'))}" if drift else "-",
                     "; ".join(f"{c['traffic']}: {num(c['tau_candidate'])} vs {num(c['tau_serving'])}, "
                               f"x{num(c['tau_ratio'])}{iv(c['tau_ratio_interval'])}, speed "
                               f"x{num(c['speedup_ratio'])}" for c in compared) or "-",
                     "released" if release.get("released") else "kept the serving drafter"])
    table = runs.markdown_table(["round", "logs", "new train / held out / seen", "drift (serving drafter, tau)",
                                 "candidate vs serving (tau, paired)", "decision"], rows)
    walls = runs.markdown_table(["run", "wall"], [[d["day"], f"{d['seconds']:.0f} s"] for d in days])
    total = sum(d["seconds"] for d in days)
    return "\n\n".join([table, walls, f"All runs: {total:.0f} s ({total / 60:.1f} min)."])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    out = work / "refresh" / "demo"
    for day in DAYS:
        if not day.exists():
            raise UserError(f"{day} is missing: it ships with the repository (data/workloads/make_workloads.py)")
    days: list[dict] = []
    started = time.time()
    run_day("day 1", refresh_command(DAYS[0], GENERAL, out, args, args.train_s[0]), days)
    ledger = json.loads((out / "rounds.json").read_text())
    released = serving_after(ledger, 1)
    serving = out / released if released else GENERAL
    run_day("day 2", refresh_command(DAYS[1], serving, out, args, args.train_s[1]), days)
    run_day("day 2 again", refresh_command(DAYS[1], serving, out, args, args.train_s[1]), days)
    ledger = json.loads((out / "rounds.json").read_text())
    if len(ledger["rounds"]) != 2:
        raise UserError(f"{out / 'rounds.json'} holds {len(ledger['rounds'])} rounds after day 2 twice, not 2")
    md = "\n\n".join([runs.header("The refresh demo: two days of logs, each a round against the serving drafter",
                                  "scripts/refresh_demo.py"),
                      f"Started {time.strftime('%H:%M', time.localtime(started))}; the refresh folder: {out}.",
                      summary(ledger, days)])
    rounds = [{**r, **{key: len(r[key]) for key in ("train", "eval", "seen")}} for r in ledger["rounds"]]  # counts
    runs.write_results(work / "results" / "refresh-demo", md, {"rounds": rounds, "days": days, "settings": vars(args)},
                       [], runs.Log(), work)
    return 0


if __name__ == "__main__":
    runs.script_main(main)
