"""Running the pipeline from a script: what the demo and the experiments (scripts/), the benchmarks (benchmarks/) and
the probes (probes/) share.

Running a stage's command with its wall time and a clear failure message; skipping a stage whose output folder is
complete (and was made by the same command); parsing `NAME:key=value,key=value` variants; reading a run's
metrics.jsonl and an eval report.json (through dflash_train.eval_report) into table rows; plotting curves;
describing the machine; writing results.
Like cli.py, it sits above the stages (it runs their commands from the checkout's root and reads what they wrote),
not among the services they stand on; `dflash-train refresh` runs each round's stages through it. Everything here
except running commands is pure and covered by tests/test_scripts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dflash_train import eval_report
from dflash_train.errors import UserError
from dflash_train.eval_report import EvalReport, MethodRow
from dflash_train.options import at_least
from dflash_train.provenance import PROVENANCE_FILE, is_complete, without_local_paths, write_json_atomic
from dflash_train.report_tables import by_role, table

REPO = Path(__file__).resolve().parents[2]  # the checkout's root: train.py, recipes/, data/
PY = sys.executable
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --- overrides and variants -----------------------------------------------------------------------------------


def split_overrides(text: str, where: str = "overrides") -> list[str]:
    """`a.b=1,c.d=[x,y]` -> ['a.b=1', 'c.d=[x,y]']: commas inside [] or {} belong to the value."""
    items, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise UserError(f"{where} {text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise UserError(f"{where} {text!r}: unbalanced brackets")
    items.append(current)
    items = [i.strip() for i in items if i.strip()]
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip() or " " in key.strip():
            raise UserError(f"{where} {text!r}: {item!r} is not of the form key=value")
    return items


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME:k=v,k=v` (or a bare `NAME`: the base recipe unchanged) -> (NAME, ['k=v', 'k=v'])."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not NAME_RE.match(name):
        raise UserError(f"--variant {text!r}: the name {name!r} must be letters, digits, '_', '-' or '.'")
    return name, split_overrides(rest, where=f"--variant {name}")


def parse_sizes(text: str) -> list[int | None]:
    """`32,96,all` -> [32, 96, None] (None = every sample); sizes must be positive and distinct."""
    sizes: list[int | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "all":
            value = None
        elif part.isdigit() and int(part) > 0:
            value = int(part)
        else:
            raise UserError(f"--sizes {text!r}: {part!r} is neither a positive integer nor 'all'")
        if value in sizes:
            raise UserError(f"--sizes {text!r}: {part!r} is listed twice")
        sizes.append(value)
    if not sizes:
        raise UserError("--sizes is empty")
    return sizes


def add_common_arguments(p: argparse.ArgumentParser, name: str, out: str) -> None:
    """The options both experiment scripts share (their defaults are filled in by `fill_defaults`)."""
    p.add_argument("--workdir", default=".", help="where data/prompts, data/store and runs/ go (default: repo root)")
    p.add_argument("--name", default=None, help=f"names the stores and runs (default: {name}, or {name}-quick)")
    p.add_argument("--prompts", default="data/prompts/sharegpt", help="ingest folder, relative to --workdir")
    p.add_argument("--recipe", default="recipes/smollm2-135m-demo.yaml")
    p.add_argument("--limit", type=int, default=None, help="training prompts read for capture (default 600)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped (capture, eval)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="response cap at capture (default 128)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out prompts read for eval (default 40)")
    p.add_argument("--eval-max-new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    p.add_argument("--quick", action="store_true", help="tiny smoke settings (a few minutes on 2 CPU cores)")
    p.add_argument("--out", default=None, help=f"results folder (default {out}, or {out}-quick)")


def folder_name(value: str | None) -> str | None:
    """A --name's check (dflash_train.options.Check): it names folders under --workdir, so no path in it."""
    if value is None or NAME_RE.match(value):
        return None
    return "must be letters, digits, '_', '-' or '.' (it names folders under --workdir)"


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace, checks: dict[str, Callable]) -> None:
    """Each flag's check (dflash_train.options) before any stage runs: one line naming the flag, exit 2."""
    for flag, check in checks.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if problem := check(value):
            p.error(f"{flag} {value!r} {problem}")


