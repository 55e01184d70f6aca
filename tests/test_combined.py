"""The combined speculator (spec_decode.combined): per request and step, prompt lookup's block where the rule picks it,
else the drafter's; in the real vLLM on CPU with the embedded target and the shipped general drafter, greedy output
stays plain decoding's, and its blocks come from lookup where the answer copies its prompt and from the drafter
where it does not."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from dflash_train.spec_decode.combined import Combined
from dflash_train.spec_decode.lookup import CombinedRule, parse_combined
from dflash_train.spec_decode.suffix import SuffixDraft, suffix_problem
from test_engine import needs_vllm

REPO = Path(__file__).resolve().parent.parent
GENERAL = REPO / "drafters" / "smollm2-135m-instruct-general"


def test_each_request_gets_lookups_block_where_the_rule_picks_it_and_its_tokens_are_counted_by_source():
    combined = Combined(CombinedRule(k=3, confidence=0.6))
    drafts = [[7, 7, 7, 7, 7], [8, 8, 8, 8, 8], [9, 9, 9, 9, 9], [6, 6, 6, 6, 6]]
    contexts = [np.array([1, 2, 3, 4, 1, 2]),  # 1 2 matched: lookup drafts 3 4 1 (its k)
                np.array([1, 2, 3, 4, 1, 2]),  # matched too, but the drafter is sure of its first draft
                np.array([5, 6, 7]),  # nothing repeats: the drafter's
                None]  # decodes nothing this step (a prefill chunk): the drafter's, as vLLM had it
    looked = combined.look(contexts, 5)
    none = [None] * 4  # no suffix tree in this rule
    assert looked == [([3, 4, 1], 2), ([3, 4, 1], 2), ([], 0), None] and not combined.skips_drafter(looked, none)
    blocks = combined.choose(drafts, [0.2, 0.9, 0.1, 0.1], looked, none, ["a", "b", "c", "d"])
    assert blocks == [[3, 4, 1], drafts[1], drafts[2], drafts[3]]
    assert combined.pending == {"a": ("lookup", False), "b": ("drafter", False), "c": ("drafter", False),
                                "d": ("drafter", False)}
    # the next step verified them: a kept 2 of its 3 drafts (+ the target's token), b none, c all 5; d drafted
    # nothing that step (the scheduler dropped its drafts)
    combined.settle(["a", "b", "c", "d"], [[3, 4, 5], [2], [9] * 6, [4]], [3, 5, 5, 0])
    assert combined.counts == {"drafter": {"blocks": 2, "drafted": 10, "accepted": 5},
                               "lookup": {"blocks": 1, "drafted": 3, "accepted": 2, "without_drafter": 0}}


def test_at_confidence_1_a_step_where_lookup_matched_for_every_decoding_request_skips_the_drafter():
    combined = Combined(CombinedRule(k=4, confidence=1))
    copying, new = np.array([1, 2, 3, 4, 1, 2]), np.array([5, 6, 7])
    assert not combined.skips_drafter(combined.look([copying, new], 7), [None] * 2)  # the second needs the drafter
    assert not combined.skips_drafter(combined.look([None], 7), [None])  # nothing decodes: vLLM's own step
    looked = combined.look([copying, None], 2)  # the engine's K cuts lookup's block
    assert looked == [([3, 4], 2), None] and combined.skips_drafter(looked, [None] * 2)
    blocks = combined.choose([[0, 0], [0, 0]], None, looked, [None] * 2, ["a", "b"])  # the drafter drafted nothing
    assert blocks == [[3, 4], [0, 0]] and combined.pending == {"a": ("lookup", True), "b": ("drafter", True)}
    combined.settle(["a", "b"], [[3, 4, 1], [5]], [2, 0])
    assert combined.counts["lookup"] == {"blocks": 1, "drafted": 2, "accepted": 2, "without_drafter": 1}
    assert CombinedRule(confidence=0.6).asks_drafter and not CombinedRule(confidence=1).asks_drafter


needs_suffix = pytest.mark.skipif(suffix_problem() is not None, reason=str(suffix_problem()))


@needs_suffix
def test_the_suffix_trees_block_is_verified_where_its_score_reaches_the_rule_and_then_the_drafter_is_not_needed():
    combined = Combined(CombinedRule(k=4, confidence=0.6, suffix=1.0))
    answer = [11, 12, 13, 14, 15, 16]
    # request "old" answered 11..16; finished (no longer in the batch), its answer stays in the global cache
    prompts = [np.array([1, 2, 3]), np.array([4, 5])]
    contexts = [np.array([1, 2, 3, *answer])]
    combined.suffix_drafts(["old"], prompts[:1], [answer], contexts, 7, 1024)
    assert combined.suffix.cached() == {"old"} and set(combined.suffix.cache.active_requests) == {"old"}
    new = np.array([4, 5, 11, 12, 13])  # a new request whose answer starts as the old one's did
    looked = combined.look([new], 7)
    suffixed = combined.suffix_drafts(["new"], prompts[1:], [[11, 12, 13]], [new], 7, 1024)
    assert set(combined.suffix.cache.active_requests) == {"new"}  # "old" left the batch: stopped, still cached
    (draft,) = suffixed
    assert draft.token_ids == [14, 15, 16] and draft.score >= 1.0 and looked == [([], 0)]
    assert combined.skips_drafter(looked, suffixed)  # its block is decided without the drafter
    assert combined.choose([[0] * 7], None, looked, suffixed, ["new"]) == [[14, 15, 16]]
    assert combined.pending == {"new": ("suffix", True)}
    combined.settle(["new"], [[14, 15, 16, 2]], [3])
    assert combined.counts["suffix"] == {"blocks": 1, "drafted": 3, "accepted": 3, "without_drafter": 1}


def test_a_weak_suffix_draft_leaves_the_choice_to_lookup_and_the_drafter():
    rule = CombinedRule(k=4, confidence=0.6, suffix=2.0)
    weak, strong = SuffixDraft([7, 8], 0.5, 2), SuffixDraft([7, 8, 9], 2.5, 4)
    assert rule.source(weak.score, 2, 2, 0.2) == "lookup" and rule.source(weak.score, 2, 0, 0.2) == "drafter"
    assert rule.source(strong.score, 3, 2, 0.99) == "suffix"
    assert rule.needs_drafter(weak.score, 2, 0) and not rule.needs_drafter(strong.score, 3, 0)
    assert CombinedRule(confidence=1.0, suffix=2.0).needs_drafter(0.5, 2, 0)  # nothing else drafts: the drafter
    assert not CombinedRule(confidence=1.0, suffix=2.0).needs_drafter(0.5, 2, 1)  # lookup, not asked
    assert rule.source(9.0, 0, 0, 0.1) == "drafter"  # an empty draft is never taken
    assert parse_combined(rule.setting()) == rule and CombinedRule().suffix is None


@needs_vllm
def test_the_plugin_stays_off_on_a_vllm_it_does_not_know_in_one_line(monkeypatch, caplog):
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dflash_train.spec_decode import combined

    before = GPUModelRunner.propose_draft_token_ids
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setenv("DFLASH_TRAIN_LOOKUP", "on")
    with caplog.at_level(logging.WARNING, logger="vllm.dflash_train.combined"):
        combined.register()
    assert GPUModelRunner.propose_draft_token_ids is before  # nothing wrapped
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.dflash_train.combined"]
    assert line == ("dflash-train combined speculator off: written for vLLM 0.32.*, this is vLLM 0.33.0 "
                    "(DFLASH_TRAIN_LOOKUP ignored)")


def decode_losslessly(prompts: dict[str, str], rule: CombinedRule, tmp_path: Path) -> tuple[dict, dict]:
    """The lossless check's engine job (`check`: each prompt alone, in order, plain then speculative, to its natural
    stop) with the combined speculator under `rule`, fp32, greedy, in the real vLLM with the embedded target and the
    shipped general drafter: each speculative answer token for token plain decoding's, its blocks by source adding
    up to vLLM's own count. Returns the plain outputs and the speculative ones by prompt name."""
    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine
    from dflash_train.target import load_tokenizer, render_prompt, resolve_target

    target = resolve_target("smollm2-135m-instruct")
    tokenizer = load_tokenizer(str(target))
    requests = [EngineRequest(id=name, prompt_token_ids=render_prompt(tokenizer, [{"role": "user", "content": p}]),
                              max_tokens=64) for name, p in prompts.items()]
    job = EngineJob(target=str(target), requests=requests, stop_token_ids=[tokenizer.eos_token_id],
                    drafter=str(GENERAL), max_model_len=512, mode="check", speculative_tokens=[7],
                    combined=rule.setting())
    result = run_engine(job, tmp_path, "the combined speculator")
    (run,) = result.timed["runs"]
    plain = result.by_id()
    spec = {o["id"]: o for o in run["outputs"]}
    for name in prompts:
        assert spec[name]["token_ids"] == plain[name].token_ids, name  # lossless
        sources = spec[name]["sources"]
        assert sum(c["accepted"] for c in sources.values()) == sum(spec[name]["accepted"]), name  # vLLM's count
        assert sum(c["blocks"] for c in sources.values()) == len(spec[name]["accepted"]), name
    return plain, spec


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("confidence", [0.6, 1.0])
def test_in_vllm_it_is_lossless_and_drafts_from_lookup_where_the_answer_copies_the_prompt(tmp_path, confidence):
    """The lossless check's engine job (`check`: each prompt alone, plain then speculative, to its natural stop) with
    the combined speculator: fp32, greedy, token for token plain decoding's on a prompt that loops, one whose answer
    copies the prompt and one whose answer is new; the copying answer's blocks mostly lookup's. At confidence 0.6
    the new one's are mostly the drafter's (its first draft is sure there, and lookup rarely matches); at confidence
    1 (lookup wherever it matched) most of lookup's blocks come at steps that skipped the drafter's pass."""
    prompts = {"loops": "Write the word hello 40 times.",
               "copies": "Copy this text exactly: Alice sent Bob a letter. Bob sent Carol a letter. Carol sent Dave "
                         "a letter. Dave sent Erin a letter.",
               "new": "Explain photosynthesis in two sentences."}
    _, spec = decode_losslessly(prompts, CombinedRule(k=4, confidence=confidence), tmp_path)
    copies, new = spec["copies"]["sources"], spec["new"]["sources"]
    assert copies["lookup"]["blocks"] > 2 * copies["drafter"]["blocks"], copies
    assert copies["lookup"]["accepted"] > copies["lookup"]["blocks"]  # lookup's blocks are kept there
    if confidence < 1:
        assert new["drafter"]["blocks"] > 2 * new["lookup"]["blocks"], new
        assert copies["lookup"]["without_drafter"] == 0
    else:
        assert copies["lookup"]["without_drafter"] > copies["lookup"]["blocks"] / 2, copies


