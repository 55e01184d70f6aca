"""Drafter folders (dflash_train/model/checkpoint.py): the public DFlash format, the shipped remote code being the
model module itself, exact save/load, bad folders, starting from the target's layers, and the context-scale fold."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny import blocks_input, draft, make_tiny_drafter, random_drafter

from dflash_train.errors import UserError
from dflash_train.model.checkpoint import (REMOTE_MODULE, create_drafter, init_from_target, load_decoder_layers,
                                           load_drafter, read_drafter_folder, save_drafter)
from dflash_train.model.configuration import DFlashConfig, expected_tensor_names

REPO_ROOT = Path(__file__).resolve().parent.parent
B = 4


def make_drafter(tiny_parts, num_layers: int = 2, seed: int = 0, **kw):
    config, tokenizer = tiny_parts
    return random_drafter(config, tokenizer, num_layers=num_layers, block_size=B, seed=seed, **kw)


REQUIRED_KEYS = {
    "architectures", "model_type", "auto_map", "block_size", "dflash_config", "num_target_layers",
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings", "layer_types", "torch_dtype", "dtype",
}


def test_checkpoint_config_keys_and_tensor_names(tiny_parts, tmp_path):
    config, tokenizer = tiny_parts
    identity = {"name": "tiny", "config_hash": "abc"}
    drafter, dconfig = make_drafter(tiny_parts, num_layers=3, target_identity=identity)
    save_drafter(drafter.to(torch.bfloat16), dconfig, tmp_path)

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


def test_shipped_remote_code_is_the_model_module_byte_for_byte(tiny_parts, tmp_path):
    """No second, hand-kept model: every folder's dflash.py is modeling_dflash.py, and that module imports
    nothing but the standard library, torch and transformers (it must load where dflash_train is absent)."""
    drafter, dconfig = make_drafter(tiny_parts)
    save_drafter(drafter, dconfig, tmp_path)
    assert REMOTE_MODULE == (REPO_ROOT / "dflash_train/model/modeling_dflash.py").resolve()
    assert (tmp_path / "dflash.py").read_bytes() == REMOTE_MODULE.read_bytes()
    tree = ast.parse(REMOTE_MODULE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= {"__future__", "functools", "inspect", "typing", "torch", "transformers"}, imported
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))  # no relative ones


def test_save_load_roundtrip_is_exact(tiny_parts, tmp_path):
    drafter, dconfig = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 12, [3, 8])
    save_drafter(drafter, dconfig, tmp_path)
    loaded, config = load_drafter(tmp_path)
    assert config == dconfig
    with torch.no_grad():
        assert torch.equal(draft(loaded, embeds, context, pos, cpos, mask),
                           draft(drafter, embeds, context, pos, cpos, mask))


def test_load_drafter_rejects_bad_folders(tiny_parts, tmp_path):
    with pytest.raises(UserError, match="config.json is missing"):
        load_drafter(tmp_path / "nope")
    drafter, dconfig = make_drafter(tiny_parts)
    save_drafter(drafter, dconfig, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"the weights do not fit .*config.json, so the drafter would not load: "
                                        r"num_hidden_layers is 3, the weights hold 2 layer\(s\)"):
        load_drafter(tmp_path)


def test_read_drafter_folder_summarises_without_loading_weights(tiny_parts, tmp_path):
    drafter, dconfig = make_drafter(tiny_parts, target_identity={"name": "tiny", "base_model": "org/tiny"})
    save_drafter(drafter.to(torch.bfloat16), dconfig, tmp_path / "d")
    folder = read_drafter_folder(tmp_path / "d")
    assert folder.config == dconfig and folder.target == {"name": "tiny", "base_model": "org/tiny"}
    assert folder.num_parameters == sum(p.numel() for p in drafter.parameters()) and folder.dtype == "bf16"
    (tmp_path / "d" / "dflash.py").unlink()
    with pytest.raises(UserError, match="dflash.py is missing"):
        read_drafter_folder(tmp_path / "d")


# -- the real target ---------------------------------------------------------------------------------------------

def parameter_count_formula(config: DFlashConfig) -> tuple[int, str]:
    """Parameters without embedding and LM head, and the formula the README states."""
    H, I, h, kv, d = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    L, n = config.num_hidden_layers, config.num_target_features
    per_layer = 2 * H * h * d + 2 * H * kv * d + 2 * d + 3 * H * I + 2 * H
    total = L * per_layer + n * H * H + 2 * H
    formula = (f"L*(2*H*h*d + 2*H*kv*d + 2*d + 3*H*I + 2*H) + n*H^2 + 2*H with L={L}, H={H}, h={h}, kv={kv}, "
               f"d={d}, I={I}, n={n} = {total:,}")
    return total, formula


@pytest.mark.real_model
def test_smollm2_drafter_saves_reloads_and_counts_parameters(tmp_path):
    from transformers import AutoConfig

    from dflash_train.model.configuration import resolve_mask_token_id
    from dflash_train.target import load_tokenizer, resolve_target

    path = resolve_target("smollm2-135m-instruct")
    config, tok = AutoConfig.from_pretrained(path), load_tokenizer(str(path))
    assert resolve_mask_token_id(tok, config.vocab_size) == tok.convert_tokens_to_ids("<repo_name>") == 3
    drafter, dconfig = make_tiny_drafter(config, tok, num_layers=5, block_size=16)
    drafter = drafter.to(torch.bfloat16).eval()
    assert dconfig.target_layer_ids == [1, 8, 14, 20, 27]
    total, formula = parameter_count_formula(dconfig)
    assert sum(p.numel() for p in drafter.parameters()) == total == 19_361_152, formula
    print(f"\nSmolLM2-135M drafter parameters (no embedding/head): {formula}")

    save_drafter(drafter, dconfig, tmp_path)
    loaded, config_back = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16 and config_back == dconfig
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["dflash_config"]["mask_token"] == "<repo_name>"
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 7, 5 * 576, generator=g).to(torch.bfloat16)
    embeds = torch.randn(1, 16, 576, generator=g).to(torch.bfloat16)
    pos, cpos = torch.arange(7, 23)[None], torch.arange(7)[None]
    with torch.no_grad():
        assert torch.equal(draft(loaded, embeds, context, pos, cpos), draft(drafter, embeds, context, pos, cpos))


# -- starting points: the target's layers, the context scale ------------------------------------------------------


def test_init_from_target_copies_the_top_layers_and_passes_the_deepest_tap(tiny_parts, tiny_target_dir, tiny_target):
    drafter, _ = make_drafter(tiny_parts, num_layers=2)
    L = drafter.config.num_target_layers
    layers, final_norm = load_decoder_layers(str(tiny_target_dir), [L - 2, L - 1])
    names = init_from_target(drafter, layers, final_norm)
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
    layer_ids = drafter.target_layer_ids
    tapped = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
    deepest = hidden[max(layer_ids) + 1]
    expected = target.layers[L - 2].input_layernorm(deepest)
    assert torch.allclose(drafter.fuse_context(tapped), expected, atol=1e-5)


def test_context_scale_is_folded_into_fc_at_export(tiny_parts, tmp_path):
    drafter, dconfig = make_drafter(tiny_parts)
    n_in = drafter.fc.in_features
    scale = torch.rand(n_in) * 50 + 0.1
    drafter.set_context_scale(scale)
    embeds, context, pos, ctx_pos, mask, _ = blocks_input(drafter, S=10, anchors=[3, 6])
    context = context * scale  # raw states with large channels; the drafter divides them back
    out = draft(drafter, embeds, context, pos, ctx_pos, mask)
    save_drafter(drafter, dconfig, tmp_path / "d")
    loaded, _ = load_drafter(tmp_path / "d")
    assert loaded.context_scale is None  # the public format computes the same function without it
    assert torch.allclose(draft(loaded, embeds, context, pos, ctx_pos, mask), out, atol=1e-5)
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert "context_scale" not in f.keys()
    with pytest.raises(ValueError):
        drafter.set_context_scale(torch.zeros(n_in))


def test_init_from_target_with_context_scale_still_passes_the_deepest_tap(tiny_parts, tiny_target_dir):
    drafter, _ = make_drafter(tiny_parts, num_layers=1)
    L, H = drafter.config.num_target_layers, drafter.config.hidden_size
    scale = torch.rand(drafter.fc.in_features) * 10 + 0.5
    drafter.set_context_scale(scale)
    layers, norm = load_decoder_layers(str(tiny_target_dir), [L - 1])
    init_from_target(drafter, layers, norm)
    states = torch.randn(1, 5, drafter.fc.in_features) * 30
    ids = drafter.target_layer_ids
    k = max(range(len(ids)), key=lambda j: ids[j])
    expected = drafter.hidden_norm(states[..., k * H:(k + 1) * H])
    assert torch.allclose(drafter.fuse_context(states), expected, atol=1e-4, rtol=1e-4)


def test_load_decoder_layers_names_a_missing_layer(tiny_target_dir):
    with pytest.raises(UserError, match="no decoder layer 99"):
        load_decoder_layers(str(tiny_target_dir), [99])


def test_expected_tensor_shapes_are_the_model_modules(tiny_parts):
    """The shapes push holds a folder's weights against are the ones the model module builds (no drift)."""
    from dflash_train.model.configuration import expected_tensor_shapes

    for kw in ({}, {"num_layers": 3}):
        drafter, dconfig = make_drafter(tiny_parts, **kw)
        assert expected_tensor_shapes(dconfig) == {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    cut = dataclasses.replace(dconfig, draft_vocab_size=7)  # a draft vocabulary adds its head rows and d2t
    assert expected_tensor_shapes(cut) == {k: tuple(v.shape) for k, v in create_drafter(cut).state_dict().items()}


def test_a_draft_vocabulary_drafts_only_its_ids_with_the_target_heads_own_rows(tiny_parts, tmp_path):
    """A drafter cut to some ids scores them exactly as the target's whole head does, every other id at -inf, so
    it drafts the whole head's choice wherever that lies inside; its folder holds the rows and d2t as vLLM maps
    them (target id = row + d2t) and reloads to the same drafts, in every reader."""
    from dflash_train.model.checkpoint import draft_vocabulary

    drafter, dconfig = make_drafter(tiny_parts)
    head = torch.randn(dconfig.vocab_size, dconfig.hidden_size, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(40, dconfig.hidden_size, generator=torch.Generator().manual_seed(4))
    whole = drafter.logits(hidden, head)
    ids = sorted({*whole.argmax(-1)[:20].tolist(), 2, 900})  # the whole head's choice for the first 20 rows only
    config, rows = draft_vocabulary(dconfig, head, ids)
    cut = create_drafter(config)
    cut.load_state_dict({**drafter.state_dict(), **rows}, strict=True)
    logits = cut.logits(hidden, head)
    assert torch.equal(logits[:, ids], whole[:, ids])
    assert bool((logits[:, [i for i in range(dconfig.vocab_size) if i not in ids]] == float("-inf")).all())
    drafts = logits.argmax(-1)
    assert torch.equal(drafts[:20], whole.argmax(-1)[:20]) and set(drafts.tolist()) <= set(ids)
    folder = save_drafter(cut, config, tmp_path / "cut")
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == len(ids)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), head[ids])
        assert (torch.arange(len(ids)) + f.get_tensor("d2t")).tolist() == ids
    reloaded, _ = load_drafter(folder)
    assert torch.equal(reloaded.logits(hidden, head), logits)
    assert read_drafter_folder(folder).num_parameters == sum(t.numel() for t in cut.state_dict().values())
    with pytest.raises(ValueError, match="distinct sorted ids"):
        draft_vocabulary(dconfig, head, [5, 3])


