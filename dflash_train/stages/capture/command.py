"""Capture: replay prompts through the target and store its own responses with the tapped layers' hidden states.

    dflash-train capture --prompts data/prompts/sharegpt --target smollm2-135m-instruct --out data/store/x

Each prompt is rendered with the target's chat template exactly as served, the target generates its response
(greedy by default; temperature/top-p from the command or from the logged request), and the hidden states of
the tapped decoder layers are recorded in the same pass: the prefill gives the prompt's states, every decode
step the states of the token it feeds. The last generated token is fed once more so that it has states too, so
no second prefill over the whole sequence is ever run. `--responses logged` instead takes the response from the
log (for logs that came from this very target) and runs a single prefill.

`--storage none` writes a token-only store: the same store without the hidden states (token ids, loss mask,
weights, optional top-k), for training that computes the states with the target (`data.hidden_states: online`).
Its manifest says `kind: tokens`; it still records the tapped layer ids the drafter will read. Where nothing else
needs the target's forward (`--engine vllm` or `--responses logged`, without `--store-topk`) no prefill runs.

`--store-topk K` also stores, for every position t, the target's K most likely tokens and their log-probabilities
(fp32 log-softmax of the full vocabulary, temperature 1, not renormalised) for the distribution that predicts
token t, i.e. from the logits at t-1 (soft labels for training; position 0 has none: ids 0, log-probs -inf). The
prompt's come from the final hidden states of the same prefill through the LM head, a bounded number of rows at
a time; each generated token's from the very logits it was decoded from. Costs 6 bytes per token per k.

Several processes (`accelerate launch --multi_gpu --num_processes N -m dflash_train capture ...`, or torchrun;
on CPU the process group uses gloo) split the prompts by index (rank r takes prompts r, r+N, ...), each writes
its own shards, and rank 0 merges the manifest after a barrier. A target too large for one GPU can be loaded with
`--device-map auto` (single process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Literal

import torch

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.device import default_device, device_problem, resolve_precision
from dflash_train.errors import UserError, decided_by_rank0
from dflash_train.engine import ENGINE_ARGS_HELP, engine_args_problem
from dflash_train.options import add_options, at_least, from_args, in_range, option, validate
from dflash_train.provenance import read_json
from dflash_train.sampling import Sampling
from dflash_train.store import DEFAULT_SHARD_BYTES, NO_STATES, StoreWriter, finalize_store
from dflash_train.model.configuration import default_layer_ids
from dflash_train.model.modeling_dflash import cache_keyword, tap_layers
from dflash_train.target import DEFAULT_TARGET, Target, chat_text, check_layer_ids, load_target, prompt_seed



@dataclass
class CaptureConfig:
    """The capture stage's options; the `dflash-train capture` flags are derived from these fields."""
    prompts: str = option(help="an ingest output folder, or a raw log file")
    out: str = option(help="store folder to write (rerun the same command to resume)")
    target: str = option(DEFAULT_TARGET, help="embedded target name, checkpoint folder or hub id")
    split: str = option("train", help="split of the ingest folder")
    layers: list[int] | None = option(None, metavar="IDS", help="tapped decoder layer ids, e.g. 1,9,17 (strictly "
                                      "increasing, as engines concatenate them); wins over --num-taps")
    num_taps: int = option(5, aliases=("--num-layers",), check=at_least(1),
                           help="tap n layers evenly spaced from 1 to L-3, or layer L // 2 for n = 1 (not the "
                                "drafter's num_layers; --num-layers is the old spelling)")
    max_new_tokens: int = option(256, check=at_least(1), help="response cap, tokens (a logged request's own "
                                                              "max_tokens wins where it is smaller)")
    max_prompt_tokens: int = option(4096, check=at_least(1),
                                    help="skip (and count) prompts longer than this; they are never truncated")
    batch_size: int = option(8, check=at_least(1), help="prompts decoded together")
    temperature: float | None = option(None, check=sampling.flag_check("temperature"),
                                       help="sampling temperature for every prompt (default: the logged "
                                            "request's, else greedy)")
    top_p: float | None = option(None, check=sampling.flag_check("top_p"),
                                 help="nucleus sampling (default: the logged request's)")
    seed: int = option(0, help="sampling seed (per prompt: a hash of seed and prompt id)")
    limit: int | None = option(None, check=at_least(1), help="only the first N prompts of the split")
    storage: Literal["bf16", "fp8", "none"] = option(
        "bf16", help="storage dtype of the tapped states; none: a token-only store (ids, loss mask, weights, top-k; "
                     "about 5 bytes per token), whose states training computes (data.hidden_states: online)")
    responses: Literal["generate", "logged"] = option("generate", help="the target's own responses, or the logged "
                                                                       "ones (one prefill)")
    constraints: Literal["replay", "ignore"] = option(
        "replay", help="replay: decode each request under its own constraints as production did (structured "
                       "outputs, stop, penalties, ...: `dflash_train.constraints`); ignore: without them (only to "
                       "measure what replaying them is worth)")
    shard_size_mb: float = option(DEFAULT_SHARD_BYTES / 2**20, check=in_range(0, 1e6, low_open=True),
                                  help="shard size in MiB")
    template_kwargs: dict[str, Any] = option(default_factory=dict, metavar="JSON",
                                             help='chat template options as JSON, e.g. \'{"enable_thinking": false}\'')
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="the target's compute dtype (auto: bf16 where the device runs it natively, else fp32); the "
                     "storage dtype is --storage")
    engine: Literal["own", "vllm"] = option(
        "own", help="own: transformers generates and records the states in one pass; vllm: vLLM generates the "
                    "responses (continuous batching), then one batched prefill records the states")
    device: str | None = option(None, help="default: cuda (this rank's GPU) if available, else cpu",
                                check=device_problem)
    device_map: str | None = option(None, help="e.g. auto: spread a large target over the GPUs")
    threads: int | None = option(None, check=at_least(1), help="torch CPU threads per process")
    store_topk: int = option(0, check=at_least(0), metavar="K",
                             help="also store the target's top-K token log-probs per position, soft labels for "
                                  "objective.soft_label_weight (6*K bytes per token; 0 = off)")
    engine_args: dict[str, Any] = option(default_factory=dict, metavar="JSON", check=engine_args_problem,
                                         help=f"--engine vllm: {ENGINE_ARGS_HELP}")