def fill_defaults(p: argparse.ArgumentParser, args: argparse.Namespace, full: dict[str, Any], quick: dict[str, Any],
                  name: str, out: str) -> argparse.Namespace:
    """Options left unset take the --quick or the full default; --quick also renames the stores, runs and OUT.
    Then the shared options are checked (one line, exit 2, before any stage runs)."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    suffix = "-quick" if args.quick else ""
    args.name = args.name or f"{name}{suffix}"
    args.out = args.out or f"{out}{suffix}"
    check_options(p, args, {"--name": folder_name, **{flag: at_least(1) for flag in (
        "--limit", "--max-prompt-tokens", "--max-new-tokens", "--eval-limit", "--eval-max-new-tokens")}})
    try:
        parse_sizes(args.sizes)
    except UserError as err:
        p.error(str(err))
    return args


# --- stages -------------------------------------------------------------------------------------------------------


@dataclass
class Log:
    """The commands a script ran (or found done), with their wall times, for results.md."""

    stages: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, command: list[str], seconds: float | None, skipped: bool) -> None:
        self.stages.append({"stage": name, "command": display_command(command),
                            "seconds": None if seconds is None else round(seconds, 1), "skipped": skipped})


def normalized(command: list[str]) -> list[str]:
    """The command as a user types it: `python`, and paths inside the repo relative to its root (so a record
    still matches from another interpreter path or another checkout)."""
    root = f"{REPO}/"
    return ["python" if c == PY else c.replace(root, "") for c in command]


def display_command(command: list[str]) -> str:
    return shlex.join(normalized(command))


def record_path(folder: Path) -> Path:
    """Beside the folder (never inside it: stores and drafters are shipped as they are)."""
    return folder.with_name(folder.name + ".command.json")


def stage_decision(folder: Path, command: list[str]) -> str:
    """'skip' when `folder` is complete and was made by this command, 'run' when it is not complete; a complete
    folder recorded as made by another command is an error (its results would be silently mixed up)."""
    if not is_complete(folder):
        return "run"
    record = record_path(folder)
    if record.exists():
        made_by = json.loads(record.read_text()).get("command")
        if made_by != normalized(command):
            raise UserError(f"{folder} is complete but was made by another command:\n  {shlex.join(made_by)}\n"
                            f"this run needs:\n  {display_command(command)}\n"
                            f"delete {folder} and {record.name} (for a training run, the whole run folder: its "
                            f"checkpoints would be resumed), or pick another --name or --workdir")
    return "skip"


def recorded_seconds(folder: Path) -> float | None:
    """The wall time an earlier run of this stage recorded (None: no record)."""
    record = record_path(folder)
    return json.loads(record.read_text()).get("seconds") if record.exists() else None


def run_stage(name: str, folder: Path, command: list[str], log: Log, env: dict[str, str] | None = None,
              rerun: bool = False, verdict_exit: int | None = None) -> int:
    """Run `command` unless `folder` is already complete (or always, with `rerun`: a quick stage whose output
    should reflect the latest inputs); stop the script with a clear message if it fails. `verdict_exit`: an exit
    status that gives the stage's verdict rather than a failure where the stage completed its folder in this run
    (`push --dry-run` exits 2 where the gate would refuse the real push, its preview written). Returns the exit
    status: 0, or `verdict_exit` where that was the verdict."""
    if not rerun and stage_decision(folder, command) == "skip":
        print(f"\n=== {name}: {folder} is complete, skipping (delete it to redo this stage)", flush=True)
        log.add(name, command, recorded_seconds(folder), skipped=True)
        return 0
    print(f"\n=== {name}: {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    started = time.time()
    result = subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    verdict = result.returncode == verdict_exit and is_complete(folder) and \
        (folder / PROVENANCE_FILE).stat().st_mtime >= started - 1
    if result.returncode != 0 and not verdict:
        print(f"\nstopped: stage {name!r} failed (exit {result.returncode}) after {seconds:.0f} s; its error is "
              f"above.\ncommand: {shlex.join(command)}\nFix it and rerun: finished stages are skipped.",
              file=sys.stderr, flush=True)
        raise SystemExit(result.returncode or 1)
    if not is_complete(folder):
        raise UserError(f"stage {name!r} exited 0 but {folder} is not complete (no provenance.json, or INCOMPLETE)")
    record_path(folder).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record_path(folder), {"command": normalized(command), "seconds": round(seconds, 1),
                                            "finished": time.strftime("%Y-%m-%d %H:%M %Z")})
    log.add(name, command, seconds, skipped=False)
    print(f"=== {name}: done in {seconds:.0f} s" + (f" (exit {result.returncode}: its verdict, above)" if verdict
                                                     else ""), flush=True)
    return result.returncode


def capture_command(prompts: Path, store: Path, split: str, limit: int, max_prompt_tokens: int,
                    max_new_tokens: int, extra: list[str] = (), batch_size: int = 16) -> list[str]:
    return [PY, "-m", "dflash_train", "capture", "--prompts", str(prompts), "--split", split, "--out", str(store),
            "--limit", str(limit), "--max-prompt-tokens", str(max_prompt_tokens),
            "--max-new-tokens", str(max_new_tokens), "--batch-size", str(batch_size), *extra]


def train_command(recipe: str, run_dir: Path, overrides: list[str]) -> list[str]:
    return [PY, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "train.py", recipe,
            f"name={run_dir.name}", f"output_dir={run_dir}", *overrides]


def budget_overrides(steps: int | None, time_budget: float | None, eval_every: int) -> list[str]:
    """The same training budget for every run: a step count, or a wall-clock budget (steps then only a cap)."""
    out = [f"eval.every={eval_every}", "eval.at_end=true"]
    if time_budget is not None:
        out += [f"train.time_budget_s={time_budget}", f"train.max_steps={steps or 1_000_000}"]
    else:
        out.append(f"train.max_steps={steps}")
    return out


def eval_command(drafters: list[Path], prompts: Path, limit: int, max_prompt_tokens: int, max_new_tokens: int,
                 store: Path | None, out: Path, engine: str = "own", extra: list[str] = ()) -> list[str]:
    """The eval stage's command; experiments compare drafters in the project's loop (`own`: no vLLM start-ups per
    run), the demo evaluates in vLLM too."""
    command = [PY, "-m", "dflash_train", "eval", "--engine", engine, *extra, "--drafter", str(drafters[0])]
    for other in drafters[1:]:
        command += ["--baseline-drafter", str(other)]
    command += ["--prompts", str(prompts), "--split", "eval", "--limit", str(limit),
                "--max-prompt-tokens", str(max_prompt_tokens), "--max-new-tokens", str(max_new_tokens)]
    if store is not None:
        command += ["--store", str(store)]
    return command + ["--out", str(out)]


def ingest_command(prompts: Path, logs: list[str] = (), extra: list[str] = ()) -> list[str]:
    return [PY, "-m", "dflash_train", "ingest", *logs, "--out", str(prompts), *extra]


def push_command(drafter: Path, repo: str, report: Path, out: Path, extra: list[str] = ()) -> list[str]:
    return [PY, "-m", "dflash_train", "push", str(drafter), "--repo", repo, "--eval-report", str(report),
            "--out", str(out), *extra]


def verify_command(store: Path) -> list[str]:
    return [PY, "-m", "dflash_train", "verify", str(store)]


def ensure_prompts(prompts: Path, log: Log) -> None:
    """Ingest the demo traffic (the ShareGPT package) into `prompts` unless it is there already."""
    if not is_complete(prompts):
        run_stage("ingest", prompts, ingest_command(prompts), log)


def train_runs(recipe: str, plan: dict[str, tuple[Path, list[str]]], common: list[str], log: Log) -> None:
    """One training run per entry of `plan` (label -> (run folder, overrides)), `common` overrides first."""
    for label, (run_dir, overrides) in plan.items():
        run_stage(f"train ({label})", run_dir / "drafter", train_command(recipe, run_dir, [*common, *overrides]),
                  log, {"WANDB_MODE": "disabled"})


def store_ids(store: Path) -> list[str]:
    from dflash_train.store.reader import open_store

    return list(open_store(store).ids)


# --- reading results ----------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path} does not exist (did the training run finish?)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {n} is not JSON: {err}") from None
    return rows


TRAIN_TIME = ("train_time", "time")  # training seconds (evals excluded) where the trainer logs them, else wall time


def sim_tau(row: dict[str, Any]) -> float | None:
    """The simulated tau of a metrics.jsonl eval row (`eval_sim_tau`; runs before the rename logged `eval_tau`)."""
    return row.get("eval_sim_tau", row.get("eval_tau"))


def eval_curve(metrics: Path, x: str | tuple[str, ...] = "step") -> list[tuple[float, float]]:
    """(x, simulated tau) of every eval row of a run's metrics.jsonl, in order; x is a row key ('step',
    'time') or a tuple of keys, the first one a row has wins (TRAIN_TIME)."""
    keys = (x,) if isinstance(x, str) else x
    points = []
    for row in read_jsonl(metrics):
        if row.get("kind") == "eval" and sim_tau(row) is not None:
            key = next((k for k in keys if k in row), None)
            if key is None:
                raise UserError(f"{metrics}: an eval row at step {row.get('step')} has none of {', '.join(keys)}")
            points.append((float(row[key]), float(sim_tau(row))))
    return points


def run_summary(metrics: Path) -> dict[str, Any]:
    """Steps done, training seconds and the last simulated tau of one run."""
    rows = read_jsonl(metrics)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    return {"steps": max((r["step"] for r in train), default=0),
            "train_s": max((r.get("train_time", r.get("time", 0.0)) for r in rows), default=0.0),
            "final_sim_tau": sim_tau(evals[-1]) if evals else None,
            "final_sim_acc": evals[-1].get("eval_acc") if evals else None}


def read_report(path: Path, own: bool = True) -> EvalReport:
    """An eval report.json (path to the file or to its folder), through dflash_train.eval_report; with `own`, one
    where the project's loop ran (the experiments compare drafters there)."""
    report = eval_report.load(path)
    if own and report.own is None:
        raise UserError(f"eval report {path} has no run of the project's loop (eval --engine own or both)")
    return report


