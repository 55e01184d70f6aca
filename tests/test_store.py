import errno
import json
import pickle

import pytest
import torch

from dflash_train.cli import main as cli_main
from dflash_train.errors import UserError
from dflash_train.store import writer as store_writer
from dflash_train.store.format import dequantize_fp8, quantize_fp8
from dflash_train.store.reader import open_store
from dflash_train.store.verify import check_hashes, verify_store
from dflash_train.store.writer import StoreWriter, finalize_store

IDENTITY = {"name": "fake", "config_hash": "abc", "tokenizer_hash": "def", "chat_template_hash": "ghi"}


def make_samples(n, width, seed=0, min_len=3, max_len=40):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        s = int(torch.randint(min_len, max_len, (1,), generator=g))
        prompt = int(torch.randint(1, s, (1,), generator=g))
        mask = torch.zeros(s, dtype=torch.bool)
        mask[prompt:] = True
        samples.append({"id": f"s{i}", "weight": i % 3 + 1, "input_ids": torch.randint(0, 1000, (s,), generator=g),
                        "loss_mask": mask, "hidden_states": torch.randn(s, width, generator=g).to(torch.bfloat16)})
    return samples


def write(out, samples, layers=(1, 3, 5), hidden=8, **kw):
    with StoreWriter(out, target=IDENTITY, target_layer_ids=list(layers), hidden_size=hidden,
                     generation={"temperature": 0.0, "template_kwargs": {}}, **kw) as writer:
        for s in samples:
            writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"])
    return writer


def test_round_trip_many_shards(tmp_path):
    samples = make_samples(30, 24)
    write(tmp_path / "st", samples, shard_bytes=2000, ingest_report={"kept": 30})
    st = open_store(tmp_path / "st")
    m = st.manifest
    assert len(st) == 30 and m["num_samples"] == 30 and len(m["shards"]) > 3
    assert m["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert m["target"] == IDENTITY and m["target_layer_ids"] == [1, 3, 5] and m["hidden_size"] == 8
    assert m["num_tapped"] == 3 and m["storage_dtype"] == "bf16" and m["ingest_report"] == {"kept": 30}
    assert m["generation"]["template_kwargs"] == {}
    assert all(len(e["sha256"]) == 64 and e["num_samples"] > 0 for e in m["shards"])
    for i in [0, 7, 29, -1, 13]:  # random access across shards, negative index
        item, ref = st[i], samples[i]
        assert item["id"] == ref["id"] and item["weight"] == ref["weight"]
        assert item["input_ids"].dtype == torch.long and torch.equal(item["input_ids"], ref["input_ids"])
        assert item["loss_mask"].dtype == torch.bool and torch.equal(item["loss_mask"], ref["loss_mask"])
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], ref["hidden_states"])
    assert [st.length(i) for i in range(len(st))] == [len(s["input_ids"]) for s in samples]
    assert st.ids == [s["id"] for s in samples]
    with pytest.raises(IndexError):
        st[30]
    assert pickle.loads(pickle.dumps(st))[3]["id"] == "s3"  # DataLoader workers get a copy
    assert verify_store(tmp_path / "st") == []
    assert not list((tmp_path / "st").glob("*.tmp")) and (tmp_path / "st" / "provenance.json").exists()


def test_overhead_under_two_percent_at_real_width(tmp_path):
    width = 5 * 576  # SmolLM2 with 5 tapped layers
    samples = make_samples(12, width, min_len=100, max_len=300)
    write(tmp_path / "st", samples, layers=(1, 7, 14, 20, 27), hidden=576)
    m = open_store(tmp_path / "st").manifest
    floor = width * 2
    assert m["floor_bytes_per_token"] == floor
    on_disk = sum(p.stat().st_size for p in (tmp_path / "st").glob("shard-*.safetensors"))
    assert on_disk == m["bytes"]
    assert on_disk / (m["num_tokens"] * floor) - 1 < 0.02