def test_weights_that_do_not_fit_config_json_are_refused_without_loading_them(tiny_parts, tmp_path):
    drafter, dconfig = make_drafter(tiny_parts)
    save_drafter(drafter, dconfig, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    with pytest.raises(UserError, match=r"the weights do not fit .*config.json, so the drafter would not load: "
                                        r"layers.0.self_attn.q_proj.weight \[64, 64\] in model.safetensors "
                                        r"\(config.json implies "):
        read_drafter_folder(tmp_path / "d")


@pytest.mark.parametrize("damage", ["header_not_json", "cut_short", "empty"])
def test_a_damaged_weights_file_is_one_clear_error(tiny_parts, tmp_path, damage):
    drafter, dconfig = make_drafter(tiny_parts)
    save_drafter(drafter, dconfig, tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    data = weights.read_bytes()
    damaged = {"header_not_json": data[:8] + b"{not json" + data[17:], "cut_short": data[:100], "empty": b""}[damage]
    weights.write_bytes(damaged)
    for read in (read_drafter_folder, load_drafter):  # what push reads, and what eval loads
        with pytest.raises(UserError, match=r"model.safetensors is not a readable safetensors file"):
            read(tmp_path / "d")


# -- drafter folders from outside: every reader (push, eval, warm start) holds them to the same rules ------------

def readers():
    """What push reads, what eval loads, and what a warm start (drafter.init_from) reads."""
    from dflash_train.model.published import fetch_drafter, read_drafter

    return {"push": read_drafter_folder, "eval": load_drafter,
            "warm start": lambda folder: read_drafter(fetch_drafter(str(folder)))}


def test_weights_outside_the_drafter_folder_are_never_opened(tiny_parts, tmp_path):
    """A sharded drafter's index naming a '../' or an absolute path, and a weights file that is a symbolic link out
    of the folder, are refused in one line naming the index entry (or the link), though a valid safetensors file of
    the right shapes lies there."""
    drafter, dconfig = make_drafter(tiny_parts)
    outside = save_drafter(drafter, dconfig, tmp_path / "elsewhere") / "model.safetensors"
    folders = {}
    for case, entry in (("dotdot", "../elsewhere/model.safetensors"), ("absolute", str(outside))):
        folder = save_drafter(drafter, dconfig, tmp_path / case)
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {name: entry for name in expected_tensor_names(2)}}))
        folders[case] = (folder, f"{folder / 'model.safetensors.index.json'}: weight_map entry "
                                 f"'layers.0.self_attn.q_proj.weight' ({entry!r}) names a file outside the drafter "
                                 f"folder {folder}")
    folder = save_drafter(drafter, dconfig, tmp_path / "link")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)
    folders["link"] = (folder, f"{folder / 'model.safetensors'} names a file outside the drafter folder {folder}")
    for case, (folder, message) in folders.items():
        for reader, read in readers().items():
            with pytest.raises(UserError) as err:
                read(folder)
            assert message in str(err.value) and "\n" not in str(err.value), (case, reader, str(err.value))