def method_for(report: EvalReport, drafter: Path) -> MethodRow:
    """The report's row of one drafter in the project's loop (matched by its resolved folder)."""
    want = Path(drafter).resolve()
    methods = report.own.methods if report.own else []
    for m in methods:
        if m.drafter and Path(m.drafter).resolve() == want:
            return m
    raise UserError(f"the eval report has no method for drafter {drafter} "
                    f"(methods: {', '.join(str(m.drafter) for m in methods)})")


def plain_tokens_per_s(report: EvalReport) -> float | None:
    plain = by_role(report.own.methods if report.own else [], "plain")
    return plain[0].tokens_per_s if plain else None


def online_row(report: EvalReport, drafter: Path, positions: int = 3) -> dict[str, Any]:
    """tau (over all steps), the first `positions` per-position acceptances, tokens/s and its ratio to plain
    decoding: a row of an experiment's results."""
    m = method_for(report, drafter)
    acc = list(m.per_position_acceptance)
    plain = plain_tokens_per_s(report)
    tps = m.tokens_per_s
    return {"online_tau": m.tau_steps, "acceptance": acc, "acceptance_first": acc[:positions],
            "tokens_per_s": tps, "tokens_per_s_plain": plain,
            "tokens_per_s_ratio": tps / plain if tps is not None and plain else None,
            "lossless_mismatches": m.lossless_mismatches}