def test_fp8_round_trip(tmp_path):
    width = 3 * 64
    samples = make_samples(10, width, min_len=50, max_len=80)
    for s in samples:  # rows with very different magnitudes: the per-token scale must handle both
        s["hidden_states"][::2] *= 50
    write(tmp_path / "bf16", samples, hidden=64)
    write(tmp_path / "fp8", samples, hidden=64, storage_dtype="fp8")
    st = open_store(tmp_path / "fp8")
    assert st.manifest["storage_dtype"] == "fp8"
    for item, ref in zip(st, samples):
        assert item["hidden_states"].dtype == torch.bfloat16
        x, y = ref["hidden_states"].float(), item["hidden_states"].float()
        rel = (x - y).norm(dim=-1) / x.norm(dim=-1)
        assert rel.max() < 0.05, rel.max()
        assert torch.equal(item["input_ids"], ref["input_ids"])
    size = lambda d: sum(p.stat().st_size for p in (tmp_path / d).glob("shard-*"))  # noqa: E731
    assert 0.45 < size("fp8") / size("bf16") < 0.56
    assert open_store(tmp_path / "fp8").manifest["floor_bytes_per_token"] == width
    q, scales = quantize_fp8(samples[0]["hidden_states"])
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (len(q),)
    assert torch.equal(dequantize_fp8(q, scales), (q.float() * scales[:, None]).to(torch.bfloat16))


def test_a_token_only_store_holds_everything_but_the_states(tmp_path, capsys):
    """storage_dtype "none": ids, mask, weights and ids as before, no hidden_states; the manifest says kind tokens
    and still names the layers and width the states would have (what training computes online)."""
    samples = make_samples(12, 5 * 576, min_len=100, max_len=300)  # SmolLM2's width
    write(tmp_path / "states", samples, layers=(1, 7, 14, 20, 27), hidden=576)
    tokens_only = [{k: v for k, v in s.items() if k != "hidden_states"} | {"hidden_states": None} for s in samples]
    write(tmp_path / "tokens", tokens_only, layers=(1, 7, 14, 20, 27), hidden=576, storage_dtype="none")
    st, full = open_store(tmp_path / "tokens"), open_store(tmp_path / "states")
    m = st.manifest
    assert (m["kind"], full.manifest["kind"]) == ("tokens", "states")
    assert m["storage_dtype"] == "none" and m["target_layer_ids"] == [1, 7, 14, 20, 27] and m["hidden_size"] == 576
    assert m["floor_bytes_per_token"] == 5  # an int32 id and a bool mask per token
    assert [st.length(i) for i in range(len(st))] == [full.length(i) for i in range(len(full))]
    for item, ref in zip(st, samples):
        assert "hidden_states" not in item and item["id"] == ref["id"] and item["weight"] == ref["weight"]
        assert torch.equal(item["input_ids"], ref["input_ids"]) and torch.equal(item["loss_mask"], ref["loss_mask"])
    assert full.manifest["bytes"] / m["bytes"] > 1000  # 5,760 bytes of states per token against about 5.5
    assert verify_store(tmp_path / "tokens") == []
    assert cli_main(["verify", str(tmp_path / "tokens")]) == 0
    assert "token-only (no hidden states)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="None \\(a token-only store\\)"):
        write(tmp_path / "mixed", samples[:1], layers=(1, 7, 14, 20, 27), hidden=576, storage_dtype="none")
    with pytest.raises(ValueError, match=r"\[S, 2880\]"):
        write(tmp_path / "missing", tokens_only[:1], layers=(1, 7, 14, 20, 27), hidden=576)
    with pytest.raises(UserError, match="storage_dtype"):  # a token-only store is never resumed with states
        write(tmp_path / "tokens", samples[:1], layers=(1, 7, 14, 20, 27), hidden=576)


def test_nonfinite_samples_dropped_and_counted(tmp_path):
    samples = make_samples(6, 24)
    samples[2]["hidden_states"][1, 3] = float("nan")
    samples[4]["hidden_states"][0, 0] = float("inf")
    write(tmp_path / "st", samples)
    st = open_store(tmp_path / "st")
    assert st.ids == ["s0", "s1", "s3", "s5"]
    assert st.manifest["num_dropped_nonfinite"] == 2 and st.manifest["dropped_ids"] == {"nonfinite": ["s2", "s4"]}
    assert st.manifest["dropped"] == {"nonfinite": 2}