def damage_d2t(state: dict, how: str) -> None:
    d2t = state["d2t"]  # rows 0..3 map to ids 2, 5, 9, 900
    if how == "beyond":
        d2t[3] = 1024 - 3
    elif how == "negative":
        d2t[0] = -3
    elif how == "duplicate":
        d2t[1] = 1
    elif how == "float":
        state["d2t"] = d2t.float()
    elif how == "short":
        state["d2t"] = d2t[:3].clone()
    else:
        state["lm_head.weight"] = state["lm_head.weight"][:3].clone()


@pytest.mark.parametrize("how,message", [
    ("beyond", "tensor d2t maps draft row 3 to token id 1024, outside the target's vocabulary (0..1023)"),
    ("negative", "tensor d2t maps draft row 0 to token id -3, outside the target's vocabulary (0..1023)"),
    ("duplicate", "tensor d2t maps draft rows 0 and 1 to the same token id 2"),
    ("float", "tensor d2t is float32, not integer offsets from the draft rows to target ids"),
    ("short", "d2t [3] in model.safetensors (config.json implies [4])"),
    ("rows", "lm_head.weight [3, 64] in model.safetensors (config.json implies [4, 64])"),
])
def test_a_damaged_draft_vocabulary_is_one_line_naming_the_tensor_and_file(tiny_parts, tmp_path, how, message):
    """d2t maps each draft row to a target id (row + d2t): an id outside the vocabulary was an IndexError when the
    drafter first drafted, a float or negative or repeated one was read without a word. (A warm start sets both
    tensors aside: the export chooses its own draft vocabulary.)"""
    from safetensors.torch import load_file, save_file

    from dflash_train.model.checkpoint import draft_vocabulary

    drafter, dconfig = make_drafter(tiny_parts)
    config, rows = draft_vocabulary(dconfig, torch.randn(dconfig.vocab_size, dconfig.hidden_size), [2, 5, 9, 900])
    cut = create_drafter(config)
    cut.load_state_dict({**drafter.state_dict(), **rows}, strict=True)
    folder = save_drafter(cut, config, tmp_path / "cut")
    state = load_file(str(folder / "model.safetensors"))
    damage_d2t(state, how)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for reader in ("push", "eval"):
        with pytest.raises(UserError) as err:
            readers()[reader](folder)
        assert message in str(err.value) and str(folder) in str(err.value) and "\n" not in str(err.value), \
            (reader, str(err.value))
        if how not in ("short", "rows"):  # (those two name the file within the folder, as every shape does)
            assert str(err.value).startswith(f"{folder / 'model.safetensors'}: "), str(err.value)


