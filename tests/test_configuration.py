"""A drafter's config (dflash_train/model/configuration.py): config.json both ways, the mask-token rule, the default
taps, and a new drafter's config from its target's."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.errors import UserError
from dflash_train.model.configuration import DFlashConfig, default_layer_ids, resolve_mask_token_id


@pytest.fixture(scope="module")
def tiny_parts(tiny_target_dir):
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(tiny_target_dir), AutoTokenizer.from_pretrained(tiny_target_dir)


def test_config_json_roundtrip(tiny_parts):
    config, tok = tiny_parts
    dconfig = DFlashConfig.from_target(config, num_layers=2, block_size=4, tokenizer=tok,
                                       target_identity={"name": "tiny"})
    raw = json.loads(json.dumps(dconfig.to_config_json(torch.float32)))
    assert DFlashConfig.from_config_json(raw) == dconfig


def test_the_model_reads_the_config_json_it_is_saved_with(tiny_parts):
    """The transformers config the module is built from carries what config.json says (as AutoConfig reads it)."""
    config, tok = tiny_parts
    dconfig = DFlashConfig.from_target(config, num_layers=2, block_size=4, tokenizer=tok)
    hf = dconfig.qwen3_config()
    assert hf.dflash_config == {"mask_token_id": dconfig.mask_token_id, "target_layer_ids": [1, 5]}
    assert (hf.block_size, hf.num_target_layers, hf.num_hidden_layers, hf.head_dim) == (4, 8, 2, 16)


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
        DFlashConfig.from_target(config, num_layers=1, tokenizer=tok, mask_token_id=2)
    with pytest.raises(UserError, match="mask_token_id 2000"):
        DFlashConfig.from_target(config, num_layers=1, mask_token_id=2000)
    with pytest.raises(UserError, match="tokenizer or an explicit mask_token_id"):
        DFlashConfig.from_target(config, num_layers=1)
    assert DFlashConfig.from_target(config, num_layers=1, tokenizer=tok, mask_token_id=3).mask_token == \
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


def test_default_layer_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B, the rule's worked example
    assert default_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]
    with pytest.raises(UserError, match="distinct"):
        default_layer_ids(6, n=5)


def test_one_tapped_layer_defaults_to_the_middle_layer_as_the_reference_does():
    """z-lab/dflash's build_target_layer_ids taps layer L // 2 when the drafter reads one layer (its default
    when config.json has no target_layer_ids); a second rule ([1]) had drifted in. The shipped module and
    dflash_train.model.configuration give the same taps for every L and n."""
    from dflash_train.model.modeling_dflash import build_target_layer_ids

    assert default_layer_ids(30, n=1) == [15] and default_layer_ids(36, n=1) == [18]
    assert default_layer_ids(8, n=1) == [4] and default_layer_ids(7, n=1) == [3]
    for L in (8, 28, 30, 36, 48):
        for n in (1, 2, 3, 5):
            assert default_layer_ids(L, n) == build_target_layer_ids(L, n)


def test_from_target_validates_layers(tiny_parts):
    config, tok = tiny_parts
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 8\]"):
        DFlashConfig.from_target(config, tokenizer=tok, target_layer_ids=[1, 8])
    with pytest.raises(UserError, match="distinct"):
        DFlashConfig.from_target(config, tokenizer=tok, target_layer_ids=[2, 2])
