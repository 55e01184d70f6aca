"""What a drafter's LM head costs a speculative step in vLLM, and what a draft vocabulary cut to the service's own
answers saves: the same drafter timed with the target's whole head and with only the rows of the tokens its
training answers use, by the eval's protocol, on the same held-out requests under their constraints.

    python benchmarks/bench_draft_vocab.py --drafter runs/triage/drafter --store data/store/triage \
        --prompts data/prompts/triage [--heldout data/store/triage-eval] [--sizes 0,4096] [--k 4] [--out DIR]

A DFlash drafter scores its block with the target's LM head, and on SmolLM2 that head (49,152 x 576) holds more than
twice the weights of the drafter's three layers: on a CPU, where a decoding step costs much of what it reads, the
head is a large share of what drafting adds to a verification step. vLLM's DFlash model reads an optional draft
vocabulary (`draft_vocab_size` in config.json, the head's rows as `lm_head.weight` and `d2t`, each draft id's offset
to its target id, as EAGLE-3 ships it). This script writes that copy of the drafter, its head rows the target's own,
unchanged, for the `size` token ids the store's answers use most (0: every id they use; EOS always in; past those,
the ids its prompts use most: what recipe drafter.draft_vocab_size exports), and times each copy in its own engine
job (`engine.child._timed`: every prompt decoded plain to its natural stop, then timed plain and speculative at that
length, alone and cold). Tokens outside the vocabulary cannot be drafted, so tau may fall; what it saves is each
step's cost in plain steps, measured inside each job beside its own plain decoding, and each prompt's speedup against
the whole head's (paired by prompt, with a 95% interval), by the engine's clock and by a stopwatch around each
request. `--heldout` (a held-out store) adds how many of its answer tokens each vocabulary covers. The copies are cut
after training, as the export cuts them: this measures the serving side alone. Prints a markdown table and writes
OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from dflash_train.device import resolve_precision
from dflash_train.engine.jobs import EngineRequest
from dflash_train.model.checkpoint import create_drafter, draft_vocabulary, load_drafter, read_config, save_drafter
from dflash_train.stages.evaluate.metrics import bootstrap_interval, ratio_of_sums
from dflash_train.stages.train.data import StoreSet
from dflash_train.stages.train.draft_vocab import choose, token_counts
from dflash_train.support import runs
from dflash_train.target import DEFAULT_TARGET, load_embedding_and_head, load_target

from bench_grammar_cost import heldout_requests, step_costs, timed_at_k  # benchmarks/, beside this file


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a DFlash drafter folder with the target's whole head (recipe "
                   "drafter.draft_vocab_size unset)")
    p.add_argument("--store", required=True, help="the capture store the drafter was trained on: its answers "
                   "choose the vocabulary")
    p.add_argument("--prompts", required=True, help="an ingest output folder (its held-out split is timed)")
    p.add_argument("--heldout", help="a held-out store: how many of its answer tokens each vocabulary covers")
    p.add_argument("--sizes", default="0,4096", help="draft vocabulary sizes, comma-separated (0: every token id "
                   "the store's answers use)")
    p.add_argument("--split", default="eval")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--k", type=int, default=4, help="speculation length")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="results/bench_draft_vocab")
    return p.parse_args()


def vocabulary(answers: Counter, prompts: Counter, size: int, always: list[int]) -> list[int]:
    """The training export's choice (stages/train/draft_vocab.choose) at `size`; 0: every id the answers use."""
    return choose(answers, Counter() if not size else prompts, size or len(always) + len(answers), always)


def cut_drafter(drafter: Path, head: torch.Tensor, ids: list[int], out: Path) -> None:
    """A copy of `drafter` drafting only `ids`, as the training export writes it (checkpoint.draft_vocabulary)."""
    shutil.copytree(drafter, out, ignore=shutil.ignore_patterns("*.safetensors"))
    model, config = load_drafter(drafter)
    dtype = model.fc.weight.dtype
    config, rows = draft_vocabulary(config, head, ids)
    cut = create_drafter(config)
    cut.load_state_dict({**model.state_dict(), **rows}, strict=True)
    save_drafter(cut.to(dtype), config, out)


