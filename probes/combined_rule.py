"""Which block to verify at each step: the drafter's, prompt lookup's or the suffix tree's? The rule of a combined
speculator, measured offline on held-out answers before any of it runs in an engine (issues 46 and 59, step 1).

    python probes/combined_rule.py --drafter runs/NAME/drafter --eval-store data/store/NAME-eval \
        [--k-drafter 9] [--k-lookup 4] [--limit 20] [--no-suffix] [--against DRAFTER [--served RULE]] \
        [--out results/combined_rule/NAME]

The suffix tree (suffix.SuffixSource, fed as vLLM's suffix proposer feeds it) is replayed over the held-out answers in
the store's order, the order the eval sends them to the engine: at each anchor it holds the request's prompt and
answer so far and the answers before it, never an answer the engine would not have produced yet (suffix.replay_answer).

At every response anchor of each held-out sample (its captured states, no target forward) the drafter drafts a block
(objective.simulated_acceptance, with its probability of its first draft) and prompt lookup drafts one
(probes/ngram_baseline.lookup_lengths: vLLM's `ngram` rule, with the length of the suffix it matched). A rule picks
one source per step from what is known before the target verifies: whether lookup found a match and how long, and
the drafter's confidence. Each rule is walked through the answer as greedy decoding walks it (the first step at the
first response token, the next at the anchor after what the last committed: objective.decoding_walk, with a
choice at each step), so tau is tokens per verification step, mean over samples, as the eval counts it.

Speed: a step's cost in plain decoding steps, linear in K, from the eval's own measurements on this CPU (tau /
speedup of each speculator's rows; `--drafter-cost A,B` = A + B * K, `--lookup-cost` likewise). A step costs a drafter
step wherever the rule asked the drafter (its confidence), and prompt lookup's step where it did not (the engine
skips the drafter's pass there; its cache of the context's states is still written); the bound where every lookup
step costs lookup's alone is given beside it. Writes OUT/results.json and OUT/results.md. With --against, the
served rule walked with a second drafter on the same answers, paired by answer (walked tau, modelled speed): how two
drafters compare as the combined speculator's model source (the complementary objective's experiment).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ngram_baseline import lookup_lengths, segment_ends

from dflash_train.model.checkpoint import load_drafter
from dflash_train.objective import all_anchors, decoding_walk, simulated_acceptance
from dflash_train.spec_decode.lookup import SUFFIX_SCORE, CombinedRule, parse_combined
from dflash_train.spec_decode.suffix import SuffixSource, replay_answer
from dflash_train.spec_decode.walk import accepted_length
from dflash_train.store.reader import open_store
from dflash_train.support import runs
from dflash_train.target import DEFAULT_TARGET, load_embedding_and_head

# Rules: (name, chooser(anchor row) -> ("lookup" | "suffix" | "drafter", whether the drafter ran this step)). A rule
# that picks without the drafter's confidence need not run the drafter where it picks a free block: the engine skips
# it. The plugin's rules are CombinedRule's own (`plugin_rule`).
def plugin_rule(rule: CombinedRule):
    def choose(row: dict) -> tuple[str, bool]:
        ran = rule.needs_drafter(row["score"], row["slen"], row["n"])
        return rule.source(row["score"], row["slen"], row["n"], row["p"] if ran else None), ran
    return choose


RULES = [("drafter always", lambda row: ("drafter", True)),
         ("lookup always", lambda row: ("lookup", False)),
         ("lookup where it matched 2+ tokens", lambda row: ("lookup" if row["n"] >= 2 else "drafter", True)),
         ("lookup where it matched 3 tokens", lambda row: ("lookup" if row["n"] >= 3 else "drafter", True))]
RULES += [(f"lookup where it matched, unless the drafter's first draft has p >= {c}" if c < 1 else
           "lookup where it matched, the drafter not asked there (confidence 1)", plugin_rule(CombinedRule(confidence=c)))
          for c in (0.5, 0.6, 0.7, 0.9, 1.0)]
SUFFIX_RULES = [("suffix decoding alone (its block always)", lambda row: ("suffix", False)),
                ("suffix where it drafted, else the drafter", lambda row: ("suffix" if row["slen"] else "drafter",
                                                                           not row["slen"]))]
SUFFIX_RULES += [(f"suffix where its score >= {s:g}, else lookup/drafter at confidence {c:g}",
                  plugin_rule(CombinedRule(confidence=c, suffix=s)))
                 for c in (0.6, 1.0) for s in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--eval-store", required=True, help="a held-out capture store with hidden states")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--k-drafter", type=int, default=9)
    p.add_argument("--k-lookup", type=int, default=4)
    p.add_argument("--drafter-cost", default="1.44,0.04", help="A,B: a drafter step at K costs A + B*K plain steps")
    p.add_argument("--lookup-cost", default="0.99,0.04", help="A,B: a prompt-lookup (or suffix) step at K, the same way")
    p.add_argument("--k-suffix", type=int, default=None, help="the suffix tree's block at most (default: --k-drafter, "
                   "the combined engine's K)")
    p.add_argument("--no-suffix", action="store_true", help="leave the suffix tree out (no arctic-inference)")
    p.add_argument("--against", default=None, metavar="DRAFTER", help="also walk the served rule (--served) with this "
                   "drafter on the same answers, paired by answer against --drafter")
    p.add_argument("--served", default=None, metavar="RULE", help="the rule --against walks (a DFLASH_TRAIN_LOOKUP "
                   "setting; default: confidence 0.6 with the suffix tree at SUFFIX_SCORE)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def anchor_table(drafter, embed, head, sample: dict, block_size: int, k_lookup: int,
                 suffix: tuple[SuffixSource, str, int] | None = None) -> list[dict]:
    """Per anchor (in order): its position, the drafter's acceptance length and first-draft probability, lookup's
    acceptance length (at most k_lookup drafts) and matched suffix length; with `suffix` (the tree, the request's
    id, its block at most), the tree's acceptance length, its draft's score and length (the sample replayed into
    the tree: samples go through here in request order)."""
    confidence: list[float] = []
    lengths = simulated_acceptance(drafter, embed, head, sample, block_size=block_size, confidence=confidence).tolist()
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].bool().tolist()
    matched: list[int] = []
    looked = lookup_lengths(ids, mask, k_lookup + 1, matched)
    positions = all_anchors(sample["loss_mask"][None], block_size).anchors[0].tolist()
    rows = [{"at": a, "drafter": d, "p": p, "lookup": c, "n": n, "suffix": 1, "score": 0.0, "slen": 0}
            for a, d, p, c, n in zip(positions, lengths, confidence, looked, matched, strict=True)]
    if suffix is not None:
        tree, req_id, k_suffix = suffix
        end = segment_ends(mask)
        for row, draft in zip(rows, replay_answer(tree, req_id, ids, positions, k_suffix), strict=True):
            row |= {"suffix": 1 + accepted_length(draft.token_ids, ids, row["at"] + 1, end[row["at"] + 1]),
                    "score": draft.score, "slen": len(draft.token_ids)}
    return rows


def walk(rows: list[dict], choose, k_drafter: int, k_lookup: int) -> list[tuple[str, int, bool]]:
    """The steps a rule takes through one answer: (source, tokens committed, whether the drafter ran), as greedy
    decoding walks (objective.decoding_walk). A rule reads only its anchor's own row, so each anchor's choice is
    made up front."""
    picked = [choose(row) for row in rows]
    committed = [min(row[source], (k_lookup if source == "lookup" else k_drafter) + 1)  # a suffix draft is capped
                 for row, (source, _) in zip(rows, picked)]
    return [(picked[i][0], committed[i], picked[i][1]) for i in decoding_walk([row["at"] for row in rows], committed)]


def step_costs(args: argparse.Namespace) -> tuple[float, float]:
    """A drafter step's and a free step's cost in plain decoding steps (--drafter-cost, --lookup-cost at their K)."""
    da, db = map(float, args.drafter_cost.split(","))
    la, lb = map(float, args.lookup_cost.split(","))
    return da + db * args.k_drafter, la + lb * args.k_lookup


def answer_walks(tables: list[list[dict]], choose, args: argparse.Namespace
                 ) -> tuple[list[float], list[int], list[float]]:
    """Per answer, the tokens a rule commits, its steps and their modelled cost (plain decoding steps)."""
    drafter_step, lookup_step = step_costs(args)
    tokens, counts, costs = [], [], []
    for rows in tables:
        steps = walk(rows, choose, args.k_drafter, args.k_lookup)
        tokens.append(float(sum(t for _, t, _ in steps)))
        counts.append(len(steps))
        costs.append(sum(drafter_step if ran else lookup_step for _, _, ran in steps))
    return tokens, counts, costs


def against(mine: list[list[dict]], theirs: list[list[dict]], choose, args: argparse.Namespace) -> dict:
    """The same rule walked with two drafters on the same answers (their anchor tables, in the same order), paired
    by answer: walked tau (per answer, mean over answers) and modelled speed (tokens over cost), each the ratio of
    this drafter's to the other's with a 95% bootstrap interval over answers."""
    from dflash_train.stages.evaluate.metrics import bootstrap_interval

    (tok_a, steps_a, cost_a), (tok_b, steps_b, cost_b) = answer_walks(mine, choose, args), \
        answer_walks(theirs, choose, args)
    tau_a = [t / n for t, n in zip(tok_a, steps_a)]
    tau_b = [t / n for t, n in zip(tok_b, steps_b)]

    def tau_ratio(idx):
        return sum(tau_a[i] for i in idx) / sum(tau_b[i] for i in idx)

    def speed_ratio(idx):
        return (sum(tok_a[i] for i in idx) / sum(cost_a[i] for i in idx)) / \
            (sum(tok_b[i] for i in idx) / sum(cost_b[i] for i in idx))
    every = list(range(len(mine)))
    return {"answers": len(mine), "tau": sum(tau_a) / len(tau_a), "tau_against": sum(tau_b) / len(tau_b),
            "speedup": sum(tok_a) / sum(cost_a), "speedup_against": sum(tok_b) / sum(cost_b),
            "tau_ratio": tau_ratio(every), "tau_ratio_interval": bootstrap_interval(tau_ratio, len(mine)),
            "speed_ratio": speed_ratio(every), "speed_ratio_interval": bootstrap_interval(speed_ratio, len(mine))}


def evaluate_rules(tables: list[list[dict]], args: argparse.Namespace) -> list[dict]:
    drafter_step, lookup_step = step_costs(args)
    results = []
    for name, choose in RULES + (SUFFIX_RULES if args.suffix else []):
        taus, tokens, cost, cost_bound, from_lookup, skipped, n_steps = [], 0, 0.0, 0.0, 0, 0, 0
        from_suffix = 0
        for rows in tables:
            steps = walk(rows, choose, args.k_drafter, args.k_lookup)
            taus.append(sum(t for _, t, _ in steps) / len(steps))
            tokens += sum(t for _, t, _ in steps)
            n_steps += len(steps)
            looked = sum(s != "drafter" for s, _, _ in steps)  # a free block, lookup's or the tree's
            from_lookup += sum(s == "lookup" for s, _, _ in steps)
            from_suffix += sum(s == "suffix" for s, _, _ in steps)
            skipped += sum(not ran for _, _, ran in steps)
            cost += sum(drafter_step if ran else lookup_step for _, _, ran in steps)
            cost_bound += looked * lookup_step + (len(steps) - looked) * drafter_step
        results.append({"rule": name, "tau": sum(taus) / len(taus), "tau_steps": tokens / n_steps, "steps": n_steps,
                        "lookup_share": from_lookup / n_steps, "suffix_share": from_suffix / n_steps,
                        "drafter_skipped": skipped / n_steps,
                        "speedup": tokens / cost, "speedup_lookup_alone_cost": tokens / cost_bound})
    return results


def main() -> int:
    args = parse_args()
    drafter, config = load_drafter(args.drafter, dtype=torch.float32)
    embed, head = load_embedding_and_head(args.target, dtype=torch.float32)
    store = open_store(args.eval_store)
    args.suffix = not args.no_suffix
    k_suffix = args.k_suffix or args.k_drafter

    def tables_of(model, block_size: int) -> list[list[dict]]:
        tree = SuffixSource() if args.suffix else None  # a fresh engine's tree per drafter
        return [anchor_table(model, embed, head, store[i], block_size, args.k_lookup,
                             (tree, f"held-out {i}", k_suffix) if tree else None)
                for i in range(min(args.limit, len(store)))]
    tables = tables_of(drafter, config.block_size)
    paired = None
    if args.against:
        other, other_config = load_drafter(args.against, dtype=torch.float32)
        served = parse_combined(args.served) if args.served else \
            CombinedRule(k=args.k_lookup, suffix=SUFFIX_SCORE if args.suffix else None)
        theirs = tables_of(other, other_config.block_size)
        kept = [i for i, (a, b) in enumerate(zip(tables, theirs)) if a and b]
        paired = {"rule": served.setting(), "against": args.against,
                  **against([tables[i] for i in kept], [theirs[i] for i in kept], plugin_rule(served), args)}
        print(json.dumps(paired, indent=1))
    tables = [rows for rows in tables if rows]
    results = evaluate_rules(tables, args)
    table = runs.markdown_table(["rule", "tau (per answer)", "tau (all steps)", "blocks from lookup",
                                 "blocks from the suffix tree", "steps without the drafter",
                                 "speedup (the drafter runs where the rule asks it)",
                                 "speedup (a free step costs lookup's)"],
                                [[r["rule"], r["tau"], r["tau_steps"], r["lookup_share"], r["suffix_share"],
                                  r["drafter_skipped"], r["speedup"], r["speedup_lookup_alone_cost"]]
                                 for r in results])
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "samples": len(tables),
                                                      "rules": results, "paired": paired}, indent=1) + "\n")
        (out / "results.md").write_text(f"# Combined speculator rules ({len(tables)} held-out answers, drafter K = "
                                        f"{args.k_drafter}, lookup K = {args.k_lookup})\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
