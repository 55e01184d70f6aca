"""Decoding settings, checked and normalised the way the OpenAI chat-completions API defines them. The one place
that says what a logged `temperature`, `top_p` or `max_tokens` means: ingest checks logged requests with it,
capture and eval check their flags and resolve each prompt's settings with it.

    temperature  a number in [0, 2]; 0 = greedy (argmax)
    top_p        a number in [0, 1]; nucleus sampling over the smallest set of most likely tokens whose
                 probability reaches top_p, which always holds the most likely token, so top_p 0 = greedy
    max_tokens   an integer >= 1 (`max_completion_tokens` is its newer name)

A value outside its range, non-finite, or not a number is a request the API refuses with an error, so a logged
request that carries one was never served as logged: ingest counts it as a bad record (`bad_sampling`) instead of
guessing. A setting the request left out is stored as null; capture then decodes greedily unless its flags say
otherwise (the API's own default temperature is 1: pass `--temperature 1` to replay such traffic as served).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


@dataclass(frozen=True)
class Sampling:
    """How one prompt is decoded, normalised: greedy is always (0.0, 1.0)."""
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check(name: str, value: Any) -> float:
    """`value` as a float if it is a valid `name` (temperature or top_p), else ValueError saying why."""
    low, high = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return number


def flag_check(name: str):
    """The options check of a `--temperature` / `--top-p` flag: None (not given) or a valid value."""
    low, high = RANGES[name]

    def check_flag(value: Any) -> str | None:
        if value is None:
            return None
        try:
            check(name, value)
        except ValueError:
            return f"must be a finite number in [{low:g}, {high:g}] (the OpenAI API's range)"
        return None
    return check_flag


MAX_TOKENS_LIMIT = 2**63 - 1  # the prompt table's int64 column


def check_max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ValueError(f"max_tokens must be an integer in [1, 2**63 - 1], got {value!r}")
    return int(value)


def logged(request: dict[str, Any]) -> dict[str, float | int | None]:
    """The decoding settings of a logged request ({temperature, top_p, max_tokens}, null where not logged);
    ValueError naming the key when one is not valid. Numbers logged as strings ("0.7") are read as numbers."""
    def number(key: str) -> Any:
        value = request.get(key)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        return value

    max_tokens = number("max_tokens") if request.get("max_tokens") is not None else number("max_completion_tokens")
    temperature, top_p = number("temperature"), number("top_p")
    return {"temperature": None if temperature is None else check("temperature", temperature),
            "top_p": None if top_p is None else check("top_p", top_p),
            "max_tokens": None if max_tokens is None else check_max_tokens(max_tokens)}


def response_cap(max_new_tokens: int, logged_settings: dict[str, Any] | None = None) -> int:
    """The most tokens a response may have: the stage's cap, or the request's logged max_tokens where smaller (the
    application's own limit is part of how the target is served)."""
    logged_max = (logged_settings or {}).get("max_tokens")
    return min(max_new_tokens, logged_max) if logged_max else max_new_tokens


def resolve(temperature: float | None, top_p: float | None,
            logged_settings: dict[str, Any] | None = None) -> Sampling:
    """A prompt's settings: each given one wins over the logged one; what neither gives is greedy / top_p 1.
    ValueError when a value is out of range. temperature 0 or top_p 0 -> greedy (0.0, 1.0)."""
    logged_settings = logged_settings or {}
    t = temperature if temperature is not None else logged_settings.get("temperature")
    p = top_p if top_p is not None else logged_settings.get("top_p")
    t = 0.0 if t is None else check("temperature", t)
    p = 1.0 if p is None else check("top_p", p)
    if t == 0.0 or p == 0.0:
        return Sampling()
    return Sampling(temperature=t, top_p=p)