def timed_job(drafter: Path, label: str, requests: list[EngineRequest], target, precision, args) -> dict:
    """The eval's timed protocol at K for one drafter folder: per prompt, plain and speculative seconds (the decode
    phase and the stopwatch) and the speculative steps; summed (`step_costs`), the step's cost in plain steps and the
    decode speedup."""
    result = timed_at_k(args, target, precision, str(drafter), requests, label)
    costs, run = step_costs(result), result.timed["runs"][0]
    steps = {o["id"]: len(o["accepted"]) for o in run["outputs"]}
    per_prompt = {t["id"]: {"tokens": t["tokens"], "steps": steps[t["id"]], "plain_s": min(t["plain_decode_s"]),
                            "spec_s": min(t["spec_decode_s"]), "plain_wall_s": min(t["plain_wall_s"]),
                            "spec_wall_s": min(t["spec_wall_s"])} for t in run["batch1"]}
    return {"prompts": costs["prompts"], "tau": costs["tokens_per_step"],
            "step_cost_in_plain_steps": costs["step_cost_in_plain_steps"], "speedup_decode": costs["speedup_decode"],
            "per_prompt": per_prompt}


def against(f: dict, whole: dict, clock: str = "") -> tuple[float, list[float] | None]:
    """The speedup of `f` over that of the whole head's job, paired by prompt (each prompt's plain and speculative
    seconds from its own job; `clock` "": the engine's decode phase, "wall_": the stopwatch around each request):
    the ratio of the mean per-prompt speedups, with its 95% bootstrap interval over prompts."""
    ids = sorted(f["per_prompt"])
    a = [whole["per_prompt"][i][f"plain_{clock}s"] / whole["per_prompt"][i][f"spec_{clock}s"] for i in ids]
    b = [f["per_prompt"][i][f"plain_{clock}s"] / f["per_prompt"][i][f"spec_{clock}s"] for i in ids]
    ratio = ratio_of_sums(b, a)
    return ratio(list(range(len(ids)))), bootstrap_interval(ratio, len(ids))


def main() -> int:
    args = parse_args()
    drafted = read_config(args.drafter).draft_vocab_size
    if drafted:
        print(f"bench_draft_vocab: {args.drafter} already drafts a draft vocabulary of {drafted:,} ids: pass one "
              f"trained with recipe drafter.draft_vocab_size unset (the whole head)", file=sys.stderr)
        return 2
    precision = resolve_precision(args.dtype, "cpu")
    target = load_target(args.target, dtype=precision.dtype)
    _, head = load_embedding_and_head(args.target, dtype=torch.float32)
    def every_sample(folder: str) -> tuple[Counter, Counter]:
        stores = StoreSet([folder])
        return token_counts(stores, list(range(len(stores))))

    answers, prompt_tokens = every_sample(args.store)
    heldout = every_sample(args.heldout)[0] if args.heldout else None
    requests = heldout_requests(args, target)
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vocab-drafters-") as tmp:
        drafters = {f"whole head ({head.shape[0]:,} rows)": (Path(args.drafter), None)}
        for size in (int(s) for s in args.sizes.split(",")):
            ids = vocabulary(answers, prompt_tokens, size, target.stop_token_ids())
            folder = Path(tmp) / f"vocab-{len(ids)}"
            cut_drafter(Path(args.drafter), head, ids, folder)
            drafters[f"{len(ids):,} rows" + (" (every id the answers use)" if not size else "")] = (folder, ids)
        for label, (folder, ids) in drafters.items():
            f = timed_job(folder, label, requests, target, precision, args)
            if heldout is not None:
                inside = heldout.total() if ids is None else sum(heldout[t] for t in set(ids))
                f["heldout_coverage"] = inside / heldout.total()
            figures[label] = f
            print(label, json.dumps({k: v for k, v in f.items() if k != "per_prompt"}), flush=True)
    whole, *cut = figures.values()
    for f in cut:
        f["speedup_against_whole"], f["speedup_against_whole_interval"] = against(f, whole)
        f["stopwatch_against_whole"], f["stopwatch_against_whole_interval"] = against(f, whole, "wall_")

    def paired_cell(f: dict, key: str) -> str | None:
        if key not in f:
            return None
        interval = f[f"{key}_interval"]
        return f"{f[key]:.3f}" + (" [{:.3f}, {:.3f}]".format(*interval) if interval else "")

    rows = [[label, f["prompts"], f.get("heldout_coverage"), f["tau"], f["step_cost_in_plain_steps"],
             f["speedup_decode"], paired_cell(f, "speedup_against_whole"), paired_cell(f, "stopwatch_against_whole")]
            for label, f in figures.items()]
    table = runs.markdown_table(["drafter's head", "prompts", "held-out answer tokens covered", "tau (decode)",
                                 "a step in plain steps", "speedup (decode phase)",
                                 "against the whole head, paired by prompt",
                                 "the same by a stopwatch around each request"], rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "answer_ids": len(answers),
                                                  "figures": figures}, indent=1) + "\n")
    (out / "results.md").write_text(f"# A draft vocabulary cut to the answers (K = {args.k})\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
