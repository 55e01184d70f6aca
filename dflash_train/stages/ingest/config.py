"""The ingest stage's options: `IngestConfig` (the `dflash-train ingest` flags are derived from its fields)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.options import at_least, in_range, option, validate
from dflash_train.target import DEFAULT_TARGET


@dataclass
class IngestConfig:
    """The ingest stage's options (besides the log files and --out); the flags are derived from these fields."""
    eval_fraction: float = option(0.02, check=in_range(0, 1, low_open=True, high_open=True),
                                  help="share of prompts held out for eval, by hash of the prompt id (at least 1)")
    max_prompts: int | None = option(None, check=at_least(1), help="stop after this many unique prompts")
    seed: int | None = option(None, help="mixed into the split hash; without it the split depends on the prompt "
                                         "id only")
    scrub: bool = option(True, help="keep PII (e-mails, phones, keys, ...) as is")
    target: str = option(DEFAULT_TARGET, help="target whose tokenizer and chat template measure "
                                              "--max-prompt-tokens, and whose vocabulary holds the token ids a "
                                              "request names (logit_bias, stop_token_ids)")
    max_prompt_tokens: int = option(2048, check=at_least(0), help="skip prompts longer than this as rendered by "
                                                                 "the target (0 = no limit: no tokenizer is loaded, "
                                                                 "and token ids and grammars are checked at capture)")
    max_bad_fraction: float = option(0.5, check=in_range(0, 1),
                                     help="fail when a file has a larger share of malformed/unknown/empty/non-UTF-8 "
                                          "records")
    exclude_ids: str | None = option(None, metavar="FILE",
                                     help="a file of prompt ids, one a line, that earlier ingests took (a refresh "
                                          "round's earlier rounds): their records are counted as seen and not "
                                          "ingested again, so their split stays the one decided then; the ids "
                                          "found are listed in --out's seen_ids.txt")
    progress: bool = True

    def validate(self) -> None:
        validate(self)
