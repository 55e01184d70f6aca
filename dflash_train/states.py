"""The target's forward that records its tapped hidden states: capture stores them, training computes them online.

Two ways over a batch of sequences, both with left padding (the attention mask and position ids come from it, so
each row sees exactly what a single-sample forward would):

  prefill_capture       one forward over complete sequences (prompt + answer): capture's `--responses logged` path,
                        and the states training computes for a token-only store (`--engine vllm` records them in
                        vLLM's own forwards instead: `engine.taps`, the same values)
  generate_and_capture  decoding with a KV cache that records the states of every position in the same pass (the
                        prefill gives the prompt's, each decode step those of the token it feeds): capture's own
                        responses

With topk = K > 0 both also return, for every position t, the target's K most likely tokens and their
log-probabilities (fp32 log-softmax of the full vocabulary, temperature 1, not renormalised) for the distribution
that predicts token t, i.e. from the logits at t-1 (position 0 has none: ids 0, log-probs -inf). The prompt's come
from the final hidden states of the prefill through the LM head, a bounded number of rows at a time; each generated
token's from the very logits it was decoded from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.errors import UserError
from dflash_train.sampling import Sampling
from dflash_train.model.modeling_dflash import cache_keyword, tap_layers


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
    """One batched prefill over complete sequences (the `--responses logged` path, and the states training computes
    online); with topk > 0 also the target's top-k log-probs predicting each position
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
