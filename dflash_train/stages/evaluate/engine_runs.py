"""vLLM's runs for the eval (vllm_sweep): each a process of its own (engine.runner.run_engine), the prompts an
engine run refuses kept, so that every later run leaves them out and the figures leave them out of every
comparison (vllm_sweep.taken)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflash_train.engine import runner
from dflash_train.engine.jobs import FREE_NAMES, VLLM_DTYPES, EngineJob, EngineRequest, EngineResult
from dflash_train.errors import UserError
from dflash_train.stages.evaluate.config import EvalConfig
from dflash_train.target import Target, prompt_seed


@dataclass
class EngineRunner:
    """Runs vLLM for the eval (`engine`: runner.run_engine, a process of its own each time, in workdir/tag) and keeps
    what each run refused; called, the prompts by id, each under its request's `constraints`, plain and with the
    drafter at the K given, and says what it runs. `first` and `source`: the sweep's first K and the estimate that
    chose it, for that line. The first --baseline-drafter, where given, is timed beside the drafter's first K in the
    timed run (the job's free "baseline"; EvalConfig's check allows one with vLLM)."""
    cfg: EvalConfig
    target: Target
    device: str
    workdir: Path
    prompts: dict[str, list[int]]  # the eval's
    constraints: dict[str, dict[str, Any] | None]
    max_len: int  # every run's max_model_len: the longest prompt, its new tokens and a block
    first: int | None = None
    source: str | None = None
    refused: dict[str, str] = field(default_factory=dict)  # by any run so far: id -> the engine's reason (`taken`)
    # the fp32 rechecks so far (lossless_at_best_k), by the combined speculator's setting (None: the drafter's): each
    # prompt's verdict at a K, and their seconds
    rechecked: dict[tuple[str | None, int, str], bool] = field(default_factory=dict)
    recheck_s: dict[str | None, float] = field(default_factory=dict)

    @property
    def baseline(self) -> str | None:
        """The baseline drafter vLLM times beside the drafter: the first --baseline-drafter, if any."""
        return self.cfg.baseline_drafters[0] if self.cfg.baseline_drafters else None

    def __call__(self, ids: dict[str, list[int]], dtype: str, tag: str, ks: list[int], concurrency: list[int],
                 budget_s: float | None, mode: str = "timed", combined: str | None = None
                 ) -> tuple[EngineJob, EngineResult]:
        cfg = self.cfg
        requests = [EngineRequest(id=rid, prompt_token_ids=p, max_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, seed=prompt_seed(cfg.seed, rid),
                                  constraints=self.constraints.get(rid))
                    for rid, p in ids.items()]
        job = EngineJob(target=str(self.target.path), requests=requests,
                        stop_token_ids=self.target.stop_token_ids(), dtype=VLLM_DTYPES[dtype],
                        drafter=cfg.drafter, baseline_drafter=self.baseline, max_model_len=self.max_len, mode=mode,
                        seed=cfg.seed,
                        device=torch.device(self.device).type, engine_args=cfg.engine_args,
                        speculative_tokens=ks, concurrency=concurrency, repeats=cfg.repeats, budget_s=budget_s,
                        free=([("baseline", ks[0])] * bool(self.baseline) + [("ngram", k) for k in cfg.ngram]
                              + [("suffix", k) for k in cfg.suffix] if mode == "timed" else []), combined=combined,
                        free_limit=cfg.free_limit if mode == "timed" else None)
        budget = f", {budget_s:.0f} s budget" if budget_s is not None and len(ks) > 1 else ""
        if self.first is not None and mode == "timed":
            budget += f"; K = {self.first} first, " + (
                f"the best expected speed by the {self.source} at a step cost of {cfg.step_cost[0]:.2f} + "
                f"{cfg.step_cost[1]:.3f} x K plain steps" if cfg.step_cost else
                f"the shortest that keeps tau by the {self.source}")
        if job.free:
            budget += "; beside the first, sharing plain decoding's runs: " + ", ".join(
                f"{FREE_NAMES[method]}" + (f" {self.baseline}" if method == "baseline" else "") + f" at K = {k}"
                for method, k in job.free)
        speculator = f"the combined speculator ({combined}) with drafter" if combined else "with drafter"
        print(f"engine: vLLM, plain and {speculator} {cfg.drafter} at K = {', '.join(map(str, ks))} "
              f"({len(ids.keys() - self.refused.keys())} prompts, concurrency 1"
              f"{''.join(f', {c}' for c in concurrency)}, {dtype}{budget}"
              f"{', the lossless check alone' if mode == 'check' else ''})",
              flush=True)
        return job, self.engine(job, tag, f"vLLM with drafter {cfg.drafter}")

    def engine(self, job: EngineJob, tag: str, what: str) -> EngineResult:
        """`job` in vLLM (in workdir/tag; `what` names it in errors) without the prompts an earlier run refused; those
        it refuses join `refused`, named in one line. Every prompt refused: one line, nothing to evaluate."""
        result = runner.run_engine(replace(job, requests=[r for r in job.requests if r.id not in self.refused]),
                                   self.workdir / tag, what)
        if result.refused:
            self.refused |= result.refused
            if not self.prompts.keys() - self.refused.keys():
                rid, why = next(iter(self.refused.items()))
                raise UserError(f"{self.cfg.prompts}: vLLM refused all {len(self.refused)} prompts (e.g. {rid}: "
                                f"{why}): nothing to evaluate")
            print(f"engine: vLLM refused {len(result.refused)} prompt(s), left out of every comparison: "
                  + "; ".join(f"{rid}: {why}" for rid, why in result.refused.items()), flush=True)
        return result