def test_a_sample_dropped_with_its_own_reason_is_named_with_it_and_not_redone_on_resume(tmp_path):
    """A drop's own words (capture: the engine's reason for refusing a request) go into the manifest's dropped_why
    beside its count; a writer reopened on the folder counts the id as done."""
    samples = make_samples(2, 24)
    out = tmp_path / "st"
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8)
    writer.add(samples[0]["input_ids"], samples[0]["loss_mask"], samples[0]["hidden_states"], id="s0")
    writer.skip("s1", "refused_by_engine", "VLLMValidationError: Failed to transform regex into a grammar")
    writer.skip("s2", "prompt_too_long")
    writer.flush()
    writer.release()
    again = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8)
    assert {"s0", "s1", "s2"} <= again.done_ids
    manifest = again.close()
    assert manifest["dropped"] == {"refused_by_engine": 1, "prompt_too_long": 1}
    assert manifest["dropped_why"] == {"s1": "VLLMValidationError: Failed to transform regex into a grammar"}
    assert open_store(out).ids == ["s0"]


def test_flipped_byte_fails_verify_naming_the_shard(tmp_path, capsys):
    write(tmp_path / "st", make_samples(20, 24), shard_bytes=3000)
    assert cli_main(["verify", str(tmp_path / "st")]) == 0
    shard = open_store(tmp_path / "st").manifest["shards"][1]["file"]
    path = tmp_path / "st" / shard
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the tensor data: the header still parses, only the hash can tell
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path / "st")]) == 1
    out = capsys.readouterr().out
    assert shard in out and "corrupted" in out
    assert sum(shard in line for line in out.splitlines() if line.startswith("FAIL")) == 1


def test_truncated_shard_is_never_read(tmp_path, capsys):
    write(tmp_path / "st", make_samples(20, 24), shard_bytes=3000)
    shard = open_store(tmp_path / "st").manifest["shards"][0]["file"]
    path = tmp_path / "st" / shard
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(UserError, match=shard):
        open_store(tmp_path / "st")
    assert cli_main(["verify", str(tmp_path / "st")]) == 1
    assert shard in capsys.readouterr().out


def test_missing_or_incomplete_store_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_store(tmp_path / "nope")
    writer = StoreWriter(tmp_path / "st", target=IDENTITY, target_layer_ids=[1], hidden_size=8)
    s = make_samples(1, 8)[0]
    writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="a")
    writer.flush()
    with pytest.raises(UserError, match="incomplete"):
        open_store(tmp_path / "st")
    assert cli_main(["verify", str(tmp_path / "st")]) == 2


