import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tiny import TOOL_CALL_REQUEST, WEATHER_TOOL
from tolerance import model_tolerance

from dflash_train.errors import UserError
from dflash_train.prompts import PromptRecord
from dflash_train.provenance import write_provenance
from dflash_train.sampling import Sampling
from dflash_train.stages.capture.command import capture, resolve_layer_ids
from dflash_train.stages.capture.config import CaptureConfig
from dflash_train.stages.capture.responses import logged_response_ids, sampling_for
from dflash_train.states import generate_and_capture, prefill_capture, sample_next
from dflash_train.store.reader import open_store
from dflash_train.store.verify import verify_store

from conftest import REPO_ROOT

TEXTS = ["Hello!", "Write a poem about the sea.", "def add(a, b):",
         "What is the capital of France? Answer in one word please, and then explain why in two sentences.",
         "Summarize", "0123456789 + - * /"]
LAYERS = [1, 3, 5]


def make_rows(n):
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": TEXTS[i % len(TEXTS)] * (1 + i % 3)}]
        if i % 4 == 3:  # multi-turn with a system prompt
            messages = [{"role": "system", "content": "Be brief."}, messages[0],
                        {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And more?"}]
        rows.append({"id": f"p{i:03d}", "messages": messages, "sampling": None,
                     "response": ["Paris.", "The sea is blue and wide.", "return a + b"][i % 3],
                     "source": "test", "weight": 1 + i % 2})
    return rows


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    import datasets

    out = tmp_path_factory.mktemp("prompts") / "ingested"
    rows = make_rows(24)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "eval": datasets.Dataset.from_list(make_rows(2))}).save_to_disk(str(out))
    (out / "report.json").write_text(json.dumps({"records_in": 26, "kept": 26}))
    write_provenance(out)  # marks the folder as a finished ingest output
    return out


def config(prompts_dir, target_dir, out, **kw):
    settings = dict(prompts=str(prompts_dir), target=str(target_dir), out=str(out), layers=LAYERS,
                    max_new_tokens=12, batch_size=5, dtype="fp32", shard_size_mb=0.01)
    settings.update(kw)
    return CaptureConfig(**settings)


