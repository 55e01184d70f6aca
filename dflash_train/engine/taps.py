"""Inside the engine's child: the target's tapped hidden states (and top-k log-probs) recorded from vLLM's own forward
passes while it generates, so that capture needs no second forward over prompt + answer (`states.prefill_capture`).

The values are the ones `states` defines (its module docstring): row t of the states is HF hidden_states[i + 1] of
each tapped layer i (`tap_layers`), the residual stream after decoder layer i; row t of the top-k is the fp32
log-softmax top-k of the logits at t - 1 (row 0: ids 0, log-probs -inf). How they come out of vLLM:

- States. A forward hook on each tapped decoder layer: vLLM's layer returns (hidden_states, residual) and the next
  layer's fused add-norm sums them, so the residual stream after layer i is their sum (layer 0's residual is the
  embedding). A hook on the whole model then maps the step's flattened tokens to (request, position): the model
  runner's batch order (`input_batch.req_ids`), its `query_start_loc` and the positions the model was given.
- Top-k. From vLLM's own logits (`compute_logits`: its LM head, scaling and soft-capping included), before any
  sampling parameter or grammar mask touches them: for each request's last token of a step, the logits the runner
  computes to sample from (`_sampled_logits` wraps the call); for the others (a prompt's), `compute_logits` over
  the model's output, the final norm of every token (`_topk`).
- Prefix caching (vLLM's default) serves a prompt's leading blocks from another request's KV cache: those
  positions are never computed in this request. The same token prefix has the same causal states, so they are
  taken from the request that computed them (the same tokens, found by block hashes), in memory while it runs,
  from its file after. Turning the cache off instead would prefill shared system prompts again, and its on-by-default
  is what plain generation runs (BENCHMARKS.md "Capture's states from vLLM's forwards").
- The final token of an answer is never fed back: once a request finishes, its whole sequence is sent again as a
  one-token request (`tail_id`); the prefix cache holds all of it but the last block, so that request computes a
  few positions (its last partial KV block: on CPU such a job runs at a block of 32, `jobs.STATES_BLOCK_SIZE_CPU`),
  the final token's among them (and the top-k it predicts, kept as one row past the end so that a request served
  this sequence's blocks from the cache has the top-k its first computed token needs).

Each finished request's rows go to one safetensors file in the job's states folder (`states_file`), written before
its response is streamed, so that a response on record always has its states on disk.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash_train.model.modeling_dflash import tap_layers

TAIL = "\x00tail"  # suffix of the id of a finished request's re-run (`tail_id`)


def tail_id(request_id: str) -> str:
    return request_id + TAIL


def states_file(folder: str | Path, request_id: str) -> Path:
    """The file of one request's states: named by a hash of its id (ids are the user's strings)."""
    return Path(folder) / f"{hashlib.sha256(request_id.encode()).hexdigest()[:32]}.safetensors"


def read_states(path: str | Path) -> dict[str, torch.Tensor]:
    """A request's file: input_ids [S], and hidden_states [S, n*H] (model dtype) and/or topk_ids [S + 1, K] int32
    and topk_logprobs [S + 1, K] float32 (row S: the top-k after the final token, which the store does not keep)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def _prefix_hashes(tokens: list[int], block: int) -> Iterator[tuple[int, bytes]]:
    """(end, digest) of each block-aligned prefix of `tokens`: one hash chained over its blocks, the key under which
    `Recorder` files the requests holding that prefix and looks them up."""
    h = hashlib.sha256()
    for end in range(block, len(tokens) + 1, block):
        h.update(torch.tensor(tokens[end - block:end], dtype=torch.int64).numpy().tobytes())
        yield end, h.digest()


@dataclass
class _Request:
    tokens: list[int]  # the prompt; the whole sequence once it finished
    states: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (positions, rows)
    topk: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (row, ids, logps)
    written: Path | None = None