def test_a_folder_that_is_no_store_is_named_as_such(tmp_path):
    from dflash_train.provenance import start_output, write_provenance

    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(UserError, match=r"a.txt is a file: a store is the folder"):
        open_store(tmp_path / "a.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty is not a capture store \(no manifest.json\)"):
        open_store(tmp_path / "empty")
    write_provenance(start_output(tmp_path / "prompts", "ingest"), stage="ingest")
    with pytest.raises(UserError, match=r"prompts holds the output of `dflash-train ingest`, not of capture: pass a "
                                        r"folder `dflash-train capture --out`"):
        open_store(tmp_path / "prompts")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["shards"][0].pop("sha256"), r"shards\[0\] \(shard-r000-00000.safetensors\) has no 'sha256'"),
    (lambda m: m["shards"][0].pop("bytes"), r"shards\[0\] \(shard-r000-00000.safetensors\) 'bytes' must be an integer"),
    (lambda m: m["shards"][0].update(file="../elsewhere.safetensors"), r"'file' must be a file name inside the store"),
    (lambda m: m.update(shards=None), r"'shards' must be a list, got NoneType"),
    (lambda m: m.update(hidden_size="big"), r"'hidden_size' must be an integer >= 0, got 'big'"),
])
def test_a_damaged_manifest_is_one_line_naming_the_key(tmp_path, capsys, edit, message):
    write(tmp_path / "st", make_samples(2, 24))
    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    edit(manifest)
    (tmp_path / "st" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=message):
        open_store(tmp_path / "st")
    assert cli_main(["verify", str(tmp_path / "st")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_shard_that_fills_inside_a_batch_closes_after_the_batch(tmp_path):
    samples = make_samples(6, 24)
    out = tmp_path / "st"
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, shard_bytes=1)

    def shards():
        return [len(shard["ids"]) for shard in json.loads((out / "journal-r000.json").read_text())["shards"]]

    with writer.batch():
        for s in samples[:3]:
            writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"])
        assert not (out / "journal-r000.json").exists()  # full since the first sample, still open
    assert shards() == [3]
    with pytest.raises(RuntimeError, match="killed"), writer.batch():
        writer.add(samples[3]["input_ids"], samples[3]["loss_mask"], samples[3]["hidden_states"], id="s3")
        raise RuntimeError("killed")
    assert shards() == [3]  # a batch that did not end closes no shard
    writer.add(samples[4]["input_ids"], samples[4]["loss_mask"], samples[4]["hidden_states"], id="s4")
    assert shards() == [3, 2]  # outside a batch, as before: a shard closes with the sample that fills it (s3 buffered)


def test_resume_after_kill_keeps_finished_shards_and_redoes_the_partial_one(tmp_path):
    samples = make_samples(20, 24)
    out = tmp_path / "st"
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, shard_bytes=3000)
    for s in samples[:13]:
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"])
    if not writer._pending.ids:  # make sure some samples are still buffered when the kill comes
        writer.add(samples[13]["input_ids"], samples[13]["loss_mask"], samples[13]["hidden_states"], id="s13")
    lost = set(writer._pending.ids)
    journal = json.loads((out / "journal-r000.json").read_text())
    done_before_kill = {i for shard in journal["shards"] for i in shard["ids"]}
    (out / "shard-r000-00099.safetensors.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    del writer  # killed: the buffered samples are lost
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, shard_bytes=3000)
    assert writer.done_ids == done_before_kill and not lost & writer.done_ids and lost
    assert not (out / "shard-r000-00099.safetensors.tmp").exists()
    for s in samples:
        if s["id"] not in writer.done_ids:
            writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"])
    writer.close()
    st = open_store(out)
    assert sorted(st.ids) == sorted(s["id"] for s in samples) and len(st) == 20
    by_id = {s["id"]: s for s in samples}
    assert all(torch.equal(item["hidden_states"], by_id[item["id"]]["hidden_states"]) for item in st)
    with pytest.raises(UserError, match="storage_dtype"):
        StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, storage_dtype="fp8")
    assert len(open_store(out)) == 20  # the refused rerun left the finished store intact


def test_disk_full_is_a_clear_error_and_leaves_no_manifest(tmp_path, monkeypatch):
    samples = make_samples(8, 24)
    out = tmp_path / "st"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_save = store_writer._save_safetensors
    monkeypatch.setattr(store_writer, "_save_safetensors", full)
    with pytest.raises(UserError, match="disk full"):
        write(out, samples)
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*"))
    monkeypatch.setattr(store_writer, "_save_safetensors", real_save)
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8,
                         generation={"temperature": 0.0, "template_kwargs": {}})
    for s in samples:
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"])
    writer.flush()
    monkeypatch.setattr(store_writer, "write_json_atomic", full)  # full again when the manifest is written
    with pytest.raises(UserError, match="disk full"):
        finalize_store(out)
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
    monkeypatch.undo()
    finalize_store(out)  # space freed: the rerun finishes the same store
    assert sorted(open_store(out).ids) == sorted(s["id"] for s in samples)


# --- top-k soft labels ------------------------------------------------------------------------------------------