@pytest.fixture(scope="module")
def one_process_store(prompts_dir, tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "one"
    capture(config(prompts_dir, tiny_target_dir, out))
    return out


def cli_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    env.pop("WORLD_SIZE", None)
    return env


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def teacher_forced(model, ids):
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


def test_num_taps_flag_and_its_old_spelling():
    import argparse

    from dflash_train.stages.capture.command import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flag in ("--num-taps", "--num-layers"):
        args = parser.parse_args(["--prompts", "p", "--out", "o", flag, "3"])
        assert config_from_args(args).num_taps == 3


def test_default_layer_rule():
    assert resolve_layer_ids(36, None, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert resolve_layer_ids(8, None, 3) == [1, 3, 5]
    assert resolve_layer_ids(8, [0, 2, 6], 5) == [0, 2, 6]
    with pytest.raises(UserError, match="layer id 7"):  # hidden_states[8] is after the final norm
        resolve_layer_ids(8, [1, 7], 5)
    with pytest.raises(UserError, match="repeat"):
        resolve_layer_ids(8, [1, 1], 5)


def test_batched_decode_equals_single_sample_forward_and_generate(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    prompts = [tiny_target.render(r["messages"]) for r in make_rows(4)]
    assert len({len(p) for p in prompts}) == 4  # mixed lengths: real left padding
    free = generate_and_capture(model, prompts, LAYERS, 10, tiny_target.stop_token_ids(), tok.pad_token_id)
    # Make row 1 stop at its 4th token: a stop token ends the row, and is stored with its states.
    stop = free[1].input_ids[len(prompts[1]) + 3]
    stops_after = free[1].input_ids[len(prompts[1]):].index(stop) + 1  # <= 4 of 10
    got = generate_and_capture(model, prompts, LAYERS, 10, [stop], tok.pad_token_id)
    for p, g in zip(prompts, got):
        response = g.input_ids[len(p):]
        assert g.input_ids[:len(p)] == p and g.num_prompt_tokens == len(p)
        assert (stop in response and response.index(stop) == len(response) - 1) or len(response) == 10
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, eos_token_id=stop, pad_token_id=stop)
        assert g.input_ids == ref[0].tolist()[:len(g.input_ids)]
        assert g.hidden_states.shape == (len(g.input_ids), 3 * 64)
        ref = teacher_forced(model, g.input_ids)
        torch.testing.assert_close(g.hidden_states, ref, rtol=0, atol=model_tolerance(model.config, ref))
    assert len(got[1].input_ids) == len(prompts[1]) + stops_after and got[1].input_ids[-1] == stop


def test_bf16_compute_batched_states_within_bf16_tolerance(tiny_target_dir):
    from dflash_train.target import load_target

    target = load_target(str(tiny_target_dir), dtype=torch.bfloat16)  # as the real target runs
    prompts = [target.render(r["messages"]) for r in make_rows(6)]
    got = generate_and_capture(target.model, prompts, LAYERS, 12, target.stop_token_ids(),
                               target.tokenizer.pad_token_id)
    exact = load_target(str(tiny_target_dir), dtype=torch.float32).model
    for g in got:
        # bf16 rounding makes padded and unpadded shapes differ a little: the batched states must be as close to
        # the fp32 truth as a single-sample bf16 forward is (broken padding gives errors of order 1).
        truth = teacher_forced(exact, g.input_ids)
        single = teacher_forced(target.model, g.input_ids).float()

        def rel(x):
            return ((x - truth).norm(dim=-1) / truth.norm(dim=-1)).max()

        assert rel(g.hidden_states.float()) < max(2 * rel(single), 1e-2), (rel(g.hidden_states.float()), rel(single))


def test_store_holds_teacher_forced_states_and_response_mask(one_process_store, tiny_target, prompts_dir):
    st = open_store(one_process_store)
    rows = {r["id"]: r for r in make_rows(24)}
    assert len(st) == 24 and sorted(st.ids) == sorted(rows)
    m = st.manifest
    assert m["target_layer_ids"] == LAYERS and m["hidden_size"] == 64 and m["num_tapped"] == 3
    assert m["target"] == tiny_target.identity().to_dict() and m["ingest_report"] == {"records_in": 26, "kept": 26}
    assert m["generation"]["max_new_tokens"] == 12 and m["generation"]["template_kwargs"] == {}
    assert len(m["shards"]) > 1 and verify_store(one_process_store) == []
    for item in st:
        row = rows[item["id"]]
        prompt = tiny_target.render(row["messages"])
        n = len(prompt)
        assert item["input_ids"][:n].tolist() == prompt and item["weight"] == row["weight"]
        assert not item["loss_mask"][:n].any() and item["loss_mask"][n:].all() and len(item["input_ids"]) > n
        ref = teacher_forced(tiny_target.model, item["input_ids"].tolist())
        torch.testing.assert_close(item["hidden_states"].float(), ref, rtol=1.6e-2, atol=1e-2)  # bf16 storage


def test_logged_responses_path(prompts_dir, tiny_target_dir, tiny_target, tmp_path):
    out = tmp_path / "logged"
    capture(config(prompts_dir, tiny_target_dir, out, responses="logged", limit=6))
    st = open_store(out)
    rows = {r["id"]: r for r in make_rows(6)}
    eos = tiny_target.tokenizer.eos_token_id
    assert len(st) == 6 and st.manifest["generation"]["responses"] == "logged"
    for item in st:
        row = rows[item["id"]]
        prompt = tiny_target.render(row["messages"])
        response = tiny_target.tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [eos]
        assert item["input_ids"].tolist() == prompt + response
        assert item["loss_mask"].tolist() == [False] * len(prompt) + [True] * len(response)
        ref = teacher_forced(tiny_target.model, item["input_ids"].tolist())
        torch.testing.assert_close(item["hidden_states"].float(), ref, rtol=1.6e-2, atol=1e-2)
    record = PromptRecord(id="x", messages=rows["p000"]["messages"], response="Paris.")
    ids, framed = logged_response_ids(tiny_target, record, tiny_target.render(record.messages), {})
    assert framed and ids[-1] == eos  # the chat template frames it; its trailing newline is cut


def test_a_token_only_capture_stores_the_same_tokens_without_states(prompts_dir, tiny_target_dir, one_process_store,
                                                                    tmp_path):
    out = tmp_path / "tokens"
    manifest = capture(config(prompts_dir, tiny_target_dir, out, storage="none"))
    full, st = open_store(one_process_store), open_store(out)
    assert manifest["kind"] == "tokens" and st.manifest["target_layer_ids"] == LAYERS and verify_store(out) == []
    by_id = {item["id"]: item for item in full}
    assert sorted(st.ids) == sorted(by_id)
    for item in st:
        ref = by_id[item["id"]]
        assert "hidden_states" not in item and item["weight"] == ref["weight"]
        assert torch.equal(item["input_ids"], ref["input_ids"]) and torch.equal(item["loss_mask"], ref["loss_mask"])
    assert st.manifest["bytes"] < full.manifest["bytes"] / 10  # 384 bytes of states per token at this tiny width


def test_a_token_only_capture_of_given_responses_runs_no_forward(prompts_dir, tiny_target_dir, tmp_path,
                                                                 monkeypatch):
    """Logged or engine-generated responses need the target's forward only for states or top-k: a token-only
    capture without --store-topk runs none; with it, the prefill runs for the top-k and still stores no states."""
    from dflash_train import states
    from dflash_train.engine import install
    from dflash_train.stages.capture import command as capture_mod

    real_forward = states._forward
    monkeypatch.setattr(states, "_forward", lambda *a, **k: pytest.fail("the target ran a forward"))
    capture(config(prompts_dir, tiny_target_dir, tmp_path / "logged", responses="logged", storage="none", limit=6))
    monkeypatch.setattr(install, "check_vllm", lambda: None)  # the engine's responses, as vLLM would return them
    monkeypatch.setattr(capture_mod, "engine_responses",
                        lambda cfg, target, rendered, stop, *_: ({r.id: ([7, 8, 9] + stop[:1], "eos")
                                                              for r, _ in rendered}, {}))
    capture(config(prompts_dir, tiny_target_dir, tmp_path / "engine", engine="vllm", storage="none", limit=6))
    engine_store = open_store(tmp_path / "engine")
    assert len(engine_store) == 6 and all(item["input_ids"][-4:-1].tolist() == [7, 8, 9] for item in engine_store)
    assert len(open_store(tmp_path / "logged")) == 6
    monkeypatch.setattr(states, "_forward", real_forward)
    capture(config(prompts_dir, tiny_target_dir, tmp_path / "topk", responses="logged", storage="none", limit=6,
                   store_topk=3))
    st = open_store(tmp_path / "topk")
    assert st.manifest["floor_bytes_per_token"] == 5 + 3 * 6
    assert all("hidden_states" not in item and item["topk_ids"].shape[1] == 3 for item in st)


def test_sampling_settings_and_seeded_sampling():
    logged = PromptRecord(id="a", messages=[], sampling={"temperature": 0.7, "top_p": 0.9})
    assert sampling_for(logged, None, None) == Sampling(0.7, 0.9)
    assert sampling_for(logged, 0.0, None) == Sampling(0.0, 1.0)  # greedy, normalised
    assert sampling_for(PromptRecord(id="b", messages=[]), None, None) == Sampling(0.0, 1.0)
    logits = torch.randn(3, 50)
    rows = [Sampling(0.0), Sampling(1.0, 1e-6), Sampling(5.0)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3)]  # noqa: E731
    a, b = sample_next(logits, rows, gens()), sample_next(logits, rows, gens())
    assert torch.equal(a, b)  # reproducible per seed
    assert a[0] == logits[0].argmax() and a[1] == logits[1].argmax()  # greedy; top-p keeps only the top token
    draws = {int(sample_next(logits, rows, [torch.Generator().manual_seed(s)] * 3)[2]) for s in range(20)}
    assert len(draws) > 3  # a hot temperature really samples


def test_sampling_is_normalised_as_the_openai_api_defines_it():
    assert sampling_for(PromptRecord(id="a", messages=[], sampling={"temperature": 0.7, "top_p": 0.0}), None,
                        None) == Sampling(0.0, 1.0)  # top_p 0 keeps only the most likely token: greedy
    assert sampling_for(PromptRecord(id="b", messages=[], sampling={"temperature": 0.0, "top_p": 0.3}), None,
                        None) == Sampling(0.0, 1.0)
    assert sampling_for(PromptRecord(id="c", messages=[], sampling={"temperature": 2.0, "top_p": 1.0}), None,
                        0.0) == Sampling(0.0, 1.0)  # the command's top_p 0 wins and is greedy too
    with pytest.raises(UserError, match=r"prompt d: logged temperature must be a finite number in \[0, 2\]"):
        sampling_for(PromptRecord(id="d", messages=[], sampling={"temperature": 2.5}), None, None)
    # sampling a tiny nucleus never divides by an empty distribution
    logits = torch.randn(2, 50)
    out = sample_next(logits, [Sampling(1.0, 0.0), Sampling(1.0, 1e-12)], [torch.Generator()] * 2)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_p_zero_in_a_log_captures_greedily(tmp_path, tiny_target_dir):
    """A logged `top_p: 0` made every capture die with `invalid multinomial distribution`, reruns included."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"request": {"messages": [{"role": "user", "content": text}],
                                                   "temperature": 0.9, "top_p": 0}}) + "\n" for text in TEXTS[:4]))
    logged = capture(config(log, tiny_target_dir, tmp_path / "logged"))
    greedy = capture(config(log, tiny_target_dir, tmp_path / "greedy", temperature=0.0))
    assert logged["num_samples"] == greedy["num_samples"] == 4
    a, b = open_store(tmp_path / "logged"), open_store(tmp_path / "greedy")
    tokens = lambda store: {store[i]["id"]: store[i]["input_ids"].tolist() for i in range(len(store))}  # noqa: E731
    assert tokens(a) == tokens(b)


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "-0.1"),
                                        ("--temperature", "2.5"), ("--top-p", "inf"), ("--top-p", "1.5")])
def test_capture_checks_sampling_flags_up_front(prompts_dir, tmp_path, capsys, flag, value):
    from dflash_train.cli import main as cli_main

    out = tmp_path / "store"
    assert cli_main(["capture", "--prompts", str(prompts_dir), "--out", str(out), flag, value]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"dflash-train capture: error: {flag} ") and "finite" in err[0]
    assert not out.exists()


OUT_OF_RANGE = [({"max_tokens": 0}, None, "max_tokens must be an integer in [1, 2**63 - 1]"),
                ({}, {"seed": 2**80}, "seed must be an integer in [0, 2**63 - 1]"),
                ({}, {"presence_penalty": 3.0}, "presence_penalty must be a number in [-2, 2]"),
                ({}, {"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
                ({}, {"logit_bias": {"1024": 5.0}}, "logit_bias names token id 1024, outside the target's vocabulary "
                                                    "(ids 0 to 1023)")]


@pytest.mark.parametrize("settings,constraints,words", OUT_OF_RANGE)
def test_a_prompt_record_out_of_range_is_one_line_naming_its_id_and_key(tmp_path, tiny_target_dir, capsys, settings,
                                                                        constraints, words):
    """A prompt folder an older ingest wrote (or a hand edit) may hold any value: a seed of 2**80 was a torch
    traceback in the middle of the run. Every record is checked before the target is loaded."""
    from tiny import write_prompt_folder

    from dflash_train.cli import main as cli_main

    folder = write_prompt_folder(tmp_path / "prompts", [("fine", None, {"seed": 2**63 - 1}),
                                                        ("bad", settings, constraints)])
    out, _ = tmp_path / "store", capsys.readouterr()  # what writing the folder printed
    assert cli_main(["capture", "--prompts", str(folder), "--target", str(tiny_target_dir), "--out", str(out),
                     "--layers", "1,3,5", "--max-new-tokens", "4", "--dtype", "fp32"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("dflash-train capture: error: prompt bad: logged ") and words in err[0]
    assert not out.exists()


def test_answers_under_a_grammar_are_counted_unchecked_never_valid(tmp_path, tiny_target_dir, capsys):
    """No checker here reads an EBNF grammar: its answers are counted as not checked, apart from the checked ones
    (they were counted checked and valid)."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"request": {"messages": [{"role": "user", "content": text}], **extra}}) + "\n"
                           for text, extra in (("Yes or no?", {"guided_grammar": 'root ::= "yes" | "no"'}),
                                               ("No or yes?", {"guided_choice": ["yes", "no"]}))))
    capture(config(log, tiny_target_dir, tmp_path / "st", max_new_tokens=8, storage="none"))
    answers = open_store(tmp_path / "st").manifest["answers"]
    assert answers["ended"] == {"eos": 2}, answers
    assert answers["structured_checked"] == 1 and answers["structured_invalid"] == {}
    assert list(answers["structured_unchecked"].values()) == ["a grammar is read only by the decoder's own matcher"]
    assert "ended by themselves: 1 checked, of which not valid: 0; not checked: 1" in capsys.readouterr().out


