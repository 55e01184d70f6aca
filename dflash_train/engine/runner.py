"""Running a job: `run_engine(job)` writes it to a folder, starts vLLM in a child process on it
(`python -m dflash_train.engine.child JOB_DIR`, see `child`) and returns what it decoded and measured; an engine
that failed is one UserError with the engine's own reason (`engine_error`) and its log's path; a request the engine
refused is not a failure: the result names it (`EngineResult.refused`) and holds the others' outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dflash_train.engine import install
from dflash_train.engine.jobs import EngineJob, EngineOutput, EngineResult
from dflash_train.errors import UserError

JOB_FILE, RESULT_FILE, LOG_FILE = "job.json", "result.json", "engine.log"


def run_engine(job: EngineJob, workdir: str | Path, what: str, timeout_s: float | None = None) -> EngineResult:
    """Run `job` in a vLLM child process; `what` names the run in errors ("vLLM with drafter runs/x/drafter").

    The child's log goes to WORKDIR/engine.log; a failure raises one UserError with the engine's own last error
    line and the log's path."""
    install.check_vllm()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    for name in (RESULT_FILE, LOG_FILE):
        (work / name).unlink(missing_ok=True)
    (work / JOB_FILE).write_text(json.dumps(asdict(job)))
    env = {**os.environ, **install.engine_environment(job.device)}
    log_path = work / LOG_FILE
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train.engine.child", str(work)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        if not wait_showing_progress(proc, log_path, timeout_s):
            proc.kill()
            proc.wait()
            raise UserError(f"{what}: the vLLM engine did not finish within {timeout_s:.0f} s; its log: "
                            f"{log_path}")
    result_file = work / RESULT_FILE
    if proc.returncode != 0 or not result_file.exists():
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
        raise UserError(f"{what}: the vLLM engine {how}: {engine_error(log_path)} (full log: {log_path})")
    raw = json.loads(result_file.read_text())
    return EngineResult(version=raw["version"], llm_kwargs=raw["llm_kwargs"], load_s=raw["load_s"],
                        wall_s=raw["wall_s"], outputs=[EngineOutput(**o) for o in raw["outputs"]],
                        environment=raw["environment"], timed=raw.get("timed"), refused=raw.get("refused") or {},
                        capture_sample=[EngineOutput(**o) for o in raw.get("capture_sample") or []],
                        capture_sample_s=raw.get("capture_sample_s") or 0.0)


PROGRESS = "timed: "  # the child's line after each K it timed (child._timed): minutes apart in an eval's sweep


def wait_showing_progress(proc: subprocess.Popen, log_path: Path, timeout_s: float | None,
                          every_s: float = 2.0) -> bool:
    """Wait for the engine's child, printing each of its PROGRESS lines from its log as it comes (an eval's sweep
    runs for minutes in the child); False if it is still running after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = ""
    with open(log_path, errors="replace") as log:
        while True:
            try:
                proc.wait(timeout=every_s if deadline is None else max(0.0, min(every_s, deadline - time.monotonic())))
                done = True
            except subprocess.TimeoutExpired:
                done = False
            *lines, pending = (pending + log.read()).split("\n")
            for line in lines + ([pending] if done else []):
                if line.startswith(PROGRESS):
                    print(f"engine: {line[len(PROGRESS):]}", flush=True)
            if done:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def engine_error(log_path: Path) -> str:
    """The engine's own message: the last exception line of its log that is not a wrapper (vLLM re-raises a
    worker's failure as 'EngineDeadError' / 'Engine core initialization failed. See root cause above', so the
    line before those is the one to show)."""
    try:
        lines = [_message(ln) for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    wrappers = ("Engine core initialization failed", "EngineDeadError", "SystemExit")
    errors = [i for i, ln in enumerate(lines) if _is_exception(ln) and not any(w in ln for w in wrappers)]
    if errors:
        i = errors[-1]
        message = lines[i]
        detail = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if detail.startswith("Value error"):  # pydantic puts the reason on the next line
            message += ": " + detail.split(" [type=")[0]
        return message[:500]
    tail = [ln for ln in lines if ln]
    return tail[-1][:500] if tail else "no output"


def _message(line: str) -> str:
    """A log line without vLLM's `(Process pid=N) LEVEL date time [file.py:line] ` prefix or torch.distributed's
    `[rank0]: ` (what an in-process engine's traceback lines start with)."""
    line = re.sub(r"^\[rank\d+\]:", "", line.strip()).strip()
    return line.split("] ", 1)[1].strip() if line.startswith("(") and "] " in line else line


def _is_exception(message: str) -> bool:
    head = message.split(":", 1)[0]
    return ":" in message and " " not in head and head.rsplit(".", 1)[-1].endswith(("Error", "Exception"))