def run_rows(plan: dict[str, tuple[Path, list[str]]], report: EvalReport) -> dict[str, dict[str, Any]]:
    """Per run (label -> (run folder, overrides)): its training summary and its online eval row."""
    return {label: {"run": str(run_dir), "overrides": overrides, **run_summary(run_dir / "metrics.jsonl"),
                    **online_row(report, run_dir / "drafter")} for label, (run_dir, overrides) in plan.items()}


# --- writing results ----------------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):
        return " / ".join(fmt(v, digits) for v in value)
    return str(value)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """report_tables.table, each cell formatted by this module's fmt (3 digits; None as "-")."""
    return table([tuple(fmt(c) for c in row) for row in rows], tuple(headers))


def plot_curves(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str,
                out: Path, marker: str = "o") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_description() -> str:
    try:
        cpu = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = platform.processor() or "unknown CPU"
    text = f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}"
    try:
        import torch

        if torch.cuda.is_available():
            text += ", GPU " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        else:
            text += ", no GPU"
    except ImportError:
        pass
    return text


def commands_section(log: Log) -> str:
    lines = ["## Commands", "", "Every stage, in order, with its wall time:", ""]
    for s in log.stages:
        took = "time not recorded" if s["seconds"] is None else f"{s['seconds']:.0f} s"
        lines.append(f"- {s['stage']} ({took}{', in an earlier run' if s['skipped'] else ''}):"
                     f"\n  `{s['command']}`")
    return "\n".join(lines)