def test_tool_traffic_is_captured_as_served(tmp_path, tiny_target, tiny_target_dir):
    """Ingest -> capture of tool-calling requests: the stored prompt tokens are the chat template's rendering of
    the tool turns and the request's tool definitions (`apply_chat_template(messages, tools=...)`)."""
    from dflash_train.prompts import load_prompt_records
    from dflash_train.stages.ingest.command import ingest
    from dflash_train.stages.ingest.config import IngestConfig

    log = tmp_path / "agents.jsonl"
    log.write_text(json.dumps(TOOL_CALL_REQUEST) + "\n")
    ingest([log], tmp_path / "prompts", IngestConfig(max_prompt_tokens=0, progress=False))
    (record,), _ = load_prompt_records(tmp_path / "prompts", "eval")
    assert record.tools == [WEATHER_TOOL] and record.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "tool_calls" not in record.messages[0]  # null keys of the stored turns are left out
    served = tiny_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "18 C"}], tools=[WEATHER_TOOL], add_generation_prompt=True,
        tokenize=False)
    capture(config(tmp_path / "prompts", tiny_target_dir, tmp_path / "store", split="eval"))
    sample = open_store(tmp_path / "store")[0]
    prompt = sample["input_ids"][~sample["loss_mask"]].tolist()
    assert tiny_target.tokenizer.decode(prompt) == served


