"""The model card (README.md) of a pushed drafter.

A drafter is only useful with the exact target, layers, block size and mask token it was trained for, served
with the same chat template; the card states all of them, how to serve the drafter with SGLang and vLLM, what
the eval measured, what data it was trained on (counts only, never prompt text) and how it was made.

Serving flags, as checked against the engines' DFlash support (see the push helper's report for sources):
  SGLang: --speculative-algorithm DFLASH --speculative-draft-model-path REPO, and
          --speculative-num-draft-tokens = the verify block size B (SGLang infers it from the draft config,
          else 16; we pass it explicitly).
  vLLM:   --speculative-config '{"method": "dflash", "model": REPO, "num_speculative_tokens": B - 1}': vLLM
          counts the drafted tokens, the block's first slot is the already-known bonus token.

The eval's tables (vLLM's speculation lengths, requests decoded together) come from dflash_train.report_tables,
rendered as in the eval's report.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import yaml

from dflash_train import eval_report
from dflash_train.eval_report import EvalReport, OwnLoop, VllmEval
from dflash_train.report_tables import (constraints_markdown, describe_machine, fmt, serving_tables, table,
                                          with_interval)

if TYPE_CHECKING:
    from dflash_train.model.checkpoint import RunSummary
    from dflash_train.model.configuration import HfConfig
    from dflash_train.model.published import SourceRecord
    from dflash_train.prompts import IngestReport
    from dflash_train.provenance import Provenance, StageConfig
    from dflash_train.store.format import Generation
    from dflash_train.target import TargetRecord

DEFAULT_LICENSE = "apache-2.0"
CARD_TAGS = ["speculative-decoding", "dflash", "block-diffusion", "draft-model", "dflash-train"]
# Keys whose values may carry user text; a data summary never shows them, whatever their type.
TEXT_KEYS = {"prompt", "prompts", "text", "texts", "messages", "message", "content", "contents", "example",
             "examples", "response", "responses", "completion", "completions", "conversation", "conversations",
             "sample_text", "samples_text", "preview", "first", "input", "output", "instruction"}


@dataclass
class Gate:
    """The release gate's verdict on an eval report."""

    passed: bool
    forced: bool
    min_tau: float
    min_tau_source: str  # where the threshold came from, for the card and the refusal message
    reasons: list[str] = field(default_factory=list)  # why it failed; empty when passed


class StoreCounts(TypedDict, total=False):
    """A training store as the card shows it (push.command.data_summary): counts and names, no text."""
    name: str
    num_samples: int
    num_tokens: int
    storage_dtype: str
    ingest_report: IngestReport | None
    replay: bool  # an earlier round's store, replayed (recipe data.replay_stores; the trainer's totals say how much)


class DataCounts(TypedDict, total=False):
    """The training data summary of a card."""
    stores: list[StoreCounts]
    recorded: dict[str, int]  # the trainer's totals, shown for several stores (or none)


CardMetadata = dict[str, Any]
"""The card's YAML front matter: the Hub's model card metadata (base_model, license, tags, model-index, ...)."""


@dataclass
class CardInputs:
    repo_id: str
    revision: str | None
    run_name: str
    drafter_config: HfConfig
    num_parameters: int
    weights_dtype: str
    target: TargetRecord  # config.json's dflash_train.target
    license: str
    license_from_recipe: bool
    gate: Gate
    recipe: StageConfig | None = None
    data: DataCounts | None = None
    generation: Generation | None = None  # decoding settings and template options the data was captured with
    report: EvalReport | None = None  # eval report.json
    run: RunSummary | None = None
    training_provenance: Provenance | None = None
    eval_provenance: Provenance | None = None
    push_provenance: Provenance | None = None
    plots: list[str] = field(default_factory=list)  # eval plot paths inside the pushed folder
    history: list[dict[str, str]] | None = None  # push --history: the refresh rounds that led here, oldest first


