"""Ingest's first pass: dedup the canonical records, apply the token limit (the prompt as the target renders it),
the target's vocabulary (the token ids a request names) and the engine's grammar compile in batches, and append
the kept records to a temporary JSON-lines file, counting everything per source."""

from __future__ import annotations

import json

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.compile_check import CompileCheck
from dflash_train.logs.records import PromptRow
from dflash_train.logs.values import SourceStats
from dflash_train.prompts import split_hash, template_inputs
from dflash_train.stages.ingest.config import IngestConfig

TOKENIZE_BATCH = 256


class TokenLimit:
    """Measures prompts as the target serves them: its chat template with the generation prompt; checks the
    token ids a request names (logit_bias, stop_token_ids) against its vocabulary, as vLLM does; and compiles
    each distinct structured constraint as the engine will, for its tokenizer, bounded in time (`compile_check`).
    Use as a context manager (the compiler runs in a child process)."""

    def __init__(self, target: str, max_tokens: int):
        from dflash_train.target import load_tokenizer, vocab_size

        self.grammars = CompileCheck(target)
        self.grammars.start()  # its tokenizer loads beside this one: a log of constrained requests waits less
        try:
            self.tokenizer = load_tokenizer(target)
            self.vocab_size = vocab_size(target)
        except BaseException:
            self.grammars.close()
            raise
        self.max_tokens = max_tokens

    def __enter__(self) -> TokenLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.grammars.close()

    def reasons(self, records: list[PromptRow]) -> list[tuple[str, str] | None]:
        """None for a prompt that fits, else (reason, detail)."""
        from jinja2.exceptions import TemplateError

        from dflash_train.target import chat_text

        out: list[tuple[str, str] | None] = [None] * len(records)
        texts, index = [], []
        for i, record in enumerate(records):
            constraints = request_constraints.loads(record["constraints"])
            try:
                sampling.check_record(None, constraints, self.vocab_size)
            except ValueError as err:
                out[i] = ("bad_constraint", str(err))
                continue
            if problem := self.grammars.problem(constraints):
                out[i] = ("bad_constraint", problem)
                continue
            try:
                texts.append(chat_text(self.tokenizer, *template_inputs(record)))
                index.append(i)
            except (TemplateError, ValueError, TypeError) as err:
                out[i] = ("template_error", str(err))
        if texts:
            lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            for i, n in zip(index, lengths):
                if n > self.max_tokens:
                    out[i] = ("too_long", f"{n} tokens > {self.max_tokens}")
        return out


class Collector:
    """The first pass: dedups records, applies the token limit in batches and appends the kept ones to a
    temporary JSON-lines file, counting everything in the records' SourceStats. Records of an excluded id are
    counted as seen and go no further: the split (and its one-eval fallback) is decided among the new prompts
    only."""

    def __init__(self, sink, limit: TokenLimit | None, config: IngestConfig, excluded: set[str] = frozenset()):
        self.sink, self.limit, self.config = sink, limit, config
        self.excluded = excluded  # ids taken by earlier ingests (--exclude-ids): counted as seen, not kept
        self.seen: set[str] = set()  # the excluded ids found in these logs
        self.occurrences: dict[str, int] = {}  # prompt id -> times seen: the dedup set; its values become weights
        self.rejected: dict[str, str] = {}  # prompt id -> reason, for prompts the token limit or template refused
        self.pending: list[tuple[str, PromptRow, SourceStats]] = []
        self.kept = self.eval_count = 0
        self.lowest: tuple[float, str | None] = (2.0, None)  # the smallest split hash, for the 1-eval fallback

    def full(self) -> bool:
        return self.config.max_prompts is not None and self.kept >= self.config.max_prompts

    def add(self, where: str, record: PromptRow, stats: SourceStats) -> None:
        rid = record["id"]
        if rid in self.excluded:  # before the limits: an earlier ingest took it as it was, whatever they say now
            self.seen.add(rid)
            stats.counts["seen"] += 1
            return
        if rid in self.occurrences:
            self.occurrences[rid] += 1
            if rid in self.rejected:
                stats.skip(where, self.rejected[rid], "same prompt as an earlier one")
            else:
                stats.counts["duplicates"] += 1
            return
        self.occurrences[rid] = 1
        self.pending.append((where, record, stats))
        room = None if self.config.max_prompts is None else self.config.max_prompts - self.kept
        if len(self.pending) >= TOKENIZE_BATCH or (room is not None and len(self.pending) >= room):
            self.flush()

    def flush(self) -> None:
        records = [record for _, record, _ in self.pending]
        verdicts = self.limit.reasons(records) if self.limit else [None] * len(records)
        for (where, record, stats), verdict in zip(self.pending, verdicts):
            rid = record["id"]
            if verdict is not None:  # duplicates seen while the prompt was pending share its fate
                n = self.occurrences[rid]
                self.rejected[rid] = verdict[0]
                stats.counts["duplicates"] -= n - 1
                stats.skip(where, verdict[0], verdict[1], count=n)
                continue
            self.sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.kept += 1
            stats.counts["kept"] += 1
            u = split_hash(rid, self.config.seed)
            self.eval_count += u < self.config.eval_fraction
            self.lowest = min(self.lowest, (u, rid))
        self.pending.clear()

    def weight_stats(self) -> tuple[int, int]:
        """Total and largest weight of the kept prompts."""
        kept = [n for rid, n in self.occurrences.items() if rid not in self.rejected]
        return sum(kept), max(kept)