def test_an_empty_split_is_refused_in_one_line(tmp_path, capsys):
    from dflash_train.cli import main as cli_main
    from dflash_train.stages.ingest.command import ingest
    from dflash_train.stages.ingest.config import IngestConfig

    log = tmp_path / "one.jsonl"
    log.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    ingest([log], tmp_path / "prompts", IngestConfig(max_prompt_tokens=0, progress=False))  # 0 train, 1 eval
    out, _ = tmp_path / "store", capsys.readouterr()  # what ingest printed
    assert cli_main(["capture", "--prompts", str(tmp_path / "prompts"), "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"dflash-train capture: error: no prompts in {tmp_path / 'prompts'}, split 'train' "
                   f"(ingest kept 1: 0 train, 1 eval)"]
    assert not out.exists()


def test_prompt_folders_written_before_tool_support_still_load(prompts_dir):
    """prompts_dir is written the old way: turns of {role, content} only and no `tools` column."""
    from dflash_train.prompts import load_prompt_records

    records, _ = load_prompt_records(prompts_dir, "train")
    assert len(records) == 24 and all(r.tools is None for r in records)
    assert all(set(m) == {"role", "content"} for r in records for m in r.messages)


def test_kill_and_resume_gives_every_prompt_exactly_once(prompts_dir, tiny_target_dir, one_process_store, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dflash_train", "capture", "--prompts", str(prompts_dir), "--target",
           str(tiny_target_dir), "--out", str(out), "--layers", "1,3,5", "--max-new-tokens", "12",
           "--batch-size", "2", "--dtype", "fp32", "--shard-size-mb", "0.005"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal = out / "journal-r000.json"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(json.loads(journal.read_text())["shards"]) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the capture finished before it could be killed"
    stored_before = {i for s in json.loads(journal.read_text())["shards"] for i in s["ids"]}
    assert 0 < len(stored_before) < 24
    with pytest.raises(UserError, match="incomplete"):
        open_store(out)
    rerun = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming" in rerun.stdout and "24 prompts" in rerun.stdout
    st = open_store(out)
    assert len(st) == 24 and sorted(st.ids) == sorted(r["id"] for r in make_rows(24))
    assert verify_store(out) == []
    reference = {item["id"]: item for item in open_store(one_process_store)}
    for item in st:
        assert torch.equal(item["input_ids"], reference[item["id"]]["input_ids"])


def read_into(stream, chunks):
    for chunk in iter(lambda: stream.read1(4096), b""):
        chunks.append(chunk.decode(errors="replace"))


def shard_contents(out):
    """Each shard of a store: its metadata and the sha256 of each of its tensors' bytes (where two stores differ, the
    tensor that does)."""
    from safetensors import safe_open

    contents = {}
    for path in sorted(out.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            contents[path.name] = {"metadata": f.metadata(), **{
                key: hashlib.sha256(f.get_tensor(key).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for key in f.keys()}}
    return contents


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_capture_killed_mid_shard_resumes_to_the_samples_of_an_uninterrupted_one_byte_for_byte(
        prompts_dir, tiny_target_dir, tmp_path, dtype):
    """Batches are fixed by the whole sorted prompt list and shards close at batch boundaries, so the prompts a
    rerun captures are batched (padded, computed) exactly as in an uninterrupted run: bf16 rounding depends on
    the batch a prompt is computed in."""
    whole = tmp_path / "whole"  # 6 batches of 4 prompts; a shard fills up in the 5th prompt, inside the 2nd batch
    capture(config(prompts_dir, tiny_target_dir, whole, dtype=dtype, batch_size=4, max_new_tokens=40,
                   shard_size_mb=0.25))
    assert len(shard_contents(whole)) >= 3
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dflash_train", "capture", "--prompts", str(prompts_dir), "--target",
           str(tiny_target_dir), "--out", str(out), "--layers", "1,3,5", "--max-new-tokens", "40",
           "--batch-size", "4", "--dtype", dtype, "--shard-size-mb", "0.25"]
    every_step = dict(TQDM_MININTERVAL="0", TQDM_MINITERS="1")  # the progress bar prints every batch
    proc = subprocess.Popen(cmd, env={**cli_env(), **every_step}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = []  # what it prints, the progress bar (prompts captured so far) among it
    reader = threading.Thread(target=read_into, args=(proc.stdout, printed), daemon=True)
    reader.start()
    journal = out / "journal-r000.json"
    deadline = time.time() + 120
    stored = 0
    while time.time() < deadline and proc.poll() is None:
        if journal.exists():  # kill once a shard is written and a further batch is captured, not yet written
            stored = sum(s["num_samples"] for s in json.loads(journal.read_text())["shards"])
            progress = [int(n) for n in re.findall(r"(\d+)/24", "".join(printed))]
            if stored and progress and stored < max(progress) < 24:
                break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join()
    assert not (out / "manifest.json").exists(), "the capture finished before it could be killed"
    assert 0 < stored < 24
    rerun = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming" in rerun.stdout
    assert shard_contents(out) == shard_contents(whole)
    # and the files themselves: the store writes the safetensors header's keys in one order (safetensors' own order
    # is random per process), so a shard's sha256 depends on its samples only
    assert {p.name: p.read_bytes() for p in out.glob("shard-*.safetensors")} == \
        {p.name: p.read_bytes() for p in whole.glob("shard-*.safetensors")}
    assert verify_store(out) == []


def test_two_processes_under_accelerate_equal_one_process(prompts_dir, tiny_target_dir, one_process_store,
                                                           tmp_path):
    out = tmp_path / "two"
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "dflash_train", "capture",
           "--prompts", str(prompts_dir), "--target", str(tiny_target_dir), "--out", str(out),
           "--layers", "1,3,5", "--max-new-tokens", "12", "--batch-size", "5", "--dtype", "fp32",
           "--shard-size-mb", "0.01"]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two, one = open_store(out), open_store(one_process_store)
    assert two.manifest["capture"]["world_size"] == 2
    assert {s["file"][:10] for s in two.manifest["shards"]} == {"shard-r000", "shard-r001"}
    assert len(two) == len(one) == 24 and sorted(two.ids) == sorted(one.ids)
    reference = {item["id"]: item for item in one}
    for item in two:
        ref = reference[item["id"]]
        assert torch.equal(item["input_ids"], ref["input_ids"]) and torch.equal(item["loss_mask"], ref["loss_mask"])
        assert item["weight"] == ref["weight"]
        torch.testing.assert_close(item["hidden_states"], ref["hidden_states"], rtol=1.6e-2, atol=1e-2)


def test_raw_log_prompts_and_logged_sampling(tiny_target_dir, tmp_path):
    from dflash_train.logs.records import iter_records

    log = tmp_path / "log.jsonl"
    lines = (REPO_ROOT / "data" / "examples" / "messages.jsonl").read_text().splitlines()
    log.write_text("\n".join(lines + lines[:1]) + "\n")  # a repeated request: one sample, weight 2
    capture(config(log, tiny_target_dir, tmp_path / "st", max_new_tokens=4))
    st = open_store(tmp_path / "st")
    records = {r["id"]: r for r in iter_records(log)}
    assert sorted(st.ids) == sorted(records) and len(st) == len(lines)
    first = next(iter_records(log))
    assert first["sampling"]["temperature"] == 0.8  # sampled at the logged temperature, seeded per prompt
    assert {item["id"]: item["weight"] for item in st}[first["id"]] == 2


def test_a_logged_max_tokens_caps_that_response_as_served(tiny_target, tiny_target_dir, tmp_path):
    """The application's own max_tokens is part of how the target is served: a row stops at its own cap, with the
    tokens and states it would have had under a larger one, and a logged request's max_tokens caps its response
    in the stage where it is smaller than --max-new-tokens."""
    model, stop = tiny_target.model, tiny_target.stop_token_ids()
    prompts = [tiny_target.render([{"role": "user", "content": t}]) for t in TEXTS[:2]]
    capped = generate_and_capture(model, prompts, LAYERS, [3, 10], stop, 0)
    free = generate_and_capture(model, prompts, LAYERS, 10, stop, 0)
    n = len(capped[0].input_ids)
    assert n - capped[0].num_prompt_tokens == min(3, len(free[0].input_ids) - free[0].num_prompt_tokens)
    assert capped[0].input_ids == free[0].input_ids[:n]
    assert torch.allclose(capped[0].hidden_states, free[0].hidden_states[:n])
    assert capped[1].input_ids == free[1].input_ids

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"request": {"messages": [{"role": "user", "content": text}], **extra}}) + "\n"
                           for text, extra in ((TEXTS[1], {"max_tokens": 2}), (TEXTS[3], {}))))
    capture(config(log, tiny_target_dir, tmp_path / "st", max_new_tokens=6))
    from dflash_train.logs.records import iter_records

    caps = {r["id"]: r["sampling"]["max_tokens"] for r in iter_records(log)}
    new_tokens = {s["id"]: int(s["loss_mask"].sum()) for s in open_store(tmp_path / "st")}
    assert sorted(caps.values(), key=str) == [2, None] and new_tokens.keys() == caps.keys()
    assert all(n <= (caps[i] or 6) for i, n in new_tokens.items())
    assert any(n > 2 for i, n in new_tokens.items() if caps[i] is None)  # the cap is the request's, not the stage's