@needs_vllm
@needs_suffix
@pytest.mark.slow
def test_in_vllm_an_answer_that_repeats_an_earlier_one_is_drafted_by_the_suffix_tree_which_holds_only_the_engines(
        tmp_path):
    """The lossless check's engine job with the combined speculator and its suffix tree: fp32, greedy, token for
    token plain decoding's; the second request asks what the first asked, so its answer repeats the first one's and
    most of its blocks are the suffix tree's; a request for new text gets most of its blocks from the drafter; before
    each request the tree's global cache held exactly the answers this engine had produced before it."""
    from dflash_train.spec_decode.lookup import SUFFIX_SCORE

    prompts = {"first": "Name the planets of the solar system, each with one fact about it.",
               "again": "Name the planets of the solar system, each with one fact about it!",
               "new": "Explain photosynthesis in two sentences."}
    plain, spec = decode_losslessly(prompts, CombinedRule(k=4, confidence=0.6, suffix=SUFFIX_SCORE), tmp_path)
    assert plain["again"].token_ids[:20] == plain["first"].token_ids[:20]  # the premise: the answer repeats
    again, new = spec["again"]["sources"], spec["new"]["sources"]
    assert again["suffix"]["blocks"] > again["drafter"]["blocks"] + again["lookup"]["blocks"], again
    assert again["suffix"]["accepted"] > 2 * again["suffix"]["blocks"], again  # its blocks are kept
    assert again["suffix"]["without_drafter"] > 0, again  # and need no drafter's pass
    assert new["drafter"]["blocks"] > new["suffix"]["blocks"], new
    # the first request sets the speculator up at its first step (nothing to count before it); then 1, 2 answers
    assert [spec[name]["suffix_answers_before"] for name in prompts] in ([None, 1, 2], [0, 1, 2])