# ---- what a card may show -------------------------------------------------------------------------------------


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, scalar) pairs of a nested dict; short scalar lists stay whole."""
    if isinstance(obj, dict):
        rows: list[tuple[str, Any]] = []
        for key, value in obj.items():
            rows += flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        rows = []
        for i, value in enumerate(obj):
            rows += flatten(value, f"{prefix}[{i}]")
        return rows
    return [(prefix, obj)]


def safe_summary_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """Rows of a data summary that cannot carry user text: numbers, booleans, and short one-line strings
    (source names, file names, split names) under keys that do not name text fields."""
    rows = []
    for key, value in flatten(summary):
        parts = {p.split("[")[0].lower() for p in key.split(".")}
        if parts & TEXT_KEYS:
            continue
        if isinstance(value, (list, tuple)):
            if len(value) > 12 or not all(_is_safe_scalar(v) for v in value):
                continue
        elif not _is_safe_scalar(value):
            continue
        rows.append((key, value))
    return rows


def without_text(obj: Any) -> Any:
    """`obj` with every key that may hold user text (TEXT_KEYS) removed, at any depth."""
    if isinstance(obj, dict):
        return {k: without_text(v) for k, v in obj.items() if str(k).lower() not in TEXT_KEYS}
    if isinstance(obj, list):
        return [without_text(v) for v in obj]
    return obj


def _is_safe_scalar(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, str) and len(value) <= 80 and "\n" not in value


# ---- card sections ------------------------------------------------------------------------------------------


def metadata(inp: CardInputs) -> CardMetadata:
    meta: CardMetadata = {
        "base_model": inp.target.get("base_model"),
        "library_name": "transformers",
        "license": inp.license,
        "pipeline_tag": "text-generation",
        "tags": list(CARD_TAGS),
    }
    own, engine = (inp.report.own, inp.report.vllm) if inp.report else (None, None)
    metrics = [{"type": "acceptance_length", "name": name, "value": round(float(value), 4)}
               for name, value in (("acceptance length (tau)", own and own.tau_steps),
                                   (f"acceptance length (tau) in vLLM {engine and engine.version}",
                                    engine and engine.tau_steps))
               if isinstance(value, (int, float)) and not isinstance(value, bool)]
    if metrics:
        meta["model-index"] = [{
            "name": inp.repo_id.split("/")[-1],
            "results": [{
                "task": {"type": "text-generation", "name": "speculative decoding"},
                "dataset": {"type": "held-out", "name": f"held-out prompts ({inp.run_name})"},
                "metrics": metrics,
            }],
        }]
    return meta


def serve_commands(target_hub_id: str, repo_id: str, block_size: int, revision: str | None,
                   num_speculative_tokens: int | None = None) -> tuple[str, str]:
    """The SGLang and vLLM command lines; vLLM drafts `num_speculative_tokens` (the eval's best_k), else B - 1."""
    sglang = [
        "python -m sglang.launch_server \\",
        f"    --model-path {target_hub_id} \\",
        "    --speculative-algorithm DFLASH \\",
        f"    --speculative-draft-model-path {repo_id} \\",
    ]
    if revision:
        sglang.append(f"    --speculative-draft-model-revision {revision} \\")
    sglang += [f"    --speculative-num-draft-tokens {block_size} \\", "    --trust-remote-code"]
    spec: dict[str, str | int] = {"method": "dflash", "model": repo_id,
                                  "num_speculative_tokens": num_speculative_tokens or block_size - 1}
    if revision:
        spec["revision"] = revision
    vllm = [f"vllm serve {target_hub_id} \\", f"    --speculative-config '{json.dumps(spec)}'"]
    return "\n".join(sglang), "\n".join(vllm)


def _what_it_is(inp: CardInputs) -> str:
    cfg, target = inp.drafter_config, inp.target
    dflash = cfg.get("dflash_config") or {}
    block = cfg.get("block_size")
    rows = [
        ("Target", f"[{target.get('base_model')}](https://huggingface.co/{target.get('base_model')})"),
        ("Target architecture", f"{target.get('model_type')}, {fmt(target.get('num_hidden_layers'))} layers, "
                                f"hidden {fmt(target.get('hidden_size'))}, vocab {fmt(target.get('vocab_size'))}"),
        ("Block size B", fmt(block)),
        ("Tapped target layers", fmt(dflash.get("target_layer_ids"))),
        ("Mask token id", fmt(dflash.get("mask_token_id")) + (f" (`{dflash['mask_token']}`)"
                                                                if dflash.get("mask_token") else "")),
        ("Drafter layers", fmt(cfg.get("num_hidden_layers"))),
        ("Drafter hidden size / heads / KV heads",
         f"{fmt(cfg.get('hidden_size'))} / {fmt(cfg.get('num_attention_heads'))} / "
         f"{fmt(cfg.get('num_key_value_heads'))}"),
        ("Drafter parameters", f"{inp.num_parameters:,} ({inp.num_parameters / 1e6:.1f} M, {inp.weights_dtype}); "
                               + ("embedding not included, the draft vocabulary's LM head rows included"
                                  if cfg.get("draft_vocab_size") else "embedding and LM head not included")),
        ("Architecture", f"{fmt(cfg.get('architectures'))} (config `model_type` {cfg.get('model_type')})"),
    ]
    if cfg.get("draft_vocab_size"):
        rows.append(("Draft vocabulary", f"{cfg['draft_vocab_size']:,} of the target's {fmt(cfg.get('vocab_size'))} "
                     "token ids, the ones its training answers use most, then their prompts': vLLM drafts only "
                     "these, with the target head's own rows for them (`lm_head.weight`, `d2t`); SGLang's DFlash "
                     "drafts with the target's whole head"))
    start = (cfg.get("dflash_train") or {}).get("fine_tuned_from")
    if start:
        rows.append(("Fine-tuned from", _starting_drafter(start)))
    return "\n".join([
        "## What it is",
        "",
        f"A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for "
        f"`{target.get('base_model')}`. Each step it drafts a block of {fmt(block)} tokens in one parallel "
        f"forward pass, reading the target's hidden states at the tapped layers; the target verifies the "
        f"whole block in one forward and keeps the longest correct prefix. The drafter has no embedding and "
        f"no LM head of its own: it uses the target's, frozen, so it only works with this exact target "
        f"(check the hashes under [Provenance](#provenance)).",
        "",
        table(rows, ("", "")),
    ])


def _starting_drafter(start: SourceRecord) -> str:
    """The drafter a warm start began from: its Hub repo (linked, at its revision) or folder name, layout, and the
    sha256 of its weight files."""
    repo, revision = start.get("repo"), start.get("revision")
    if repo:
        name = f"[{repo}](https://huggingface.co/{repo}" + (f"/tree/{revision}" if revision else "") + ")"
        name += f" at revision `{revision}`" if revision else ""
    else:
        name = f"the drafter folder `{start.get('name')}`"
    hashes = ", ".join(f"`{f}` sha256 `{h}`" for f, h in sorted((start.get("weights_sha256") or {}).items()))
    return name + (f" ({start['layout']} layout)" if start.get("layout") else "") + (f"; {hashes}" if hashes else "")


def _how_to_serve(inp: CardInputs) -> str:
    target = inp.target.get("base_model")
    block = int(inp.drafter_config.get("block_size") or 16)
    engine = inp.report.vllm if inp.report else None
    best_k = engine.best_k if engine else None
    sglang, vllm = serve_commands(target, inp.repo_id, block, inp.revision, best_k)
    if engine and best_k:
        measured = (f"`num_speculative_tokens` counts drafted tokens, at most B - 1 = {block - 1}; {best_k} was the "
                    f"fastest of the lengths measured one request at a time, on "
                    f"{describe_machine(inp.report.settings.machine, engine.dtype)} with "
                    f"vLLM {fmt(engine.version)} (see [Evaluation](#evaluation)): on other hardware, measure "
                    f"again")
    else:
        measured = f"`num_speculative_tokens` counts drafted tokens: B - 1 = {block - 1}"
    schedule = engine.per_batch_size_schedule if engine else None
    lines = ["## How to serve", "", "SGLang (`--speculative-num-draft-tokens` is the verify block size B):", "",
             "```bash", sglang, "```", "", f"vLLM ({measured}):", "", "```bash", vllm, "```", ""]
    if engine and schedule:
        lines += [f"Serving many requests at once, speculation paid up to {fmt(engine.pays_up_to_concurrency)} "
                  f"requests decoded together in the eval: vLLM can change K with the batch size, e.g. add "
                  f"`\"num_speculative_tokens_per_batch_size\": {json.dumps(schedule)}` to the speculative config "
                  f"(with `num_speculative_tokens` at least its largest K), as derived from the eval's concurrency "
                  f"runs.", ""]
    lines += [
        "Both engines' DFlash support is recent: use a release that lists `DFLASH` / `dflash` among its "
        f"speculative methods and can tap hidden states of a `{inp.target.get('model_type')}` target. The "
        "drafter also loads with Transformers for inspection:",
        "",
        "```python",
        "from transformers import AutoModel",
        "",
        f'drafter = AutoModel.from_pretrained("{inp.repo_id}", trust_remote_code=True'
        + (f', revision="{inp.revision}"' if inp.revision else "") + ")",
        "```",
    ]
    return "\n".join(lines + _as_generated(inp.generation or {}))


def _as_generated(gen: Generation) -> list[str]:
    """How the training data was generated (capture's chat template options and decoding settings): serve the
    target the same way."""
    if not gen:
        return []
    template_kwargs = gen.get("template_kwargs")
    settings = {k: v for k, v in gen.items() if k != "template_kwargs" and _is_safe_scalar(v) and v is not None}
    # capture's convention: no temperature / top_p = each logged request's own, greedy where the log has none
    per_request = [k for k in ("temperature", "top_p") if k in gen and gen[k] is None]
    if per_request:
        settings["sampling"] = "per logged request (greedy where unset)"
    lines = [
        "",
        "Serve the target the way the training data was generated: a drafter trained in one thinking mode "
        "or chat template drafts poorly in another.",
        "",
        f"- chat template options: `{json.dumps(template_kwargs or {})}`",
    ]
    if settings:
        lines.append("- decoding settings of the captured responses: "
                     + ", ".join(f"`{k}={fmt(v)}`" for k, v in settings.items()))
    return lines


def _lossless_verdict(own: OwnLoop, dtype: str) -> str:
    """The project's loop's lossless check in words: passed, passed once near-ties were rerun in fp32, or failed."""
    mismatches = own.standing_mismatches()
    in_dtype = own.lossless_mismatches
    of = f" of {fmt(own.lossless_checked)} prompts"
    if mismatches is None:
        return "not recorded"
    if mismatches == 0 and in_dtype:
        return (f"passed: {in_dtype}{of} differed in {dtype} by rounding near-ties in the verify forward, "
                f"and all were token-for-token identical when rerun in fp32")
    if mismatches == 0:
        return f"passed: 0{of} differ, every output is token-for-token the target's own"
    return f"FAILED: {mismatches}{of} differ from the target's own decoding"


TAU_DEFINITION = ("τ = 1 + the drafts the target accepted per verification, i.e. the tokens it commits, bonus token "
                  "included, also counted so on a last step cut short by a stop token (1 ≤ τ ≤ B = {block}), over "
                  "all verification steps of the held-out prompts: tokens per target forward, what throughput "
                  "follows. Beside it, the mean over prompts of each prompt's own τ (a prompt of a few long steps "
                  "weighs as much as one of many).")


def _evaluation(inp: CardInputs) -> str:
    report = inp.report
    lines = ["## Evaluation", ""]
    if not report:
        return "\n".join(lines + ["No eval report was attached to this push: its acceptance was not measured."])
    settings = report.settings
    lines += [TAU_DEFINITION.format(block=fmt(inp.drafter_config.get("block_size"))), ""]
    if own := report.own:
        offline = report.offline.tau_steps if report.offline else None
        rows = [
            ("Acceptance length τ, online (real speculative decoding with the target)",
             with_interval(own.tau_steps, own.tau_steps_interval)),
            ("τ, mean over prompts", with_interval(own.tau_per_prompt, own.tau_per_prompt_interval)),
            ("Acceptance length τ, offline (held-out captured samples, walked as greedy decoding walks them)",
             fmt(offline) if offline is not None else "not measured"),
            ("Lossless check", _lossless_verdict(own, settings.dtype or "the eval dtype")),
            ("Tokens/s, with the drafter vs the target alone",
             f"{fmt(own.tokens_per_s)} vs {fmt(own.tokens_per_s_baseline)}"),
            ("Speedup (tokens/s ratio)", with_interval(own.speedup, own.speedup_interval) + "×"
             if own.speedup is not None else "—"),
        ]
        lines += [table(rows, ("Metric", "Value"))]
    lines += [""] + constraints_markdown(settings.constraints)[:1]
    lines += _engine_evaluation(inp)
    methods = own.methods if own else []
    if len(methods) > 1:
        method_rows = [(fmt(m.method), fmt(m.block_size), fmt(m.tau_steps), fmt(m.tau_per_prompt),
                        fmt(m.tokens_per_target_forward), fmt(m.tokens_per_s), f"{fmt(m.speedup)}×",
                        fmt(m.lossless_mismatches)) for m in methods]
        lines += ["", "All methods in the same run, on the same prompts:", "",
                  table(method_rows, ("Method", "B", "τ", "τ, mean over prompts", "Tokens / target forward",
                                      "Tokens/s", "Speedup", "Lossless mismatches"))]
    acceptance = [a for a in (own.per_position_acceptance if own else []) if a is not None]
    if acceptance:
        lines += [
            "",
            "Per-position acceptance: the share of verification steps that accepted at least k drafted tokens "
            "(τ = 1 + their sum):",
            "",
            table([tuple([fmt(a) for a in acceptance])], tuple(f"k={i + 1}" for i in range(len(acceptance)))),
        ]
    setting_rows = [(k, v) for k, v in flatten(eval_report.to_json(report)["settings"])
                    if _is_safe_scalar(v) or isinstance(v, (list, tuple))]
    setting_rows = [(k, v) for k, v in setting_rows
                    if not ({p.split("[")[0].lower() for p in k.split(".")} & TEXT_KEYS)]
    if setting_rows:
        lines += ["", "<details><summary>Eval settings</summary>", "", table(setting_rows, ("Setting", "Value")),
                  "", "</details>"]
    for plot in inp.plots:
        lines += ["", f"![{plot}]({plot})"]
    lines += ["", "Tokens/s depend on the hardware, dtype and batch size they were measured with (see the "
                  "settings); acceptance length carries over to other engines, tokens/s does not."]
    return "\n".join(lines)


def _engine_evaluation(inp: CardInputs) -> list[str]:
    """What the serving engine measured, and the exact command it ran (with the Hub repos for local folders)."""
    from dflash_train.engine.args import serve_command

    engine = inp.report.vllm if inp.report else None
    if engine is None:
        return ["", "Not measured in a serving engine (the eval ran without `--engine vllm`)."]
    mismatches = engine.standing_mismatches()
    lossless = ("not checked" + (f": {engine.lossless_note}" if engine.lossless_note else "")
                if mismatches is None else
                f"{'passed' if mismatches == 0 else 'FAILED'}: {mismatches} of {fmt(engine.lossless_checked)} "
                f"prompts differ from vLLM's own plain decoding")
    k = engine.best_k
    rows = [("Acceptance length τ" + (f" at K = {k}" if k else ""),
             with_interval(engine.tau_steps, engine.tau_steps_interval)),
            ("τ, mean over prompts", with_interval(engine.tau_per_prompt, engine.tau_per_prompt_interval)),
            ("Acceptance at positions 1, 2, 3", ", ".join(fmt(a) for a in engine.per_position_acceptance[:3]) or "—"),
            ("Tokens/s, with the drafter vs the target alone",
             f"{fmt(engine.tokens_per_s)} vs {fmt(engine.tokens_per_s_baseline)}"),
            ("Speedup, whole requests (tokens/s ratio, engine core)" if engine.speedup_wall is not None else
             "Speedup (tokens/s ratio)", with_interval(engine.speedup, engine.speedup_interval) + "×"
             if engine.speedup is not None else "—")]
    if engine.speedup_wall is not None:
        rows.append(("Speedup by a stopwatch around each whole request",
                     with_interval(engine.speedup_wall, engine.speedup_wall_interval) + "×"))
    rows.append(("Lossless check", lossless))
    args = dict(engine.engine_args)
    command = None
    if args:
        args["model"] = inp.target.get("base_model")
        if isinstance(args.get("speculative_config"), dict):
            args["speculative_config"] = dict(args["speculative_config"], model=inp.repo_id)
        command = serve_command(args)
    return ["", f"Measured in vLLM {fmt(engine.version)}, the serving engine itself (the same held-out "
                f"prompts, greedy, one request at a time, {fmt(engine.dtype)}), loading this folder as its "
                f"`dflash` speculator:", "", table(rows, ("Metric (vLLM)", "Value"))] + (
        ["", *serving_tables(engine, inp.report.settings.machine)] if engine.sweep else []) + (
        ["", "The engine ran with the equivalent of:", "", "```bash", command, "```"] if command else [])


def _gate(inp: CardInputs) -> str:
    gate = inp.gate
    reasons = "; ".join(gate.reasons)
    if gate.forced and not gate.passed:
        return "\n".join([
            "> [!WARNING]",
            f"> **The release gate was overridden** (`dflash-train push --force`): {reasons}. "
            "Measure this drafter yourself before serving it.",
        ])
    if not gate.passed:  # only a dry run gets this far without --force
        return "\n".join([
            "> [!CAUTION]",
            f"> **This drafter fails the release gate**: {reasons}. `dflash-train push` refuses to upload it "
            "(this card is a dry-run preview); `--force` would upload it with a warning.",
        ])
    own = inp.report.own if inp.report else None
    engine = (inp.report.vllm if inp.report else None) or VllmEval()  # a gate that passed had vLLM's eval
    k = f" at K = {engine.best_k}" if engine.best_k else ""
    measured = f"vLLM τ {fmt(engine.tau_steps)}{k}" + (f", online τ {fmt(own.tau_steps)}" if own else "")
    return (f"Release gate: passed ({measured} ≥ {fmt(gate.min_tau)}, minimum from {gate.min_tau_source}; "
            f"lossless check passed; vLLM {fmt(engine.version)} evaluated this very drafter: its weights and "
            f"config.json, sha256 `{engine.drafter_sha256}`).")


# top-level integers of an ingest report that are not skip counts
INGEST_TOTALS = {"read", "kept", "duplicates", "train", "eval", "blank_lines", "truncated_at_cut", "total_weight",
                 "max_weight", "wall_s"}


def _counts(counts: dict[str, int]) -> str:
    nonzero = [(k, v) for k, v in counts.items() if isinstance(v, (int, float)) and v]
    return ", ".join(f"{k} {fmt(v)}" for k, v in nonzero) if nonzero else "none"


def _ingest_rows(ingest: IngestReport) -> list[tuple[str, str]]:
    """The ingest report's counts (dflash_train.stages.ingest.command's format): read, kept, duplicates, skipped,
    PII."""
    sources = [src for src in ingest.get("sources") or [] if isinstance(src, dict)]
    formats = ingest.get("formats") if isinstance(ingest.get("formats"), dict) else {}
    rows = [("Log records read", f"{fmt(ingest.get('read'))} from {len(sources)} file(s)"
             + (f" ({_counts(formats)})" if formats else ""))]
    kept = fmt(ingest.get("kept"))
    if "train" in ingest:
        kept += f": {fmt(ingest['train'])} train, {fmt(ingest.get('eval'))} held out for eval (split by hash)"
    rows.append(("Unique prompts kept", kept))
    if "duplicates" in ingest:
        weights = f" (largest weight {fmt(ingest['max_weight'])})" if "max_weight" in ingest else ""
        rows.append(("Duplicates", f"{fmt(ingest['duplicates'])}, merged: each unique prompt is weighted by how "
                                   f"often it occurred{weights}"))
    skipped = {k: v for k, v in ingest.items() if k not in INGEST_TOTALS and isinstance(v, int)
               and not isinstance(v, bool)}
    rows.append(("Records skipped", _counts(skipped)))
    pii = ingest.get("pii", "missing")
    if pii != "missing":
        rows.append(("PII scrubbed (replaced by placeholders)",
                     "scrubbing was off" if pii is None else _counts(pii) if isinstance(pii, dict) else fmt(pii)))
    return rows


def _training_data(inp: CardInputs) -> str:
    lines = ["## Training data", ""]
    data = inp.data or {}
    stores = [s for s in data.get("stores") or [] if isinstance(s, dict)]
    recorded = safe_summary_rows(data.get("recorded") or {})
    if not stores and not recorded:
        return "\n".join(lines + ["The training run did not record a data summary."])
    lines += ["Prompts from the service's own logs; the responses were generated by the target itself, its hidden "
              "states recorded in the same pass. Only counts are published here: no prompt or response text.", ""]
    for store in stores:
        rows: list[tuple[Any, ...]] = [
            ("Training samples (prompt + target response)", fmt(store.get("num_samples"))),
            ("Tokens", fmt(store.get("num_tokens"))),
            ("Hidden states stored as", fmt(store.get("storage_dtype"))),
        ]
        ingest = store.get("ingest_report")
        sources = []
        if isinstance(ingest, dict) and "read" in ingest:
            rows += _ingest_rows(ingest)
            sources = [src for src in ingest.get("sources") or [] if isinstance(src, dict)]
        elif isinstance(ingest, dict):
            rows += safe_summary_rows(ingest)
        title = f"Capture store `{store.get('name')}`" if len(stores) > 1 else "Data"
        title += " (replayed from an earlier round)" if store.get("replay") is True else ""
        lines += [f"**{title}**", "", table(rows, ("", "")), ""]
        if sources:
            src_rows = [(s.get("name"), _counts(s.get("formats") or {}), s.get("read"), s.get("kept"),
                         s.get("duplicates")) for s in sources if _is_safe_scalar(s.get("name"))]
            lines += ["Log files:", "", table(src_rows, ("File", "Formats", "Read", "Kept", "Duplicates")), ""]
    if recorded:
        lines += ["Recorded by the trainer:", "", table(recorded, ("", "")), ""]
    return "\n".join(lines).rstrip()


def _hyperparameters(inp: CardInputs) -> str:
    lines = ["## Training", ""]
    run_rows = [(f"`{k}`", v) for k, v in flatten(inp.run or {}) if _is_safe_scalar(v)]
    if run_rows:
        lines += ["The run:", "", table(run_rows, ("", "")), ""]
    if not inp.recipe:
        return "\n".join(lines + ["The training run did not record its recipe."])
    rows = [(f"`{k}`", v) for k, v in flatten(inp.recipe) if _is_safe_scalar(v) or isinstance(v, (list, tuple))]
    return "\n".join(lines + ["The resolved training recipe (hyperparameters):", "",
                              table(rows, ("Key", "Value"))])


def _provenance(inp: CardInputs) -> str:
    target = inp.target
    rows: list[tuple[Any, ...]] = [
        ("Target name", target.get("name")),
        ("Target config sha256", f"`{target.get('config_hash')}`"),
        ("Target tokenizer sha256", f"`{target.get('tokenizer_hash')}`"),
        ("Target chat template sha256", f"`{target.get('chat_template_hash')}`"),
        ("Training run", inp.run_name),
    ]
    for label, prov in (("Trained with dflash-train", inp.training_provenance),
                        ("Evaluated with dflash-train", inp.eval_provenance),
                        ("Pushed with dflash-train", inp.push_provenance)):
        if not prov:
            continue
        git = prov.get("git") or {}
        commit = git.get("commit")
        state = " (uncommitted changes)" if git.get("dirty") else ""
        rows.append((label, f"commit `{commit[:12]}`{state}, {prov.get('created')}" if commit
                     else f"unknown commit, {prov.get('created')}"))
    packages = (inp.training_provenance or inp.push_provenance or {}).get("packages") or {}
    if packages:
        rows.append(("Package versions", ", ".join(f"{k} {v}" for k, v in packages.items() if v)))
    license_note = ("from the training recipe" if inp.license_from_recipe else
                    f"the recipe set no license; `{DEFAULT_LICENSE}` is dflash-train's default")
    rows.append(("License", f"`{inp.license}` ({license_note})"))
    return "\n".join(["## Provenance", "", table(rows, ("", ""))])


def _rounds(inp: CardInputs) -> str:
    """The refresh rounds that led to this release (`dflash-train refresh`, push --history), oldest first: each
    round's logs and new prompts, the serving drafter's drift, and the candidate against the drafter serving then."""
    if not inp.history:
        return ""
    columns = tuple(inp.history[0])
    return "\n".join(["## Refresh rounds", "",
                      "Each round trained on one batch of new logs, warm-started from the drafter serving then, and "
                      "was released only where it beat that drafter on the round's new held-out requests (tau "
                      "ratio's 95% interval above 1) without losing on earlier rounds' (paired by prompt in vLLM).",
                      "", table([tuple(row.get(c, "") for c in columns) for row in inp.history], columns)])


def render_card(inp: CardInputs) -> str:
    front = yaml.safe_dump(metadata(inp), sort_keys=False, allow_unicode=True).strip()
    title = inp.repo_id.split("/")[-1]
    sections = [
        f"---\n{front}\n---",
        f"# {title}",
        _gate(inp),
        _what_it_is(inp),
        _how_to_serve(inp),
        _evaluation(inp),
        _rounds(inp),
        _training_data(inp),
        _hyperparameters(inp),
        _provenance(inp),
        "Made with dflash-train from the target's own responses to the service's traffic.",
    ]
    return "\n\n".join(section for section in sections if section) + "\n"