def add_topk(samples, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        n = len(s["input_ids"])
        logp = torch.log_softmax(torch.randn(n, 50, generator=g) * 3, dim=-1)
        s["topk_logprobs"], ids = logp.topk(k, dim=-1)
        s["topk_ids"] = ids.to(torch.int32)
        s["topk_ids"][0], s["topk_logprobs"][0] = 0, float("-inf")  # position 0: nothing predicts it
    return samples


def write_topk(out, samples, k, **kw):
    with StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, topk=k, **kw) as writer:
        for s in samples:
            writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], weight=s["weight"],
                       topk_ids=s["topk_ids"], topk_logprobs=s["topk_logprobs"])


def test_topk_round_trip(tmp_path):
    samples = add_topk(make_samples(12, 24), k=3)
    write_topk(tmp_path / "st", samples, 3, shard_bytes=2000)
    st = open_store(tmp_path / "st")
    m = st.manifest
    assert m["topk"] == 3 and len(m["shards"]) > 1 and m["floor_bytes_per_token"] == 24 * 2 + 3 * 6
    for item, ref in zip(st, samples):
        assert item["topk_ids"].dtype == torch.long and torch.equal(item["topk_ids"], ref["topk_ids"].long())
        assert item["topk_logprobs"].dtype == torch.float32
        assert torch.equal(item["topk_logprobs"], ref["topk_logprobs"].half().float())  # float16 on disk
        assert (item["topk_logprobs"][0] == float("-inf")).all()
    assert verify_store(tmp_path / "st") == []
    write(tmp_path / "plain", make_samples(3, 24))
    plain = open_store(tmp_path / "plain")
    assert plain.manifest["topk"] == 0 and "topk_ids" not in plain[0]


def test_topk_shapes_are_checked(tmp_path):
    s = add_topk(make_samples(1, 24), k=3)[0]
    writer = StoreWriter(tmp_path / "w", target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, topk=3)
    with pytest.raises(ValueError, match="topk_ids"):
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="a")  # top-k missing
    with pytest.raises(ValueError, match="topk_ids"):
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="a", topk_ids=s["topk_ids"][:, :2],
                   topk_logprobs=s["topk_logprobs"][:, :2])
    nan = s["topk_logprobs"].clone()
    nan[2, 1] = float("nan")
    assert not writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="b", topk_ids=s["topk_ids"],
                          topk_logprobs=nan)  # dropped as non-finite; -inf at position 0 is fine
    assert writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="c", topk_ids=s["topk_ids"],
                      topk_logprobs=s["topk_logprobs"])
    # a manifest claiming top-k that its shards do not hold is caught on open, naming the shard
    write(tmp_path / "st", make_samples(4, 24))
    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    (tmp_path / "st" / "manifest.json").write_text(json.dumps({**manifest, "topk": 2}))
    with pytest.raises(UserError, match=r"shard-r000-00000.*topk_ids"):
        open_store(tmp_path / "st")


def test_resume_with_a_different_topk_is_refused(tmp_path):
    samples = add_topk(make_samples(10, 24), k=4)
    out = tmp_path / "st"
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, topk=4, shard_bytes=1500)
    for s in samples[:6]:
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"], topk_ids=s["topk_ids"],
                   topk_logprobs=s["topk_logprobs"])
    writer.flush()
    del writer  # killed
    for k in (0, 2):
        with pytest.raises(UserError, match="'topk'"):
            StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, topk=k)
    write_topk(out, [s for s in samples if s["id"] not in {f"s{i}" for i in range(6)}], 4)  # same K resumes
    assert sorted(open_store(out).ids) == sorted(s["id"] for s in samples)


def test_journal_from_before_topk_resumes_as_topk_0(tmp_path):
    out = tmp_path / "st"
    samples = make_samples(4, 24)
    writer = StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8)
    writer.add(samples[0]["input_ids"], samples[0]["loss_mask"], samples[0]["hidden_states"], id="s0")
    writer.flush()
    del writer
    journal = json.loads((out / "journal-r000.json").read_text())
    del journal["settings"]["topk"]  # as written by the code before top-k existed
    (out / "journal-r000.json").write_text(json.dumps(journal))
    with pytest.raises(UserError, match="'topk'"):
        StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8, topk=2)
    with StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8) as writer:
        for s in samples[1:]:
            writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id=s["id"])
    assert len(open_store(out)) == 4 and open_store(out).manifest["topk"] == 0