@dataclass
class PromptRecord:
    id: str
    messages: list[dict[str, Any]]  # {role, content} plus tool_calls / tool_call_id / name where the turn has them
    weight: int = 1
    sampling: dict[str, Any] | None = None
    response: str | None = None
    tools: list[dict[str, Any]] | None = None  # the request's tool definitions, rendered by the chat template
    constraints: dict[str, Any] | None = None  # what else the request asked of its answer (`constraints`)


@dataclass
class Captured:
    input_ids: list[int]
    num_prompt_tokens: int
    hidden_states: torch.Tensor | None  # [S, n*H]; None when no layer is tapped (a token-only store)
    topk_ids: torch.Tensor | None = None  # [S, K] int32: the target's top-k tokens for position t (from t-1)
    topk_logprobs: torch.Tensor | None = None  # [S, K] float32: their log-probs; row 0: ids 0, -inf
    ended: str | None = None  # why the answer ended (ENDINGS); None for a response not generated here


# Why an answer ended: the target's own stop token, a stop token id or a stop string of the request, or its length cap
ENDINGS = ("eos", "stop_token", "stop_string", "length")


# ------------------------------------------------------------------------------------------------ prompts

def load_prompt_records(path: str | Path, split: str = "train", limit: int | None = None
                        ) -> tuple[list[PromptRecord], dict[str, Any] | None]:
    """Records of a finished ingest output folder (its `split`) or of one raw log file, and the ingest report.

    A raw log is parsed and scrubbed by the ingest module and deduplicated here (weight = count); it has no
    held-out split, so prefer an ingest folder for anything that is evaluated later. No record at all is one line:
    every caller has nothing to do then."""
    from dflash_train.stages.ingest import command as ingest

    path = Path(path)
    if path.is_dir():
        rows, report_path = ingest.load_prompts(path, split), path / "report.json"
        report = read_json(report_path, "the ingest report") if report_path.exists() else None
    elif path.exists():
        rows, report = _dedup(ingest.iter_records(path)), None
    else:
        raise UserError(f"prompts {path} do not exist (run `dflash-train ingest` first, or pass a log file)")
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for row in rows:
        if limit is not None and len(records) >= limit:
            break
        record = _to_record(row, path)
        if record.id in seen:
            raise UserError(f"{path}: duplicate record id {record.id!r}")
        seen.add(record.id)
        records.append(record)
    if not records:
        counts = (f" (ingest kept {report.get('kept')}: {report.get('train')} train, {report.get('eval')} eval)"
                  if report else "")
        raise UserError(f"no prompts in {path}" + (f", split {split!r}" if path.is_dir() else "") + counts)
    return records, report