# --- top-k soft labels ------------------------------------------------------------------------------------------


def full_forward_topk(model, ids, k):
    """Reference: top-k of the log-softmax of one plain forward; row t predicts token t (from the logits at t-1)."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    values, top = logp[:-1].topk(k, dim=-1)
    return top, values


def assert_topk_matches(got, model, k):
    """Log-probs from the capture's batched decode (or prefill) vs one plain forward: the same function summed in
    another order, so within the rounding tolerance of the logits' scale."""
    ids, values = full_forward_topk(model, got.input_ids, k)
    assert got.topk_ids.shape == (len(got.input_ids), k) and got.topk_ids.dtype == torch.int32
    assert got.topk_ids[0].tolist() == [0] * k and (got.topk_logprobs[0] == float("-inf")).all()
    torch.testing.assert_close(got.topk_logprobs[1:], values, rtol=0, atol=model_tolerance(model.config, values))
    assert torch.equal(got.topk_ids[1:].long(), ids)


def test_topk_capture_equals_a_full_forward_on_both_paths(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    prompts = [tiny_target.render(r["messages"]) for r in make_rows(4)]
    batched = generate_and_capture(model, prompts, LAYERS, 8, tiny_target.stop_token_ids(), tok.pad_token_id, topk=5)
    for p, g in zip(prompts, batched):
        assert len(g.input_ids) > len(p)  # the decode steps' top-k are covered, not only the prompt's
        assert_topk_matches(g, model, 5)
        single = generate_and_capture(model, [p], LAYERS, 8, tiny_target.stop_token_ids(), tok.pad_token_id,
                                      topk=5)[0]  # the padded batch row equals the sample alone
        assert single.input_ids == g.input_ids and torch.equal(single.topk_ids, g.topk_ids)
        torch.testing.assert_close(single.topk_logprobs[1:], g.topk_logprobs[1:], rtol=0,
                                   atol=model_tolerance(model.config, g.topk_logprobs[1:]))
    sequences = [g.input_ids for g in batched]
    logged = prefill_capture(model, sequences, [len(p) for p in prompts], LAYERS, tok.pad_token_id, topk=3)
    for g in logged:
        assert_topk_matches(g, model, 3)
    plain = generate_and_capture(model, prompts[:1], LAYERS, 8, tiny_target.stop_token_ids(), tok.pad_token_id)
    assert plain[0].topk_ids is None and plain[0].topk_logprobs is None  # off by default


def test_store_topk_through_the_command_and_resume_with_another_k_refused(prompts_dir, tiny_target_dir,
                                                                       tiny_target, tmp_path):
    from dflash_train.cli import main as cli_main

    out = tmp_path / "topk"
    args = ["capture", "--prompts", str(prompts_dir), "--target", str(tiny_target_dir), "--out", str(out),
            "--layers", "1,3,5", "--max-new-tokens", "6", "--dtype", "fp32", "--limit", "4",
            "--responses", "logged"]
    assert cli_main(args + ["--store-topk", "4"]) == 0
    st = open_store(out)
    assert st.manifest["topk"] == 4 and verify_store(out) == []
    assert st.manifest["floor_bytes_per_token"] == 3 * 64 * 2 + 4 * 6
    for item in st:
        ids, values = full_forward_topk(tiny_target.model, item["input_ids"].tolist(), 4)
        assert torch.equal(item["topk_ids"][1:], ids) and (item["topk_logprobs"][0] == float("-inf")).all()
        torch.testing.assert_close(item["topk_logprobs"][1:], values, rtol=1e-3, atol=1e-3)  # float16 storage
    with pytest.raises(UserError, match="'topk'"):
        capture(config(prompts_dir, tiny_target_dir, out, max_new_tokens=6, limit=4, responses="logged",
                       store_topk=2))
    assert len(open_store(out)) == 4  # the refused rerun left the store intact
    with pytest.raises(UserError, match="store-topk"):
        capture(config(prompts_dir, tiny_target_dir, tmp_path / "bad", store_topk=-1))


# --- the store folder: claimed, one prompt set, one clear line on disk full and read-only -------------------------


def test_a_capture_into_a_store_another_capture_is_writing_is_refused(prompts_dir, tiny_target_dir, tmp_path):
    from dflash_train.provenance import OutputClaim

    out = tmp_path / "busy"
    running = OutputClaim(out, "capture")  # what a capture that is still running holds (a file lock)
    with pytest.raises(UserError, match=r"busy is being written by another run right now"):
        capture(config(prompts_dir, tiny_target_dir, out, limit=2))
    assert [p.name for p in out.iterdir()] == [".dflash-train.lock"]  # nothing of the refused run
    running.release()
    capture(config(prompts_dir, tiny_target_dir, out, limit=2))
    assert len(open_store(out)) == 2


def test_capture_refuses_a_folder_it_did_not_create(prompts_dir, tiny_target_dir, tmp_path):
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in prompts_dir.iterdir()}
    with pytest.raises(UserError, match="already holds files that capture did not write"):
        capture(config(prompts_dir, tiny_target_dir, prompts_dir, limit=2))  # --out = the ingest folder itself
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in prompts_dir.iterdir()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-r000-00000.safetensors").write_bytes(b"someone else's file")
    with pytest.raises(UserError, match="already holds files that capture did not write"):
        capture(config(prompts_dir, tiny_target_dir, foreign, limit=2))
    assert (foreign / "shard-r000-00000.safetensors").read_bytes() == b"someone else's file"
    assert [p.name for p in foreign.iterdir()] == ["shard-r000-00000.safetensors"]