def _scatter(parts: list[tuple[torch.Tensor, ...]], rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The rows of `parts` (positions, *values) at their positions below `rows`, a position computed twice (a
    preempted request, the tail re-run's last block) from its latest computation; and which rows were filled."""
    at = torch.cat([p[0] for p in parts])
    latest = torch.full((rows,), -1, dtype=torch.int64)
    keep = at < rows
    latest.scatter_reduce_(0, at[keep], torch.arange(len(at))[keep], "amax")
    filled = latest >= 0
    out = []
    for k in range(1, len(parts[0])):
        values = torch.cat([p[k] for p in parts])
        column = torch.zeros(rows, *values.shape[1:], dtype=values.dtype)
        column[filled] = values[latest[filled]]
        out.append(column)
    return out, filled


class Recorder:
    """Hooks on the in-process model of one vLLM engine that record every computed token's tapped states and top-k
    per request (see the module docstring); `finish` writes a request's file once its tail re-run is done."""

    def __init__(self, folder: str | Path, layer_ids: list[int], topk: int, block_size: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layer_ids, self.topk, self.block = list(layer_ids), topk, block_size
        self.requests: dict[str, _Request] = {}
        self.by_prefix: dict[bytes, list[str]] = {}  # hash of a block-aligned token prefix -> requests holding it
        self.outputs: dict[int, torch.Tensor] = {}
        self.runner: Any = None
        self.hooks: list[Any] = []  # torch's handles, for `remove`
        self.from_cache = 0  # positions taken from the request that computed them (the prefix cache served them)
        self.tail_rows = 0  # positions the tail re-runs computed (the final tokens', and the blocks they end)
        # the rows the runner computes logits of after the forward (each request's last): their top-k from those
        self.pending: tuple[list[tuple[_Request | None, torch.Tensor]], torch.Tensor] | None = None

    def install(self, worker: Any) -> None:
        """Called in the engine's worker (`LLM.collective_rpc`): the hooks on its model."""
        self.runner = worker.model_runner
        model = self.runner.get_model()
        layers = model.model.layers
        self.hooks = [layers[i].register_forward_hook(self._layer_hook(i)) for i in self.layer_ids]
        self.hooks.append(model.register_forward_hook(self._model_hook, with_kwargs=True))
        self.logits = model.compute_logits
        if self.topk:
            model.compute_logits = self._sampled_logits

    def remove(self, worker: Any) -> None:
        """The hooks taken off again (`LLM.collective_rpc`): the engine decodes on as plain vLLM (the demo's probe
        times requests on it after its capture sample)."""
        for hook in self.hooks:
            hook.remove()
        if self.topk:
            worker.model_runner.get_model().compute_logits = self.logits

    def _layer_hook(self, i: int):
        def hook(module, args, output) -> None:
            hidden, residual = output
            self.outputs[i + 1] = hidden if residual is None else hidden + residual  # HF hidden_states[i + 1]
        return hook

    def add(self, request_id: str, tokens: list[int]) -> None:
        """A request about to be added to the engine (a tail re-run is not: it records into its request)."""
        self.requests[request_id] = _Request(list(tokens))
        self._register(request_id, 0)

    def _register(self, request_id: str, start: int) -> None:
        """The block-aligned prefixes of the request's tokens past `start` tokens, by hash."""
        for end, digest in _prefix_hashes(self.requests[request_id].tokens, self.block):
            if end > start:
                self.by_prefix.setdefault(digest, []).append(request_id)

    def extend(self, request_id: str, tokens: list[int]) -> None:
        """A request finished with `tokens` (prompt + answer): its tail re-run is about to be added."""
        req = self.requests[request_id]
        before = len(req.tokens)
        req.tokens = list(tokens)
        self._register(request_id, before - before % self.block)

    @torch.no_grad()
    def _model_hook(self, module, args, kwargs, output) -> None:
        runner = self.runner
        batch = runner.input_batch
        n_reqs = batch.num_reqs
        starts = runner.query_start_loc.cpu[:n_reqs + 1].tolist()
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        final = output[0] if isinstance(output, tuple) else output
        n = starts[-1]
        positions = positions[:n].to("cpu", torch.int64, copy=True)  # the runner reuses its buffer
        tapped = tap_layers(self.outputs, self.layer_ids)[:n].cpu() if self.layer_ids else None
        self.outputs.clear()
        self._flush_pending()
        top, last = None, []
        if self.topk:  # all but each request's last row (`_sampled_logits`)
            inner = torch.ones(n, dtype=torch.bool)
            inner[[b - 1 for a, b in zip(starts, starts[1:]) if b > a]] = False
            top = torch.zeros(n, self.topk, dtype=torch.int32), torch.zeros(n, self.topk)
            if bool(inner.any()):
                top[0][inner], top[1][inner] = self._topk(final[:n][inner])
        for r, rid in enumerate(batch.req_ids[:n_reqs]):
            a, b = starts[r], starts[r + 1]
            user_id = rid.rpartition("-")[0]  # vLLM's id: the user's + "-" + 8 characters
            req = self.requests.get(user_id.removesuffix(TAIL))
            if a == b:
                continue
            if user_id.endswith(TAIL):
                self.tail_rows += b - a
            at = positions[a:b]
            if top is not None:
                last.append((req, at[-1:] + 1))  # logits at t predict t + 1
            if req is None:
                continue
            if tapped is not None:
                req.states.append((at, tapped[a:b].clone()))
            if top is not None and b - a > 1:
                req.topk.append((at[:-1] + 1, top[0][a:b - 1].clone(), top[1][a:b - 1].clone()))
        if last:
            self.pending = last, final[[b - 1 for a, b in zip(starts, starts[1:]) if b > a]].clone()

    def _sampled_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """vLLM's `compute_logits`, which the runner calls on each request's last row after the forward: their top-k
        taken from its logits before any sampling parameter or grammar mask touches them."""
        from dflash_train.states import topk_logprobs

        logits = self.logits(hidden)
        if self.pending is not None and logits.shape[0] == self.pending[1].shape[0]:
            ids, values = topk_logprobs(logits, self.topk)
            self._record_last(ids.cpu(), values.cpu())
        return logits

    def _flush_pending(self) -> None:
        """The last rows' top-k, where the runner did not compute their logits (`_sampled_logits`)."""
        if self.pending is not None:
            self._record_last(*self._topk(self.pending[1]))

    def _record_last(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        for r, (req, at) in enumerate(self.pending[0]):
            if req is not None:
                req.topk.append((at, ids[r:r + 1], values[r:r + 1]))
        self.pending = None

    def _topk(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k (`states.topk_logprobs`) of vLLM's own logits of every row of `final`, a bounded number of
        rows at a time."""
        from dflash_train.states import TOPK_CHUNK_ELEMENTS, topk_logprobs

        step = max(1, TOPK_CHUNK_ELEMENTS // self.runner.model_config.get_vocab_size())
        ids, values = [torch.zeros(0, self.topk, dtype=torch.int32)], [torch.zeros(0, self.topk)]
        for s in range(0, final.shape[0], step):
            i, v = topk_logprobs(self.logits(final[s:s + step]), self.topk)
            ids.append(i.cpu())
            values.append(v.cpu())
        return torch.cat(ids), torch.cat(values)

    def _rows(self, request_id: str, rows: int, seen: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """The first `rows` state rows and `rows + 1` top-k rows of a request, those of a prefix it did not compute
        (the cache served it) from a request that did."""
        req = self.requests[request_id]
        if req.written is not None:
            from safetensors import safe_open

            with safe_open(str(req.written), "pt") as f:
                return {name: f.get_slice(name)[:rows + (name != "hidden_states")] for name in f.keys()
                        if name != "input_ids"}
        out, cached = self._computed(request_id, rows)
        if cached and not seen:
            self.from_cache += cached
        if cached:
            donor = self._donor(request_id, req.tokens[:cached], seen | {request_id})
            for name, value in self._rows(donor, cached, seen | {request_id}).items():
                out[name][:value.shape[0]] = value
        return out

    def _computed(self, request_id: str, rows: int) -> tuple[dict[str, torch.Tensor], int]:
        """What the request computed itself of its first `rows` positions, and how many leading ones it did not
        (its cached prefix: state rows below it, top-k rows up to it); a gap past that prefix is an error."""
        req = self.requests[request_id]
        out: dict[str, torch.Tensor] = {}
        cached = 0
        for name, parts, n in (("states", req.states, rows), ("topk", req.topk, rows + 1)):
            if not (self.layer_ids if name == "states" else self.topk):
                continue
            values, filled = _scatter(parts, n) if parts else ([], torch.zeros(n, dtype=torch.bool))
            if name == "topk":
                filled[0] = True  # position 0: nothing predicts it
            lead = int((~filled).long().cumprod(0).sum()) if name == "states" else \
                int((~filled[1:]).long().cumprod(0).sum())
            if not bool(filled[lead + (name == "topk"):].all()):
                raise RuntimeError(f"vLLM computed no {name} for some positions of request {request_id!r} past its "
                                   f"cached prefix ({int(filled.sum())} of {n} rows, first {lead})")
            cached = max(cached, lead)
            if name == "states":
                out["hidden_states"] = values[0] if values else torch.zeros(0)
            else:
                ids, logps = values if values else (torch.zeros(n, self.topk, dtype=torch.int32),
                                                    torch.zeros(n, self.topk))
                ids[0], logps[0] = 0, float("-inf")
                out.update(topk_ids=ids, topk_logprobs=logps)
        return out, cached

    def _donor(self, request_id: str, prefix: list[int], seen: frozenset[str]) -> str:
        """A request that holds `prefix` and computed more of it than the asking one did (a written one first)."""
        digest = next((d for end, d in _prefix_hashes(prefix, self.block) if end == len(prefix)), None)
        best, best_cached = None, len(prefix)
        for other in self.by_prefix.get(digest, []):
            req = self.requests[other]
            if other in seen or req.tokens[:len(prefix)] != prefix:
                continue
            if req.written is not None:
                return other
            if req.states or req.topk:
                try:
                    cached = self._computed(other, len(prefix))[1]
                except RuntimeError:  # it has not computed all of the prefix yet
                    continue
                if cached < best_cached:
                    best, best_cached = other, cached
        if best is None:
            raise RuntimeError(f"vLLM served {len(prefix)} prompt tokens of request {request_id!r} from its prefix "
                               f"cache and no other request of this job computed them")
        return best

    def finish(self, request_id: str) -> Path:
        """The request's tail re-run finished: its rows (the cached prefix filled in) written to its file."""
        from safetensors.torch import save_file

        req = self.requests[request_id]
        rows = len(req.tokens)
        out = self._rows(request_id, rows)
        out["input_ids"] = torch.tensor(req.tokens, dtype=torch.int64)
        path = states_file(self.folder, request_id)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        req.states, req.topk, req.written = [], [], path
        return path