# --- a store knows its set and its settings; shard hashes are checked on open ----------------------------------


def test_different_settings_refusal_names_the_key_path_and_both_values(tmp_path):
    """A setting deep in a long generation record differs: the refusal names its key path and both values, where
    a message cut at 200 characters used to hide it."""
    long = {"template_kwargs": {"system": "You are a helpful assistant. " * 20}, "stop_token_ids": list(range(40))}
    out = tmp_path / "st"
    s = make_samples(1, 24)[0]
    with StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8,
                     generation={**long, "temperature": 0.0}) as writer:
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="a")
    with pytest.raises(UserError) as refused:
        StoreWriter(out, target=IDENTITY, target_layer_ids=[1, 3, 5], hidden_size=8,
                    generation={**long, "temperature": 0.7})
    message = str(refused.value)
    assert "'generation.temperature' is 0.0 in journal-r000.json, 0.7 in this run" in message, message
    assert len(open_store(out)) == 1  # the refused rerun left the store intact


def test_a_store_holds_one_prompt_set(tmp_path):
    out = tmp_path / "st"
    s = make_samples(2, 24)
    train_set = {"source": "/data/prompts/a", "split": "train", "eval_fraction": 0.02, "seed": None}
    with StoreWriter(out, target=IDENTITY, target_layer_ids=[1], hidden_size=24, prompts=train_set) as writer:
        writer.add(s[0]["input_ids"], s[0]["loss_mask"], s[0]["hidden_states"], id="a")
    for other in ({**train_set, "split": "eval"}, {**train_set, "source": "/data/prompts/b"}):
        with pytest.raises(UserError, match=r"another prompt set: eval prompts must never join a store of training "
                                            r"prompts .*'prompts\.(split|source)' is"):
            StoreWriter(out, target=IDENTITY, target_layer_ids=[1], hidden_size=24, prompts=other)
    assert open_store(out).manifest["prompts"] == train_set
    # a store from before stores recorded their prompt set can still be extended
    journal = json.loads((out / "journal-r000.json").read_text())
    del journal["settings"]["prompts"]
    (out / "journal-r000.json").write_text(json.dumps(journal))
    with StoreWriter(out, target=IDENTITY, target_layer_ids=[1], hidden_size=24, prompts=train_set) as writer:
        writer.add(s[1]["input_ids"], s[1]["loss_mask"], s[1]["hidden_states"], id="b")
    assert len(open_store(out)) == 2


def test_shard_hashes_are_checked_on_open_and_verified_shards_are_not_hashed_again(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    write(tmp_path / "st", make_samples(20, 24), shard_bytes=3000)
    n = len(open_store(tmp_path / "st").manifest["shards"])
    # the writer hashed every shard as it wrote it: on this machine nothing needs hashing again
    assert check_hashes(tmp_path / "st") == {"hashed": 0, "cached": n, "bytes_hashed": 0}
    shutil.rmtree(tmp_path / "cache")  # another machine (or a copied store): everything is hashed once
    assert check_hashes(tmp_path / "st")["hashed"] == n
    assert check_hashes(tmp_path / "st") == {"hashed": 0, "cached": n, "bytes_hashed": 0}
    halves = [check_hashes(tmp_path / "st", rank=r, world=2) for r in (0, 1)]
    assert sum(h["cached"] for h in halves) == n  # the ranks of a run split the shards between them
    shard = open_store(tmp_path / "st").manifest["shards"][2]["file"]
    path = tmp_path / "st" / shard
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a flip inside the states: finite, same size; only the hash tells
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"shard {shard} is corrupted"):
        check_hashes(tmp_path / "st")
    assert len(open_store(tmp_path / "st")) == 20  # open_store alone reads headers only: it would have trained on it