def test_capturing_the_eval_split_into_a_train_store_is_refused(prompts_dir, tiny_target_dir, one_process_store):
    with pytest.raises(UserError, match=r"another prompt set.*'prompts\.split' is \"train\" in journal-r000\.json, "
                                        r"\"eval\" in this run"):
        capture(config(prompts_dir, tiny_target_dir, one_process_store, split="eval"))
    st = open_store(one_process_store)
    assert len(st) == 24 and st.manifest["prompts"]["split"] == "train" and verify_store(one_process_store) == []


def capture_cmd(prompts_dir, target_dir, out):
    return [sys.executable, "-m", "dflash_train", "capture", "--prompts", str(prompts_dir), "--target",
            str(target_dir), "--out", str(out), "--layers", "1,3,5", "--max-new-tokens", "12", "--dtype", "fp32",
            "--shard-size-mb", "0.005"]


def test_disk_full_during_capture_is_one_line(prompts_dir, tiny_target_dir, tmp_path):
    """A real full disk (a 48 KiB tmpfs): safetensors fails writing a shard; the capture says so in one line."""
    from sandbox import run_with_mount

    disk = tmp_path / "disk"
    proc = run_with_mount(capture_cmd(prompts_dir, tiny_target_dir, disk / "store"), disk, size="48k",
                          env=cli_env(), timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dflash-train capture: error: cannot write ") and "disk full" in last, last
    assert str(disk / "store") in last and "the capture resumes" in last


def test_read_only_output_folder_is_one_line(prompts_dir, tiny_target_dir, tmp_path):
    from sandbox import run_with_mount

    ro = tmp_path / "ro"
    proc = run_with_mount(capture_cmd(prompts_dir, tiny_target_dir, ro), ro, read_only=True, env=cli_env(),
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"dflash-train capture: error: cannot write {ro}: read-only file system. Choose a writable folder"


# --- requests decoded under their own constraints, as production decoded them ------------------------------------

ROUTE_SCHEMA = {"type": "object", "properties": {"intent": {"type": "string", "enum": ["question", "other"]},
                                                 "summary": {"type": "string"}},
                "required": ["intent", "summary"], "additionalProperties": False}
# kind: (the logged request's extra fields, the user's message, the SamplingParams a vLLM user writes for it)
CONSTRAINED = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "route", "schema": ROUTE_SCHEMA}}},
                    "Route this message: how do I reset my password?",
                    {"structured_outputs": {"json": ROUTE_SCHEMA}}),
    "json_object": ({"response_format": {"type": "json_object"}}, "Give me a JSON object describing a cat.",
                    {"structured_outputs": {"json_object": True}}),
    "regex": ({"structured_outputs": {"regex": "(Yes|No), because [a-z ]+\\."}}, "Is the sea salty?",
              {"structured_outputs": {"regex": "(Yes|No), because [a-z ]+\\."}}),
    "choice": ({"guided_choice": ["positive", "negative", "neutral"]}, "Sentiment of: I love this phone!",
               {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}),
    "grammar": ({"extra_body": {"guided_grammar": 'root ::= "The answer is " [0-9]+ "."'}}, "What is 12 + 30?",
                {"structured_outputs": {"grammar": 'root ::= "The answer is " [0-9]+ "."'}}),
    "tool_call": ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                  "What's the weather in Paris?",
                  {"structured_outputs": {"json": WEATHER_TOOL["function"]["parameters"]}}),
    "stop": ({"stop": [". ", "\n"]}, "Tell me about the sea.", {"stop": [". ", "\n"], "detokenize": True}),
    "penalties": ({"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.4,
                   "logit_bias": {"30": -50}, "seed": 11},
                  "List ten fruits.", {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.4,
                                       "logit_bias": {30: -50.0}, "seed": 11}),
}
CONSTRAINED_TOKENS = 40