def _two_prompt_job(**fields):
    """A lossless-check job (each prompt plain, then with the shipped general drafter at K 7) on two short prompts."""
    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.target import load_tokenizer, render_prompt, resolve_target

    target = resolve_target("smollm2-135m-instruct")
    tokenizer = load_tokenizer(str(target))
    prompts = {"copies": "Copy this exactly: the red fox ran past the red barn.", "new": "Name three colours."}
    requests = [EngineRequest(id=name, prompt_token_ids=render_prompt(tokenizer, [{"role": "user", "content": p}]),
                              max_tokens=24) for name, p in prompts.items()]
    return EngineJob(target=str(target), requests=requests, stop_token_ids=[tokenizer.eos_token_id],
                     drafter=str(GENERAL), max_model_len=256, mode="check", speculative_tokens=[7], **fields)


@needs_vllm
@pytest.mark.slow
def test_with_the_setting_unset_a_dflash_engine_decodes_as_it_does_without_the_plugin(tmp_path, monkeypatch):
    """vLLM loads the plugin in every engine (its entry point); without DFLASH_TRAIN_LOOKUP the wrapped drafting
    step must be vLLM's own: the same greedy drafts and tokens as an engine whose VLLM_PLUGINS leaves it out."""
    from importlib.metadata import entry_points

    from dflash_train.engine.runner import run_engine

    monkeypatch.delenv("DFLASH_TRAIN_LOOKUP", raising=False)
    job = _two_prompt_job()
    outputs = {}
    for name, allowed in (("with", None),
                          ("without", [e.name for e in entry_points(group="vllm.general_plugins")
                                       if e.value != "dflash_train.spec_decode.combined:register"])):
        if allowed is None:
            monkeypatch.delenv("VLLM_PLUGINS", raising=False)
        else:
            assert allowed  # another plugin is named, so the list is one that excludes ours (an empty one is none)
            monkeypatch.setenv("VLLM_PLUGINS", ",".join(allowed))
        result = run_engine(job, tmp_path / name, f"a dflash engine {name} the plugin")
        (run,) = result.timed["runs"]
        outputs[name] = {o["id"]: (o["token_ids"], o["accepted"]) for o in run["outputs"]}
        assert {i: tokens for i, (tokens, _) in outputs[name].items()} == {
            o.id: o.token_ids for o in result.outputs}  # lossless, so the drafts are what may differ
    assert outputs["with"] == outputs["without"]


@needs_vllm
@pytest.mark.parametrize("setting", ["k=-1", "confidence=2", "garbage"])
def test_a_bad_combined_setting_stops_the_engine_job_at_its_start_in_one_line_naming_it(tmp_path, setting):
    """Not at the first request: the job's plain engine, which the check starts first, never starts."""
    from dflash_train.engine.runner import LOG_FILE, run_engine
    from dflash_train.errors import UserError

    job = _two_prompt_job(combined=setting)
    with pytest.raises(UserError) as stopped:
        run_engine(job, tmp_path, "the combined speculator")
    assert f"the combined speculator: the vLLM engine exited with 1: ValueError: DFLASH_TRAIN_LOOKUP={setting!r}: " \
           in str(stopped.value)
    assert "\n" not in str(stopped.value)
    assert "Initializing a V1 LLM engine" not in (tmp_path / LOG_FILE).read_text()