def _dedup(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["id"] in by_id:
            by_id[row["id"]]["weight"] += row.get("weight") or 1
        else:
            by_id[row["id"]] = dict(row)
    return list(by_id.values())


def _to_record(row: dict[str, Any], path: Path) -> PromptRecord:
    from dflash_train.stages.ingest.command import template_inputs

    rid = row.get("id")
    if not isinstance(rid, str) or not rid:
        raise UserError(f"{path}: a record has no string 'id' (keys: {', '.join(row)})")
    raw = row.get("messages")
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in raw)):
        raise UserError(f"{path}: record {rid!r} has no list of {{role, content}} 'messages'")
    try:
        messages, tools = template_inputs(row)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: record {rid!r}: 'tools' is not JSON ({err})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"{path}: record {rid!r}: 'tools' is not a list of tool definitions")
    for m in messages:
        if not isinstance(m.get("tool_calls", []), list):
            raise UserError(f"{path}: record {rid!r}: a turn's 'tool_calls' is not a list")
    try:
        constraints = request_constraints.loads(row.get("constraints"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: record {rid!r}: 'constraints' is not JSON ({err})") from None
    if constraints is not None and not isinstance(constraints, dict):
        raise UserError(f"{path}: record {rid!r}: 'constraints' is not a JSON object")
    weight = row.get("weight")
    return PromptRecord(id=rid, messages=messages, weight=int(weight) if weight is not None else 1,
                        sampling=row.get("sampling") or None, response=row.get("response"), tools=tools or None,
                        constraints=constraints)


def prompt_set(prompts: str | Path, split: str, ingest_report: dict[str, Any] | None) -> dict[str, Any]:
    """Which prompts a store holds, as its settings record it: the ingest folder (or raw log) they come from, the
    split, and the split rule (eval fraction and seed) that decided it. A store holds one such set: a capture of
    another split or source into it is refused, so that eval prompts never reach a training store."""
    path = Path(prompts)
    rule = (ingest_report or {}).get("config") or {}
    return {"source": str(path.resolve()), "split": split if path.is_dir() else None,
            "eval_fraction": rule.get("eval_fraction"), "seed": rule.get("seed")}


def sampling_for(record: PromptRecord, temperature: float | None, top_p: float | None) -> Sampling:
    """The command's settings win; otherwise the logged request's; otherwise greedy (`sampling.resolve`).
    A value out of the API's range is one clear error naming the record."""
    try:
        return sampling.resolve(temperature, top_p, record.sampling)
    except ValueError as err:
        raise UserError(f"prompt {record.id}: logged {err}") from None


# ------------------------------------------------------------------------------------------------ model

def resolve_layer_ids(num_target_layers: int, layers: list[int] | None, num_taps: int) -> list[int]:
    """--layers as given, else the default rule for `num_taps` layers; checked by the one layer-id rule."""
    ids = default_layer_ids(num_target_layers, num_taps) if layers is None else list(layers)
    return check_layer_ids(ids, num_target_layers)


def _forward(model, input_ids, attention_mask, position_ids, cache=None, use_cache=True):
    """One forward returning the last position's logits, all hidden states and the cache."""
    cache_key = cache_keyword(type(model))
    kwargs = {cache_key: cache} if cache is not None else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, output_hidden_states=True, logits_to_keep=1, **kwargs)
    return out.logits[:, -1], out.hidden_states, getattr(out, cache_key, None)


def _left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, s in enumerate(sequences):
        ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each sequence counts from 0 at its first real token
    return ids.to(device), mask.to(device), positions.to(device)


TOPK_CHUNK_ELEMENTS = 1 << 25  # logits per chunk when the top-k of many positions is taken (128 MiB in fp32)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (int32 ids, float32 log-probs), both [..., k]: top-k of the fp32 log-softmax."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.to(torch.int32), values


def _head_topk(model, final_hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of every position of final_hidden [b, T, H] (the last layer after the final norm) through
    the model's LM head, a bounded number of rows at a time; on the CPU, [b, T, k] each."""
    head = model.get_output_embeddings()
    rows = final_hidden.reshape(-1, final_hidden.shape[-1])
    step = max(1, TOPK_CHUNK_ELEMENTS // head.weight.shape[0])
    ids = [torch.zeros(0, k, dtype=torch.int32)]
    values = [torch.zeros(0, k)]
    for s in range(0, rows.shape[0], step):
        i, v = topk_logprobs(head(rows[s:s + step]), k)
        ids.append(i.cpu())
        values.append(v.cpu())
    shape = (*final_hidden.shape[:2], k)
    return torch.cat(ids).view(shape), torch.cat(values).view(shape)


def _check_head(model, final_hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The prompt's top-k come from LM head(final hidden state); refuse a model whose logits are more than that
    (soft-capping, scaling), checked on the last position, where the model's own logits are at hand."""
    mine = model.get_output_embeddings()(final_hidden).float()
    theirs = logits.float()
    tol = 1e-2 * (1.0 + float(theirs.abs().max()))
    if float((mine - theirs).abs().max()) > tol:
        raise UserError(f"--store-topk: the logits of {type(model).__name__} are not its LM head applied to the "
                        f"final hidden state (max difference {float((mine - theirs).abs().max()):.3g}); top-k "
                        f"capture does not support this model")


def _no_prediction(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k row of position 0, which nothing predicts."""
    return torch.zeros(1, k, dtype=torch.int32), torch.full((1, k), float("-inf"))


def sample_next(logits: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, else temperature + nucleus (top-p) sampling."""
    out = logits.argmax(dim=-1)
    for r, (s, g) in enumerate(zip(samplings, generators)):
        if s.greedy:
            continue
        probs = torch.softmax(logits[r].float() / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < s.top_p  # smallest prefix reaching top_p
            keep[0] = True  # which always holds the most likely token
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
        out[r] = torch.multinomial(probs, 1, generator=g)[0]
    return out


def _choose(logits: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator],
            rules: list[Any], rows: list[int]) -> torch.Tensor:
    """The next token of every row; the rows in `rows` that have `constraints.Rules` choose from the logits those
    rules leave (bias, penalties, the grammar's mask)."""
    ruled = [r for r in rows if rules[r] is not None]
    if ruled:
        logits = logits.float().clone()
        for r in ruled:
            logits[r] = rules[r].process(logits[r])
    return sample_next(logits, samplings, generators)


@torch.no_grad()
def generate_and_capture(model, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int | list[int],
                         stop_ids: list[int], pad_id: int, samplings: list[Sampling] | None = None,
                         seeds: list[int] | None = None, topk: int = 0, rules: list[Any] | None = None
                         ) -> list[Captured]:
    """Batched decoding with a KV cache that records the tapped states of every position in the same pass.

    Left padding; the attention mask and position ids come from it, so each row sees exactly what a
    single-sample forward would. Decode step k feeds generated token k and records its states; a row stops
    after its stop token (kept, with states) or after its max_new_tokens tokens (one cap, or one per row). With
    topk > 0 every position also gets the target's top-k log-probs of the distribution that predicts it (see the
    module docstring; the target's own, before any constraint). With no `layer_ids` (a token-only store) no states
    are kept: hidden_states is None. `rules` (one `constraints.Rules` or None per row) decode a row under its
    request's constraints: the token completing a stop string, or one of the request's stop token ids, ends it."""
    device = next(model.parameters()).device
    b = len(prompts)
    caps = torch.tensor(max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * b, device=device)
    samplings = samplings or [Sampling()] * b
    generators = [torch.Generator(device=device).manual_seed(s) for s in (seeds or [0] * b)]
    ids, mask, positions = _left_pad(prompts, pad_id, device)
    logits, hidden, cache = _forward(model, ids, mask, positions)
    width = ids.shape[1]
    chunks: list[list[torch.Tensor]] = [[] for _ in prompts]
    if layer_ids:
        tapped = tap_layers(hidden, layer_ids).cpu()
        chunks = [[tapped[r, width - len(p):]] for r, p in enumerate(prompts)]
    top_chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]
    if topk:
        _check_head(model, hidden[-1][:, -1], logits)
        ids_k, logp_k = _head_topk(model, hidden[-1][:, :-1], topk)  # predicts positions 1 .. width-1
        for r, p in enumerate(prompts):
            top_chunks[r] += [_no_prediction(topk), (ids_k[r, width - len(p):], logp_k[r, width - len(p):])]
    tokens: list[list[int]] = [[] for _ in range(b)]
    rules = rules or [None] * b
    row_stops = [set(stop_ids) | set((r.constraints.get("stop_token_ids") or []) if r else []) for r in rules]
    ended: list[str | None] = [None] * b
    next_pos = positions[:, -1] + 1
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    nxt = _choose(logits, samplings, generators, rules, list(range(b)))
    for step in range(int(caps.max())):
        active = ~finished
        step_top = topk_logprobs(logits, topk) if topk else None  # of the logits nxt was decoded from
        for r in active.nonzero().flatten().tolist():
            token = int(nxt[r])
            tokens[r].append(token)
            if step_top is not None:
                top_chunks[r].append((step_top[0][r:r + 1].cpu(), step_top[1][r:r + 1].cpu()))
            by_string = rules[r] is not None and rules[r].accept(token)
            if token in row_stops[r]:
                ended[r] = "eos" if token in stop_ids else "stop_token"
            elif by_string:
                ended[r] = "stop_string"
            elif len(tokens[r]) >= int(caps[r]):
                ended[r] = "length"
        finished = torch.tensor([e is not None for e in ended], device=device)
        feed = torch.where(active, nxt, torch.full_like(nxt, pad_id))
        mask = torch.cat([mask, active[:, None].long()], dim=1)  # rows already done only add masked keys
        logits, hidden, cache = _forward(model, feed[:, None], mask, next_pos[:, None], cache)
        if layer_ids:
            tapped = tap_layers(hidden, layer_ids)[:, 0].cpu()
            for r in active.nonzero().flatten().tolist():
                chunks[r].append(tapped[r:r + 1])
        next_pos = next_pos + 1
        if bool(finished.all()):
            break
        nxt = _choose(logits, samplings, generators, rules, (~finished).nonzero().flatten().tolist())
    return [Captured(input_ids=list(p) + tokens[r], num_prompt_tokens=len(p),
                     hidden_states=torch.cat(chunks[r]) if layer_ids else None, **_joined_topk(top_chunks[r]),
                     ended=ended[r])
            for r, p in enumerate(prompts)]


def _joined_topk(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not parts:
        return {}
    return {"topk_ids": torch.cat([i for i, _ in parts]), "topk_logprobs": torch.cat([v for _, v in parts])}


@torch.no_grad()
def prefill_capture(model, sequences: list[list[int]], num_prompt_tokens: list[int], layer_ids: list[int],
                    pad_id: int, topk: int = 0, on_device: bool = False) -> list[Captured]:
    """One batched prefill over complete sequences (the `--responses logged` and `--engine vllm` paths, and the
    states training computes online); with topk > 0 also the target's top-k log-probs predicting each position
    (from the previous position's logits). The states are moved to the CPU to be stored, or with `on_device` left
    where the model computed them. With neither `layer_ids` nor topk (a token-only store) nothing is computed."""
    if not layer_ids and not topk:
        return [Captured(input_ids=list(s), num_prompt_tokens=n, hidden_states=None)
                for s, n in zip(sequences, num_prompt_tokens)]
    device = next(model.parameters()).device
    ids, mask, positions = _left_pad(sequences, pad_id, device)
    logits, hidden, _ = _forward(model, ids, mask, positions, use_cache=False)
    tapped = None
    if layer_ids:
        tapped = tap_layers(hidden, layer_ids)
        tapped = tapped if on_device else tapped.cpu()
    width = ids.shape[1]
    tops: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
    if topk:
        _check_head(model, hidden[-1][:, -1], logits)
        ids_k, logp_k = _head_topk(model, hidden[-1][:, :-1], topk)
        tops = [_joined_topk([_no_prediction(topk), (ids_k[r, width - len(s):], logp_k[r, width - len(s):])])
                for r, s in enumerate(sequences)]
    return [Captured(input_ids=list(s), num_prompt_tokens=n,
                     hidden_states=None if tapped is None else tapped[r, width - len(s):], **tops[r])
            for r, (s, n) in enumerate(zip(sequences, num_prompt_tokens))]


def logged_response_ids(target: Target, record: PromptRecord, prompt_ids: list[int],
                        template_kwargs: dict[str, Any]) -> tuple[list[int], bool]:
    """The logged response as the target would have emitted it after `prompt_ids`, ending with its stop token.

    Rendered with the chat template over the whole conversation; when the template frames the response so that
    the prompt ids are not a prefix (e.g. it rewrites earlier turns), fall back to the response text's own tokens
    plus the first stop token. Returns (ids, used_template)."""
    tok = target.tokenizer
    stop_ids = target.stop_token_ids()
    conversation = record.messages + [{"role": "assistant", "content": record.response}]
    text = chat_text(tok, conversation, record.tools, add_generation_prompt=False, **template_kwargs)
    full = tok(text, add_special_tokens=False)["input_ids"]
    if full[:len(prompt_ids)] == prompt_ids:
        response = full[len(prompt_ids):]
        for k, token in enumerate(response):  # cut after the stop token: the template's trailing newline
            if token in stop_ids:            # is not something the target emits
                return response[:k + 1], True
        return response, True
    return tok(record.response, add_special_tokens=False)["input_ids"] + stop_ids[:1], False



ENGINE_RESPONSES = "engine-responses.jsonl"  # in the store folder: a killed capture keeps what vLLM generated


def request_seed(seed: int, record: PromptRecord) -> int:
    """A prompt's sampling seed: the one its request logged, else a hash of the command's seed and its id."""
    return int((record.constraints or {}).get("seed", prompt_seed(seed, record.id)))


def engine_responses(cfg: CaptureConfig, target: Target, rendered: list[tuple[PromptRecord, list[int]]],
                     stop_ids: list[int]) -> dict[str, tuple[list[int], str | None]]:
    """The target's responses to `rendered` and why each ended (ENDINGS), generated by vLLM with continuous
    batching (sampling per request as `sampling_for` decides, seeded per prompt, under the request's own
    constraints). Responses a killed run already generated are read back from OUT/engine-responses.jsonl instead of
    being generated again."""
    from dflash_train.engine import VLLM_DTYPES, EngineJob, EngineRequest, ending, run_engine

    out = Path(cfg.out)
    path = out / ENGINE_RESPONSES
    done: dict[str, tuple[list[int], str | None]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                done[row["id"]] = (row["token_ids"], ending(row.get("finish_reason"), row.get("stop_reason"),
                                                            stop_ids))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut by a kill: that prompt is generated again
    todo = [(r, ids) for r, ids in rendered if r.id not in done]
    if todo:
        requests = []
        for record, ids in todo:
            chosen = sampling_for(record, cfg.temperature, cfg.top_p)
            requests.append(EngineRequest(id=record.id, prompt_token_ids=ids,
                                          max_tokens=sampling.response_cap(cfg.max_new_tokens, record.sampling),
                                          temperature=chosen.temperature, top_p=chosen.top_p,
                                          seed=request_seed(cfg.seed, record), constraints=record.constraints))
        device = torch.device(cfg.device or default_device()).type
        job = EngineJob(target=str(target.path), requests=requests, stop_token_ids=stop_ids,
                        dtype=VLLM_DTYPES[resolve_precision(cfg.dtype, device).name],
                        max_model_len=max(len(ids) for _, ids in todo) + cfg.max_new_tokens, mode="batch",
                        seed=cfg.seed, device=device, stream_to=str(path), engine_args=cfg.engine_args)
        print(f"capture: vLLM generates {len(todo)} responses ({len(done)} kept from an earlier run)", flush=True)
        result = run_engine(job, out / "engine", f"vLLM generating the responses of {cfg.prompts}")
        done.update({o.id: (o.token_ids, ending(o.finish_reason, o.stop_reason, stop_ids)) for o in result.outputs})
    return done

# ------------------------------------------------------------------------------------------------ the stage

def init_distributed(device_type: str) -> tuple[int, int]:
    """(rank, world_size). Several processes need a launcher that sets WORLD_SIZE/RANK (accelerate launch
    --multi_gpu, torchrun); on CPU the process group backend must be gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        # A long timeout: ranks finish their prompts at different times and wait at the final barrier.
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(hours=24))
    if dist.get_world_size() != world:
        raise RuntimeError(f"the launcher started {world} processes but torch.distributed sees "
                           f"{dist.get_world_size()}")
    return dist.get_rank(), world


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def capture(cfg: CaptureConfig) -> dict[str, Any] | None:
    """Run the capture stage; returns the manifest on rank 0 (None on other ranks)."""
    validate(cfg)
    if cfg.engine == "vllm":
        from dflash_train.engine import check_vllm

        if cfg.responses == "logged":
            raise UserError("--engine vllm generates the responses; --responses logged takes them from the log: "
                            "pass one or the other")
        check_vllm()
    elif cfg.engine_args:
        raise UserError("--engine-args configures vLLM: pass --engine vllm")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.device or default_device()
    precision = resolve_precision(cfg.dtype, device)
    rank, world = init_distributed(torch.device(device).type)
    if world > 1 and cfg.engine == "vllm":
        raise UserError("--engine vllm runs as one process (vLLM parallelises by itself): launch without "
                        "accelerate/torchrun")
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    started = time.time()
    records, ingest_report = load_prompt_records(cfg.prompts, cfg.split, cfg.limit)
    if cfg.constraints == "ignore":
        records = [replace(r, constraints=None) for r in records]
    samplings = {r.id: sampling_for(r, cfg.temperature, cfg.top_p) for r in records}  # all checked up front
    if cfg.engine == "own" and cfg.responses == "generate":
        for r in records:
            try:
                request_constraints.check_replayable(r.constraints, samplings[r.id].greedy, f"prompt {r.id}")
            except ValueError as err:
                raise UserError(str(err)) from None
    model_kwargs = {"device_map": cfg.device_map} if cfg.device_map else {}
    if rank == 0:
        print(f"capture: compute dtype {precision.describe()}", flush=True)
    target = load_target(cfg.target, dtype=precision.dtype, device=device, **model_kwargs)
    layer_ids = resolve_layer_ids(target.num_layers, cfg.layers, cfg.num_taps)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    if cfg.store_topk > vocab:
        raise UserError(f"--store-topk {cfg.store_topk} exceeds the target's vocabulary ({vocab})")
    stop_ids = target.stop_token_ids()
    pad_id = target.tokenizer.pad_token_id
    generation = {
        "responses": cfg.responses,
        "max_new_tokens": cfg.max_new_tokens,  # per prompt: the logged request's max_tokens where smaller
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "temperature": cfg.temperature,  # None: per logged request, greedy where the log has none
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "template_kwargs": cfg.template_kwargs,
        "add_generation_prompt": True,
        "stop_token_ids": stop_ids,
        "compute_dtype": precision.name,
        "engine": cfg.engine,
    }
    if cfg.constraints == "ignore":  # recorded only then: a store from before replayed nothing else either
        generation["constraints"] = cfg.constraints
    if cfg.engine == "vllm":
        from dflash_train.engine import vllm_version

        generation["engine_version"] = vllm_version()

    def open_writer(rank: int) -> StoreWriter:
        return StoreWriter(cfg.out, target=target.identity().to_dict(), target_layer_ids=layer_ids,
                           hidden_size=target.config.hidden_size, storage_dtype=cfg.storage, generation=generation,
                           ingest_report=ingest_report, shard_bytes=int(cfg.shard_size_mb * 2**20), rank=rank,
                           world_size=world, extra={"capture": {**asdict(cfg), "world_size": world,
                                                                "prompts": str(cfg.prompts),
                                                                "precision": precision.as_dict()}},
                           topk=cfg.store_topk, prompts=prompt_set(cfg.prompts, cfg.split, ingest_report))

    # rank 0 claims (and locks) the folder and checks it against this run's settings before any rank touches it
    writer = decided_by_rank0(lambda: open_writer(0), rank, world)  # None on the other ranks, which then open theirs
    if rank != 0:
        writer = open_writer(rank)
    try:
        return _capture_into(writer, cfg, target, records, samplings, layer_ids, stop_ids, pad_id, rank, world,
                             ingest_report, started)
    finally:
        writer.release()


def _capture_into(writer: StoreWriter, cfg: CaptureConfig, target: Target, records: list[PromptRecord],
                  samplings: dict[str, Sampling], layer_ids: list[int], stop_ids: list[int], pad_id: int, rank: int,
                  world: int, ingest_report: dict[str, Any] | None, started: float) -> dict[str, Any] | None:
    from tqdm import tqdm

    mine = [r for i, r in enumerate(records) if i % world == rank]
    stored = set(writer.done_ids)  # what an earlier, killed run of this command stored (or left out)
    if any(r.id in stored for r in mine):
        print(f"rank {rank}: resuming {cfg.out}: {sum(r.id not in stored for r in mine)} prompt(s) left", flush=True)

    rendered = []
    for record in mine:
        ids = target.render(record.messages, record.tools, **cfg.template_kwargs)
        left_out = ("prompt_too_long" if len(ids) > cfg.max_prompt_tokens else
                    "no_logged_response" if cfg.responses == "logged" and not record.response else None)
        if left_out is None:
            rendered.append((record, ids))
        elif record.id not in stored:
            writer.skip(record.id, left_out)
    rendered.sort(key=lambda item: -len(item[1]))  # similar lengths batch together: less padding
    # The batches are cut from all of this rank's prompts, stored or not, and a batch is computed whole while any
    # of its prompts is left to store: a rerun computes every prompt in the batch (the padding, the shapes, so the
    # rounding) an uninterrupted run computes it in, and stores what it stores, byte for byte.
    batches = [rendered[start:start + cfg.batch_size] for start in range(0, len(rendered), cfg.batch_size)]
    batches = [batch for batch in batches if any(r.id not in stored for r, _ in batch)]

    responses = (engine_responses(cfg, target, [item for batch in batches for item in batch], stop_ids)
                 if cfg.engine == "vllm" and batches else {})
    taps = [] if cfg.storage == NO_STATES else layer_ids  # a token-only store records no states
    tokens_done = generated = 0
    bar = tqdm(total=sum(map(len, batches)), desc=f"capture r{rank}" if world > 1 else "capture", unit="prompt",
               position=rank, dynamic_ncols=True)
    loop_start = time.time()
    try:
        for batch in batches:
            if cfg.engine == "vllm":  # the engine's responses; their states from one prefill
                captured = prefill_capture(target.model, [ids + responses[r.id][0] for r, ids in batch],
                                           [len(ids) for _, ids in batch], taps, pad_id, topk=cfg.store_topk)
                for (r, _), sample in zip(batch, captured):
                    sample.ended = responses[r.id][1]
            elif cfg.responses == "generate":
                captured = generate_and_capture(
                    target.model, [ids for _, ids in batch], taps,
                    [sampling.response_cap(cfg.max_new_tokens, r.sampling) for r, _ in batch], stop_ids, pad_id,
                    samplings=[samplings[r.id] for r, _ in batch],
                    seeds=[request_seed(cfg.seed, r) for r, _ in batch], topk=cfg.store_topk,
                    rules=[request_constraints.Rules(r.constraints, target.tokenizer, target.config.vocab_size, stop_ids,
                                                     ids)
                           if r.constraints else None for r, ids in batch])
            else:
                responses = [logged_response_ids(target, r, ids, cfg.template_kwargs)[0][
                                 :sampling.response_cap(cfg.max_new_tokens, r.sampling)] for r, ids in batch]
                captured = prefill_capture(target.model, [ids + resp for (_, ids), resp in zip(batch, responses)],
                                           [len(ids) for _, ids in batch], taps, pad_id, topk=cfg.store_topk)
            with writer.batch():  # a shard closes only after a whole batch
                for (record, _), sample in zip(batch, captured):
                    if record.id in stored:
                        continue
                    n = len(sample.input_ids)
                    loss_mask = torch.zeros(n, dtype=torch.bool)
                    loss_mask[sample.num_prompt_tokens:] = True
                    writer.add(torch.tensor(sample.input_ids), loss_mask, sample.hidden_states, id=record.id,
                               weight=record.weight, topk_ids=sample.topk_ids, topk_logprobs=sample.topk_logprobs,
                               note=answer_note(record, sample, target.tokenizer))
                    tokens_done += n
                    generated += n - sample.num_prompt_tokens
            bar.update(len(batch))
            elapsed = max(time.time() - loop_start, 1e-9)
            bar.set_postfix(tok_s=f"{tokens_done / elapsed:.0f}", new_tok_s=f"{generated / elapsed:.1f}")
    finally:
        bar.close()  # before any error line, so that the line stands alone
    writer.close(finalize=False)
    _barrier(world)
    manifest = None
    if rank == 0:
        manifest = finalize_store(cfg.out, ingest_report=ingest_report, extra=writer.extra)
        _print_summary(manifest, time.time() - started, cfg.out)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return manifest


def answer_note(record: PromptRecord, sample: Captured, tokenizer) -> dict[str, Any] | None:
    """What the store records of one answer beside its tokens: its request's constraint kind, why it ended, and,
    for an answer under a structured constraint that ended by itself, what is wrong with it under that constraint
    (null: valid). None for an unconstrained answer whose ending is not known (a logged response)."""
    kind = request_constraints.kind(record.constraints)
    if kind == "none" and sample.ended is None:
        return None
    note: dict[str, Any] = {"constraint": kind, "ended": sample.ended}
    if kind in request_constraints.STRUCTURED_KINDS and sample.ended in ("eos", "stop_token"):
        text = tokenizer.decode(sample.input_ids[sample.num_prompt_tokens:], skip_special_tokens=True)
        note["problem"] = request_constraints.answer_problem(record.constraints, text)
    return note


def _print_summary(m: dict[str, Any], seconds: float, out: str) -> None:
    per_token = m["bytes"] / m["num_tokens"] if m["num_tokens"] else 0.0
    over = 100 * (per_token / m["floor_bytes_per_token"] - 1) if m["num_tokens"] else 0.0
    dropped = ", ".join(f"{k} {v}" for k, v in m["dropped"].items()) or "none"
    print(f"capture {out}: {m['num_samples']} prompts, {m['num_tokens']} tokens, {m['bytes'] / 2**20:.1f} MiB in "
          f"{len(m['shards'])} shard(s), {per_token:.1f} bytes/token vs floor {m['floor_bytes_per_token']} "
          f"({over:+.2f}%), dropped: {dropped}, {seconds:.1f} s", flush=True)
    answers = m.get("answers") or {}
    constrained = {k: v for k, v in (answers.get("constraint") or {}).items() if k != "none"}
    if constrained:
        kinds = ", ".join(f"{k} {v}" for k, v in constrained.items())
        ended = ", ".join(f"{k} {v}" for k, v in answers["ended"].items())
        print(f"  constrained answers: {kinds}; ended by {ended}; under a structured constraint and ended by "
              f"themselves: {answers['structured_checked']}, of which not valid: "
              f"{len(answers['structured_invalid'])}", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CaptureConfig)


def config_from_args(args: argparse.Namespace) -> CaptureConfig:
    return from_args(CaptureConfig, args)


# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("the samples of the shards already written are kept (the store stays marked INCOMPLETE); rerun the "
               "same command to resume")


def run(args: argparse.Namespace) -> int:
    capture(config_from_args(args))
    return 0
