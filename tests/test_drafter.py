"""The DFlash drafter: architecture rules, masks, incremental cache, mask token rules, checkpoint format, and the
remote-code module loading in a fresh interpreter without dflash_train."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_train.drafter import (
    DFlashDrafter,
    DrafterConfig,
    block_visibility,
    block_visibility_flex,
    expected_tensor_names,
    load_drafter,
    parameter_count_formula,
    resolve_mask_token_id,
)
from dflash_train.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
B = 4  # block size in the small tests


@pytest.fixture(scope="module")
def tiny_parts(tiny_target_dir):
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(tiny_target_dir), AutoTokenizer.from_pretrained(tiny_target_dir)


def make_drafter(tiny_parts, num_layers: int = 2, seed: int = 0, **kw) -> DFlashDrafter:
    """A tiny drafter with every weight random (norm weights too, so q_norm/k_norm/hidden_norm matter)."""
    config, tokenizer = tiny_parts
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target(config, num_layers=num_layers, block_size=B, tokenizer=tokenizer, **kw)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    return drafter.eval()


def blocks_input(drafter: DFlashDrafter, S: int, anchors: list[int], seed: int = 1):
    """Context of S tokens and len(anchors) packed blocks, batch 1."""
    g = torch.Generator().manual_seed(seed)
    H, n = drafter.config.hidden_size, drafter.config.num_target_features
    context = torch.randn(1, S, n * H, generator=g)
    embeds = torch.randn(1, len(anchors) * B, H, generator=g)
    anchor_t = torch.tensor([anchors])
    position_ids = (anchor_t[:, :, None] + torch.arange(B)).reshape(1, -1)
    context_position_ids = torch.arange(S)[None]
    mask = block_visibility(context_position_ids, anchor_t, B)
    return embeds, context, position_ids, context_position_ids, mask, anchor_t


def block(out: torch.Tensor, j: int) -> torch.Tensor:
    return out[:, j * B:(j + 1) * B]


# -- format --------------------------------------------------------------------------------------------------------

REQUIRED_KEYS = {
    "architectures", "model_type", "auto_map", "block_size", "dflash_config", "num_target_layers",
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings", "layer_types", "torch_dtype", "dtype",
}


def test_checkpoint_config_keys_and_tensor_names(tiny_parts, tmp_path):
    config, tokenizer = tiny_parts
    identity = {"name": "tiny", "config_hash": "abc"}
    drafter = make_drafter(tiny_parts, num_layers=3, target_identity=identity)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path)

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert REQUIRED_KEYS <= set(cfg)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["block_size"] == B and cfg["num_hidden_layers"] == 3
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # as the reference: one tap per drafter layer
    assert cfg["dflash_config"]["mask_token_id"] == len(tokenizer)  # first reserved row
    assert cfg["num_target_layers"] == config.num_hidden_layers == 8
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (64, 4, 2, 16)
    assert cfg["intermediate_size"] == config.intermediate_size and cfg["vocab_size"] == 1024
    assert cfg["rope_theta"] == config.rope_parameters["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert cfg["rms_norm_eps"] == config.rms_norm_eps
    assert cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["full_attention"] * 3
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["dflash_train"]["target"] == identity

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (64, 3 * 64)
        assert f.get_tensor("norm.weight").dtype == torch.bfloat16
    assert names == set(expected_tensor_names(3))
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    assert "layers.2.self_attn.k_norm.weight" in names and "hidden_norm.weight" in names
    assert (tmp_path / "dflash.py").read_text() == (REPO_ROOT / "dflash_train/remote/dflash.py").read_text()


def test_save_load_roundtrip_is_exact(tiny_parts, tmp_path):
    drafter = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 12, [3, 8])
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.config == drafter.config
    with torch.no_grad():
        assert torch.equal(loaded(embeds, context, pos, cpos, mask), drafter(embeds, context, pos, cpos, mask))


def test_load_drafter_rejects_bad_folders(tiny_parts, tmp_path):
    with pytest.raises(UserError, match="config.json is missing"):
        load_drafter(tmp_path / "nope")
    drafter = make_drafter(tiny_parts)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="model.safetensors: tensors do not match.*layers.2"):
        load_drafter(tmp_path)


# -- attention rules -------------------------------------------------------------------------------------------------

def test_block_sees_only_context_before_its_anchor_and_itself(tiny_parts):
    drafter = make_drafter(tiny_parts)
    anchors = [5, 12, 19]
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 24, anchors)
    with torch.no_grad():
        run = lambda e, c: drafter(e, c, pos, cpos, mask)  # noqa: E731
        base = run(embeds, context)

        at_or_after = context.clone()
        at_or_after[:, 12:] += torch.randn_like(at_or_after[:, 12:])  # from block 1's anchor on
        out = run(embeds, at_or_after)
        assert torch.equal(block(out, 0), block(base, 0)) and torch.equal(block(out, 1), block(base, 1))
        assert not torch.allclose(block(out, 2), block(base, 2))  # anchor 19 sees 12..18

        exactly_anchor = context.clone()
        exactly_anchor[:, 12] += 1.0
        assert torch.equal(block(run(embeds, exactly_anchor), 1), block(base, 1))

        before = context.clone()
        before[:, 8] += 1.0  # before anchor 12, after anchor 5
        out = run(embeds, before)
        assert not torch.allclose(block(out, 1), block(base, 1))
        assert torch.equal(block(out, 0), block(base, 0))

        other_block = embeds.clone()
        other_block[:, 2 * B:] += 1.0  # block 2's tokens
        out = run(other_block, context)
        assert torch.equal(block(out, 0), block(base, 0)) and torch.equal(block(out, 1), block(base, 1))
        assert not torch.allclose(block(out, 2), block(base, 2))

        # within a block, attention is bidirectional: the last slot changes the first slot's output
        last_slot = embeds.clone()
        last_slot[:, B - 1] += 1.0
        assert not torch.allclose(run(last_slot, context)[:, 0], base[:, 0])

        # a packed training block equals the eval view of that block: one block, context before its anchor only
        alone = drafter(embeds[:, B:2 * B], context[:, :12], pos[:, B:2 * B], cpos[:, :12])
        torch.testing.assert_close(alone, block(base, 1), rtol=0, atol=1e-5)


def test_flex_block_mask_and_callable_match_dense_mask(tiny_parts):
    drafter = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, anchors = blocks_input(drafter, 20, [4, 9, 15])
    flex = block_visibility_flex(cpos, anchors, B)

    def dense_kernel(q, k, v, scale):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                enable_gqa=True)

    with torch.no_grad():
        dense = drafter(embeds, context, pos, cpos, mask)
        torch.testing.assert_close(drafter(embeds, context, pos, cpos, flex), dense, rtol=0, atol=1e-5)
        torch.testing.assert_close(drafter(embeds, context, pos, cpos, dense_kernel), dense, rtol=0, atol=1e-6)


def test_mask_respects_context_padding(tiny_parts):
    """Right-padded context rows are never attended, whatever their positions say."""
    drafter = make_drafter(tiny_parts)
    embeds, context, pos, cpos, _, anchors = blocks_input(drafter, 16, [4, 10])
    valid = torch.arange(16)[None] < 8
    mask = block_visibility(cpos, anchors, B, context_valid=valid)
    assert not mask[0, 0, B:, 8:16].any() and mask[0, 0, B:, :8].all()
    padded = context.clone()
    padded[:, 8:] = 1e3
    with torch.no_grad():
        assert torch.equal(drafter(embeds, padded, pos, cpos, mask), drafter(embeds, context, pos, cpos, mask))


def test_incremental_cache_equals_full_recompute(tiny_parts):
    """Eval-style drafting: each step appends the newly committed context to the cache; the block's K/V are
    dropped. Every step must equal a full recompute over the whole committed context."""
    drafter = make_drafter(tiny_parts, num_layers=3)
    H, n = drafter.config.hidden_size, drafter.config.num_target_features
    g = torch.Generator().manual_seed(3)
    states = torch.randn(1, 40, n * H, generator=g)  # tapped states of the committed tokens
    cache = drafter.new_cache()
    committed = 0
    with torch.no_grad():
        for anchor in (9, 12, 13, 18, 25):  # prompt of 9, then steps committing 3, 1, 5, 7 tokens
            embeds = torch.randn(1, B, H, generator=g)
            pos = torch.arange(anchor, anchor + B)[None]
            step = drafter(embeds, states[:, committed:anchor], pos, torch.arange(committed, anchor)[None],
                           cache=cache)
            full = drafter(embeds, states[:, :anchor], pos, torch.arange(anchor)[None])
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
            assert cache.seq_len == anchor  # context kept, block dropped
            committed = anchor
        # a second draft at the same anchor brings no new context (an empty [1, 0, n*H] context)
        embeds = torch.randn(1, B, H, generator=g)
        step = drafter(embeds, states[:, 25:25], pos, torch.arange(25, 25)[None], cache=cache)
        full = drafter(embeds, states[:, :25], pos, torch.arange(25)[None])
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
        assert cache.seq_len == 25
        cache.crop(20)  # rejecting committed context (e.g. a rollback) and redrafting from there
        embeds = torch.randn(1, B, H, generator=g)
        pos = torch.arange(22, 22 + B)[None]
        step = drafter(embeds, states[:, 20:22], pos, torch.arange(20, 22)[None], cache=cache)
        full = drafter(embeds, states[:, :22], pos, torch.arange(22)[None])
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


def test_rope_uses_absolute_positions(tiny_parts):
    drafter = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 12, [6])
    with torch.no_grad():
        base = drafter(embeds, context, pos, cpos, mask)
        shifted = drafter(embeds, context, pos + 3, cpos + 3, mask)
        assert torch.allclose(base, shifted, atol=1e-4)  # relative positions unchanged: RoPE is relative
        moved = drafter(embeds, context, pos + 3, cpos, mask)
        assert not torch.allclose(base, moved, atol=1e-4)


def test_every_parameter_gets_a_gradient(tiny_parts):
    """Training reaches fc, hidden_norm, k_norm, ... through the packed-block mask (nothing is dead)."""
    drafter = make_drafter(tiny_parts).train()
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 16, [3, 9])
    drafter(embeds, context, pos, cpos, mask).pow(2).mean().backward()
    dead = [name for name, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []
    grads = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad()
    drafter.gradient_checkpointing = True  # same gradients when layers are recomputed in backward
    drafter(embeds, context, pos, cpos, mask).pow(2).mean().backward()
    for g, p in zip(grads, drafter.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_remote_module_matches_with_scaled_rope(tiny_parts, tmp_path):
    """Same outputs from the remote module for a target with non-default RoPE (llama3 scaling)."""
    from transformers import AutoModel

    config, tok = tiny_parts
    scaled = config.__class__.from_dict({**config.to_dict(), "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    drafter = make_drafter((scaled, tok))
    assert drafter.config.rope_parameters["rope_type"] == "llama3"
    folder = drafter.save_pretrained(tmp_path / "scaled_rope_drafter")
    remote = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 100, [40, 90])  # past original_max_position
    with torch.no_grad():
        ours = drafter(embeds, context, pos, cpos, mask)
        theirs = remote(position_ids=torch.cat([cpos, pos], 1), attention_mask=mask, noise_embedding=embeds,
                        target_hidden=context)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
        plain = make_drafter(tiny_parts)  # same seed, default rope: must differ at these positions
        assert not torch.allclose(plain(embeds, context, pos, cpos, mask), ours, atol=1e-4)


# -- mask token ------------------------------------------------------------------------------------------------------

def test_mask_token_rules(tiny_parts):
    config, tok = tiny_parts
    assert len(tok) < 1024
    assert resolve_mask_token_id(tok, 1024) == len(tok)  # a reserved row past the tokenizer's vocabulary
    assert resolve_mask_token_id(tok, len(tok)) == tok.convert_tokens_to_ids("<repo_name>") == 3  # table is full
    assert resolve_mask_token_id(tok, 1024, requested=5) == 5
    for bad in (tok.pad_token_id, tok.eos_token_id):
        with pytest.raises(UserError, match=rf"mask_token_id {bad} .*pad or EOS"):
            resolve_mask_token_id(tok, 1024, requested=bad)
    for bad in (1024, 5000, -1):
        with pytest.raises(UserError, match=rf"mask_token_id {bad} is not a row"):
            resolve_mask_token_id(tok, 1024, requested=bad)
    with pytest.raises(UserError, match="mask_token_id 7 .*pad or EOS"):
        resolve_mask_token_id(tok, 1024, requested=7, forbidden={7})
    with pytest.raises(UserError, match=r"mask_token_id must be an integer"):
        resolve_mask_token_id(tok, 1024, requested="3")
    with pytest.raises(UserError, match="pad or EOS"):
        DFlashDrafter.from_target(config, num_layers=1, tokenizer=tok, mask_token_id=2)
    with pytest.raises(UserError, match="mask_token_id 2000"):
        DFlashDrafter.from_target(config, num_layers=1, mask_token_id=2000)
    with pytest.raises(UserError, match="tokenizer or an explicit mask_token_id"):
        DFlashDrafter.from_target(config, num_layers=1)
    assert DFlashDrafter.from_target(config, num_layers=1, tokenizer=tok, mask_token_id=3).config.mask_token == \
        "<repo_name>"


def test_mask_token_without_reserved_row_or_unused_special_token_is_an_error(tiny_parts):
    _, tok = tiny_parts

    class Full:  # a tokenizer filling the table with none of the known unused special tokens
        pad_token_id, eos_token_id, chat_template = 2, 2, ""

        def __len__(self):
            return len(tok)

        def get_vocab(self):
            return {k: v for k, v in tok.get_vocab().items() if k not in ("<repo_name>", "<file_sep>", "<filename>")}

    with pytest.raises(UserError, match="set mask_token_id in the recipe"):
        resolve_mask_token_id(Full(), len(tok))


def test_from_target_validates_layers(tiny_parts):
    config, tok = tiny_parts
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 8\]"):
        DFlashDrafter.from_target(config, tokenizer=tok, target_layer_ids=[1, 8])
    with pytest.raises(UserError, match="distinct"):
        DFlashDrafter.from_target(config, tokenizer=tok, target_layer_ids=[2, 2])


# -- remote code in a fresh interpreter ------------------------------------------------------------------------------

REMOTE_CHECK = textwrap.dedent(r"""
    import importlib.abc, sys
    repo = sys.argv[1]

    class HideDflashTrain(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "dflash_train" or name.startswith("dflash_train."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")

    sys.meta_path.insert(0, HideDflashTrain())
    sys.path = [p for p in sys.path if p not in ("", ".") and not p.startswith(repo)]

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

    folder, data = sys.argv[2], torch.load(sys.argv[3])
    model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlashDraftModel", type(model)
    assert model.mask_token_id == data["mask_token_id"] and model.block_size == data["block_size"]
    assert model.target_layer_ids == data["target_layer_ids"]
    out = {}
    with torch.no_grad():
        # many blocks packed with the training mask; position_ids cover [context | blocks]
        positions = torch.cat([data["cpos"], data["pos"]], dim=1)
        out["packed"] = model(position_ids=positions, attention_mask=data["mask"], noise_embedding=data["embeds"],
                              target_hidden=data["context"])
        # the reference's incremental use: DynamicCache, crop to the committed length after each draft
        cache = DynamicCache()
        steps = []
        for start, end in data["steps"]:
            e = data["step_embeds"][:, len(steps) * data["block_size"]:(len(steps) + 1) * data["block_size"]]
            pos = torch.arange(start, end + data["block_size"])[None]
            steps.append(model(position_ids=pos, noise_embedding=e, target_hidden=data["states"][:, start:end],
                               past_key_values=cache, use_cache=True))
            remove = cache.get_seq_length() - end  # crop to the committed length (v4 and v5)
            if remove > 0:
                cache.crop(-remove)
        out["steps"] = torch.cat(steps, dim=1)
        target = AutoModelForCausalLM.from_pretrained(sys.argv[4], dtype=torch.float32).eval()
        ids = data["prompt"]
        for _ in range(data["max_new"]):  # plain greedy decoding, for the losslessness check
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
        out["greedy"] = ids
    lengths = []
    out["spec"] = model.spec_generate(target=target, input_ids=data["prompt"], max_new_tokens=data["max_new"],
                                      stop_token_ids=[], temperature=0.0, acceptance_lengths=lengths)
    out["lengths"] = lengths
    out["leaked"] = sorted(m for m in sys.modules if m.startswith("dflash_train"))
    torch.save(out, sys.argv[5])
""")


def test_remote_code_loads_without_dflash_train_and_matches(tiny_parts, tiny_target_dir, tmp_path):
    drafter = make_drafter(tiny_parts, num_layers=2)
    folder = drafter.save_pretrained(tmp_path / "drafter")
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 20, [4, 9, 15])
    H, n = drafter.config.hidden_size, drafter.config.num_target_features
    g = torch.Generator().manual_seed(7)
    states = torch.randn(1, 30, n * H, generator=g)
    steps = [(0, 10), (10, 13), (13, 14), (14, 21)]
    step_embeds = torch.randn(1, len(steps) * B, H, generator=g)
    data = dict(embeds=embeds, context=context, pos=pos, cpos=cpos, mask=mask, states=states, steps=steps,
                step_embeds=step_embeds, block_size=B, mask_token_id=drafter.config.mask_token_id,
                target_layer_ids=drafter.config.target_layer_ids, prompt=torch.tensor([[1, 40, 41, 42, 43]]),
                max_new=12)
    torch.save(data, tmp_path / "in.pt")
    script = tmp_path / "check_remote.py"
    script.write_text(REMOTE_CHECK)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
           "HOME": str(Path.home()), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(REPO_ROOT), str(folder), str(tmp_path / "in.pt"),
                           str(tiny_target_dir), str(tmp_path / "out.pt")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["leaked"] == []

    with torch.no_grad():
        torch.testing.assert_close(out["packed"], drafter(embeds, context, pos, cpos, mask), rtol=0, atol=1e-5)
        expected = []
        for i, (start, end) in enumerate(steps):  # our full recompute over the committed context
            e = step_embeds[:, i * B:(i + 1) * B]
            expected.append(drafter(e, states[:, :end], torch.arange(end, end + B)[None],
                                    torch.arange(end)[None]))
        torch.testing.assert_close(out["steps"], torch.cat(expected, dim=1), rtol=0, atol=1e-5)
    assert torch.equal(out["spec"], out["greedy"])  # speculative decoding is lossless
    assert sum(out["lengths"]) + 1 >= data["max_new"] and all(1 <= n <= B for n in out["lengths"])


# -- the real target ---------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_drafter_saves_reloads_and_counts_parameters(tmp_path):
    from transformers import AutoConfig

    from dflash_train.target import load_tokenizer, resolve_target

    path = resolve_target("smollm2-135m-instruct")
    config, tok = AutoConfig.from_pretrained(path), load_tokenizer(str(path))
    assert resolve_mask_token_id(tok, config.vocab_size) == tok.convert_tokens_to_ids("<repo_name>") == 3
    drafter = DFlashDrafter.from_target(config, tokenizer=tok).to(torch.bfloat16).eval()
    assert drafter.config.target_layer_ids == [1, 8, 14, 20, 27]
    total, formula = parameter_count_formula(drafter.config)
    assert drafter.num_parameters() == total == 19_361_152, formula
    print(f"\nSmolLM2-135M drafter parameters (no embedding/head): {formula}")

    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.config == drafter.config
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["dflash_config"]["mask_token"] == "<repo_name>"
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 7, 5 * 576, generator=g).to(torch.bfloat16)
    embeds = torch.randn(1, 16, 576, generator=g).to(torch.bfloat16)
    pos, cpos = torch.arange(7, 23)[None], torch.arange(7)[None]
    with torch.no_grad():
        assert torch.equal(loaded(embeds, context, pos, cpos), drafter(embeds, context, pos, cpos))


def test_config_dataclass_roundtrip(tiny_parts):
    drafter = make_drafter(tiny_parts)
    raw = json.loads(json.dumps(drafter.config.to_config_json(torch.float32)))
    assert DrafterConfig.from_config_json(raw) == drafter.config


# -- sample-efficiency switches: start from the target, context scale ---------------------------------------------


def test_init_from_target_copies_the_top_layers_and_passes_the_deepest_tap(tiny_parts, tiny_target_dir, tiny_target):
    from dflash_train.target import load_decoder_layers

    drafter = make_drafter(tiny_parts, num_layers=2)
    L = drafter.config.num_target_layers
    layers, final_norm = load_decoder_layers(str(tiny_target_dir), [L - 2, L - 1])
    names = drafter.init_from_target(layers, final_norm)
    target = tiny_target.model.model
    for i, t in enumerate((L - 2, L - 1)):
        mine, theirs = drafter.layers[i], target.layers[t]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(mine.self_attn, name).weight, getattr(theirs.self_attn, name).weight), name
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(mine.mlp, name).weight, getattr(theirs.mlp, name).weight), name
        assert torch.equal(mine.input_layernorm.weight, theirs.input_layernorm.weight)
        assert torch.equal(mine.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
        # Llama has no q/k norm: they start as the identity
        assert torch.equal(mine.self_attn.q_norm.weight, torch.ones_like(mine.self_attn.q_norm.weight))
        assert torch.equal(mine.self_attn.k_norm.weight, torch.ones_like(mine.self_attn.k_norm.weight))
    assert torch.equal(drafter.norm.weight, target.norm.weight)
    assert torch.equal(drafter.hidden_norm.weight, target.layers[L - 2].input_layernorm.weight)
    assert len(names) == len(set(names)) == len(expected_tensor_names(2))
    assert set(names) == set(expected_tensor_names(2))

    # the fused context is the deepest tapped layer's state, normed as the first copied layer norms its input
    ids = torch.randint(0, 500, (1, 12))
    hidden = tiny_target.model(ids, output_hidden_states=True).hidden_states
    layer_ids = drafter.config.target_layer_ids
    tapped = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
    deepest = hidden[max(layer_ids) + 1]
    expected = target.layers[L - 2].input_layernorm(deepest)
    assert torch.allclose(drafter.fuse_context(tapped), expected, atol=1e-5)


def test_context_scale_is_folded_into_fc_at_export(tiny_parts, tmp_path):
    drafter = make_drafter(tiny_parts)
    n_in = drafter.fc.in_features
    scale = torch.rand(n_in) * 50 + 0.1
    drafter.set_context_scale(scale)
    embeds, context, pos, ctx_pos, mask, _ = blocks_input(drafter, S=10, anchors=[3, 6])
    context = context * scale  # raw states with large channels; the drafter divides them back
    out = drafter(embeds, context, pos, ctx_pos, mask)
    drafter.save_pretrained(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d")
    assert loaded.context_scale is None  # the public format computes the same function without it
    assert torch.allclose(loaded(embeds, context, pos, ctx_pos, mask), out, atol=1e-5)
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert "context_scale" not in f.keys()
    with pytest.raises(ValueError):
        drafter.set_context_scale(torch.zeros(n_in))


def test_init_from_target_with_context_scale_still_passes_the_deepest_tap(tiny_parts, tiny_target_dir):
    from dflash_train.target import load_decoder_layers

    drafter = make_drafter(tiny_parts, num_layers=1)
    L, H = drafter.config.num_target_layers, drafter.config.hidden_size
    scale = torch.rand(drafter.fc.in_features) * 10 + 0.5
    drafter.set_context_scale(scale)
    layers, norm = load_decoder_layers(str(tiny_target_dir), [L - 1])
    drafter.init_from_target(layers, norm)
    states = torch.randn(1, 5, drafter.fc.in_features) * 30
    k = max(range(drafter.config.num_target_features), key=lambda j: drafter.config.target_layer_ids[j])
    expected = drafter.hidden_norm(states[..., k * H:(k + 1) * H])
    assert torch.allclose(drafter.fuse_context(states), expected, atol=1e-4, rtol=1e-4)


def test_load_decoder_layers_names_a_missing_layer(tiny_target_dir):
    from dflash_train.target import load_decoder_layers

    with pytest.raises(UserError, match="no decoder layer 99"):
        load_decoder_layers(str(tiny_target_dir), [99])
