"""A drafter's config (dflash_train/model/configuration.py): config.json both ways, the mask-token rule, and a new
drafter's config from its target's."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.errors import UserError
from dflash_train.model.configuration import DFlashConfig, resolve_mask_token_id


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


def test_from_target_validates_layers(tiny_parts):
    config, tok = tiny_parts
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 8\]"):
        DFlashConfig.from_target(config, tokenizer=tok, target_layer_ids=[1, 8])
    with pytest.raises(UserError, match="distinct"):
        DFlashConfig.from_target(config, tokenizer=tok, target_layer_ids=[2, 2])