WORKDIR = "WORKDIR"  # how results name the --workdir


def portable(obj: Any, work: Path | None = None) -> Any:
    """`obj` (a string, or JSON-like data at any depth) as results are committed and published: paths inside the
    repo relative to its root, the --workdir written as WORKDIR, any other absolute local path cut to its last
    component (provenance.without_local_paths). Nothing in results names a folder of the machine it was made on."""
    roots = sorted({REPO: "", **({Path(work).resolve(): WORKDIR} if work else {})}.items(),
                   key=lambda item: -len(str(item[0])))

    def relative(text: str) -> str:
        for root, name in roots:  # the longest first: a workdir inside the repo is still WORKDIR
            text = re.sub(re.escape(str(root)) + r"(/|(?![\w.-]))",
                          lambda m: (f"{name}/" if name else "") if m.group(1) else (name or "."), text)
        return text

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return relative(value)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return without_local_paths(walk(obj))


def write_results(out: Path, markdown: str, data: dict[str, Any], pngs: list[Path], log: Log,
                  work: Path | None = None) -> None:
    """OUT/results.md + OUT/results.json (with the stages run and the machine), portable (no local folder named),
    and print them."""
    out.mkdir(parents=True, exist_ok=True)
    markdown = portable(markdown, work)
    (out / "results.md").write_text(markdown)
    write_json_atomic(out / "results.json",
                      portable({**data, "stages": log.stages, "machine": machine_description()}, work))
    print("\n" + "=" * 80 + "\n" + markdown)
    print(f"results: {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {p}" for p in pngs))


def header(title: str, script: str) -> str:
    """Title, machine, date and the command line that reproduces this run of `script` (its path from the repo's
    root, as a user types it: scripts/experiment_warm_start.py)."""
    invocation = shlex.join(["python", script, *sys.argv[1:]])
    return (f"# {title}\n\nMachine: {machine_description()}. Date: {time.strftime('%Y-%m-%d %H:%M %Z')}.\n\n"
            f"Reproduce: `{invocation}`")


def eval_description(report: EvalReport, limit: int, max_prompt_tokens: int, max_new_tokens: int) -> str:
    return (f"Online eval: {report.settings.num_prompts} held-out prompts (the first {limit} of the eval split, "
            f"those under {max_prompt_tokens} prompt tokens), {max_new_tokens} new tokens, "
            f"{report.settings.sampling}; plain decoding {fmt(plain_tokens_per_s(report), 1)} tokens/s.")


def script_main(main: Callable[[], int]) -> None:
    """Run a script's main; a UserError is one clear line on stderr and exit status 2, not a traceback."""
    try:
        sys.exit(main())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
