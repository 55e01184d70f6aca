"""A tiny random Llama target (hidden 64, 8 layers, vocab 1024) with a real byte-level BPE tokenizer and a
ChatML template, so that tests exercise the same code paths as the real target in milliseconds.

The tokenizer has fewer entries than the embedding table, leaving reserved rows past its vocabulary (as
Qwen3 has), and SmolLM2-like special tokens at the start."""

from __future__ import annotations

from pathlib import Path

# ChatML, plus tool definitions, tool calls and tool results rendered the way Qwen2.5's template does (a tools
# block in the system turn, <tool_call> JSON after the assistant's text): what a tool-calling target serves.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>tools\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
    "{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>' + (call.function | tojson) + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<filename>"]
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. Water boils at 100 degrees.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Hello! How can I help you today? I am a helpful assistant and I like short answers.",
    "Write a poem about the sea. The sea is blue and wide, the waves roll in with the tide.",
    "Summarize the main ideas of the article in three bullet points for a marketing team.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" @ # $ % ^ & _ | ~ `",
] * 20
TOKENIZER_VOCAB = 900
MODEL_VOCAB = 1024


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_tiny_target(out_dir: str | Path, seed: int = 0, num_layers: int = 8, num_heads: int = 4,
                     num_kv_heads: int = 2) -> Path:
    """Write a random tiny Llama checkpoint with tokenizer to `out_dir` and return the folder (hidden 64, head_dim
    64 / num_heads: vLLM's CPU attention needs a head_dim of 32 or more, i.e. num_heads <= 2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=64 // num_heads,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        # The default init (std 0.02) makes every layer near-identity: greedy decoding then repeats the prompt's
        # last token forever and equality tests pass trivially. Larger weights give varied continuations.
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for name, param in model.model.layers.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0, 0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_drafter(target_config, tokenizer=None, num_layers: int = 2, block_size: int = 4, seed: int = 0,
                      **kw):
    """(model, config) of a fresh drafter for a tiny target (its transformers config and tokenizer)."""
    import torch

    from dflash_train.model.checkpoint import create_drafter
    from dflash_train.model.configuration import DFlashConfig

    config = DFlashConfig.from_target(target_config, num_layers=num_layers, block_size=block_size,
                                      tokenizer=tokenizer, **kw)
    torch.manual_seed(seed)
    return create_drafter(config), config


def random_drafter(target_config, tokenizer, num_layers: int = 2, block_size: int = 4, seed: int = 0, **kw):
    """(model in eval mode, config) of a tiny drafter with every weight random, norm weights too (so q_norm, k_norm
    and hidden_norm matter)."""
    import torch

    drafter, config = make_tiny_drafter(target_config, tokenizer, num_layers=num_layers, block_size=block_size,
                                        seed=seed, **kw)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    return drafter.eval(), config


def blocks_input(drafter, S: int, anchors: list[int], seed: int = 1):
    """A context of S tokens and len(anchors) packed blocks, batch 1, with the training mask: (embeds, context,
    position_ids, context_position_ids, dense mask, blocks)."""
    import torch

    from dflash_train.model import masks

    B = drafter.config.block_size
    g = torch.Generator().manual_seed(seed)
    H, n = drafter.config.hidden_size, len(drafter.target_layer_ids)
    context = torch.randn(1, S, n * H, generator=g)
    embeds = torch.randn(1, len(anchors) * B, H, generator=g)
    anchor_t = torch.tensor([anchors])
    position_ids = (anchor_t[:, :, None] + torch.arange(B)).reshape(1, -1)
    blocks = masks.make_blocks(anchor_t, torch.ones_like(anchor_t, dtype=torch.bool), B)
    return embeds, context, position_ids, torch.arange(S)[None], masks.dense_mask(blocks, S), blocks


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_CALL_REQUEST = {"request": {"tools": [WEATHER_TOOL], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]}}  # a logged tool-calling request, as OpenAI's API takes it


def write_prompt_folder(out: Path, records: list[tuple[str, dict | None, dict | None]]) -> Path:
    """A finished ingest output whose train and eval splits both hold `records` ((id, sampling, constraints) each,
    one user turn) as stored, whatever their values: what an older ingest, or a hand edit, may have left."""
    import json

    import datasets

    from dflash_train.prompts import features
    from dflash_train.provenance import write_provenance

    rows = [{"id": rid, "messages": [{"role": "user", "content": f"Question {rid}?", "tool_calls": None,
                                      "tool_call_id": None, "name": None}],
             "sampling": {"temperature": None, "top_p": None, "max_tokens": None, **(sampling or {})},
             "response": None, "source": "test", "weight": 1, "tools": None,
             "constraints": json.dumps(constraints) if constraints else None} for rid, sampling, constraints in records]
    split = datasets.Dataset.from_list(rows, features=features())
    datasets.DatasetDict({"train": split, "eval": split}).save_to_disk(str(out))
    (out / "report.json").write_text(json.dumps({"kept": 2 * len(rows)}))
    write_provenance(out)  # marks the folder as a finished ingest output
    return out


def draft(model, embeds, context, pos, cpos, mask=None, attention_fn=None, cache=None):
    """The drafter's forward with the context and block positions given apart (the tests' habit)."""
    import torch

    return model(position_ids=torch.cat([cpos, pos], dim=1), noise_embedding=embeds, target_hidden=context,
                 attention_mask=mask, attention_fn=attention_fn, past_key_values=cache)


def reference_drafter(out_dir: str | Path, target_config, layer_ids: list[int], mask_token_id: int,
                      num_layers: int = 2, block_size: int = 16, seed: int = 0, dtype=None) -> Path:
    """A drafter folder written by z-lab's public reference code (the `dflash` package, z-lab/dflash's model.py,
    installed by `make install`): its DFlashDraftModel built from a Qwen3Config shaped like the target, random
    weights (norms too), saved with save_pretrained, exactly as the reference drafters on the Hub are laid out."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    t = target_config
    config = Qwen3Config(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                         head_dim=t.hidden_size // t.num_attention_heads, vocab_size=t.vocab_size,
                         max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
                         rope_theta=getattr(t, "rope_theta", 10000.0))
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = t.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)}
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0.0))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir)
    return Path(out_dir)