def test_non_finite_weights_are_named_with_their_file_and_tensor(tiny_parts, tmp_path):
    from safetensors.torch import load_file, save_file

    drafter, dconfig = make_drafter(tiny_parts)
    folder = save_drafter(drafter, dconfig, tmp_path / "d")
    state = load_file(str(folder / "model.safetensors"))
    state["layers.1.mlp.down_proj.weight"][0, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for reader, read in readers().items():
        with pytest.raises(UserError) as err:
            read(folder)
        assert (f"{folder / 'model.safetensors'}: tensor layers.1.mlp.down_proj.weight holds 1 NaN and 1 inf "
                f"value(s): the drafter's weights are damaged") in str(err.value), (reader, str(err.value))


@pytest.mark.parametrize("key,value,message", [
    ("num_hidden_layers", 10 ** 9, "num_hidden_layers is 1000000000, not an integer from 1 to 1024"),
    ("hidden_size", -64, "hidden_size is -64, not an integer from 1 to 65536"),
    ("vocab_size", 1024.0, "vocab_size is 1024.0, not an integer from 1 to 2097152"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("rms_norm_eps", -1, "rms_norm_eps is -1, not a positive finite number"),
    ("draft_vocab_size", 5000, "draft_vocab_size is 5000, not an integer from 1 to vocab_size 1024"),
])
def test_a_config_out_of_bounds_is_one_line_naming_the_file_and_key_before_anything_is_built(tiny_parts, tmp_path,
                                                                                           key, value, message):
    """A config.json whose dimensions no drafter has (a billion layers would have every reader allocate without
    bound) is refused by every reader, naming the file and the key, before any table or tensor is built."""
    drafter, dconfig = make_drafter(tiny_parts)
    folder = save_drafter(drafter, dconfig, tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    for reader, read in readers().items():
        with pytest.raises(UserError) as err:
            read(folder)
        assert f"{folder / 'config.json'}: {message}" in str(err.value), (reader, str(err.value))