DIRECT_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
job = json.load(open(sys.argv[1]))
llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
          kv_cache_memory_bytes=1 << 28)
params = []
for p in job["params"]:
    if "structured_outputs" in p:
        p["structured_outputs"] = StructuredOutputsParams(**p["structured_outputs"])
    if "logit_bias" in p:
        p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
    params.append(SamplingParams(temperature=0, max_tokens=job["max_tokens"],
                                 stop_token_ids=job["stop_token_ids"], **p))
outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
json.dump([list(o.outputs[0].token_ids) for o in outputs], open(sys.argv[2], "w"))
"""


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(__import__("dflash_train.engine.install", fromlist=["x"]).vllm_version() is None,
                    reason="vLLM is not installed (make install installs it)")
def test_capture_replays_each_constraint_as_vllm_generate_decodes_it(smollm2, tmp_path):
    """The one-pass capture and the vLLM capture of requests under each kind of constraint both equal
    `vllm.LLM.generate` with the SamplingParams a user writes for those requests, token for token (fp32)."""
    from dflash_train.engine.install import engine_environment

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"request": {"messages": [{"role": "user", "content": text}], "temperature": 0,
                                                    "max_tokens": CONSTRAINED_TOKENS, **extra}}) + "\n"
                           for extra, text, _ in CONSTRAINED.values()))
    stores = {}
    for engine in ("own", "vllm"):
        stores[engine] = tmp_path / engine
        assert capture(CaptureConfig(prompts=str(log), out=str(stores[engine]), engine=engine, dtype="fp32",
                                     storage="none", max_new_tokens=64, batch_size=4)) is not None
    own, vllm = ({s["id"]: s for s in open_store(stores[e])} for e in ("own", "vllm"))
    from dflash_train.prompts import load_prompt_records

    records = {r.messages[0]["content"]: r for r in load_prompt_records(log)[0]}
    ids = [records[text].id for _, text, _ in CONSTRAINED.values()]
    job = {"target": str(smollm2.path), "max_tokens": CONSTRAINED_TOKENS, "stop_token_ids": smollm2.stop_token_ids(),
           "prompts": [smollm2.render(records[text].messages, records[text].tools) for _, text, _ in CONSTRAINED.values()],
           "params": [params for _, _, params in CONSTRAINED.values()]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    script = tmp_path / "direct.py"
    script.write_text(DIRECT_GENERATE)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "job.json"), str(tmp_path / "out.json")],
                          env={**os.environ, **engine_environment("cpu")}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    direct = json.loads((tmp_path / "out.json").read_text())
    for kind, rid, expected in zip(CONSTRAINED, ids, direct):
        for engine, store in (("own", own), ("vllm", vllm)):
            sample = store[rid]
            answer = sample["input_ids"][sample["loss_mask"]].tolist()
            assert answer == expected, f"{kind}: {engine} capture differs from vLLM's generate"
    answers = open_store(stores["own"]).manifest["answers"]
    assert answers == open_store(stores["vllm"]).manifest["answers"]
    assert answers["constraint"] == {"json_schema": 2, "json_object": 1, "regex": 1, "choice": 1, "grammar": 1,
                                     "settings": 2}
    assert answers["structured_invalid"] == {} and answers["structured_checked"] >= 4
    stop_answer = own[ids[list(CONSTRAINED).index("stop")]]
    text = smollm2.tokenizer.decode(stop_answer["input_ids"][stop_answer["loss_mask"]].tolist())
    assert answers["ended"].get("stop_string") and (". " in text or "\n" in text)
