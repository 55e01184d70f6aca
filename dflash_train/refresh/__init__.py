"""refresh: the next round of an LLM service's logs, against the drafter serving it now (`dflash-train refresh`)."""
