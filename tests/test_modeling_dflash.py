"""The model module (dflash_train/model/modeling_dflash.py): architecture rules, attention through an explicit
attention function, the incremental cache, RoPE, gradients and gradient checkpointing, and the same module loading
as remote code in a fresh interpreter without dflash_train."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from tiny import blocks_input, draft, random_drafter

from dflash_train.model import masks
from dflash_train.model.checkpoint import save_drafter
from dflash_train.model.modeling_dflash import sdpa_attention

REPO_ROOT = Path(__file__).resolve().parent.parent
B = 4  # block size in the small tests


def make_drafter(tiny_parts, num_layers: int = 2, seed: int = 0, **kw):
    config, tokenizer = tiny_parts
    return random_drafter(config, tokenizer, num_layers=num_layers, block_size=B, seed=seed, **kw)


def block(out: torch.Tensor, j: int) -> torch.Tensor:
    return out[:, j * B:(j + 1) * B]


# -- attention rules -------------------------------------------------------------------------------------------------

def test_block_sees_only_context_before_its_anchor_and_itself(tiny_parts):
    drafter, _ = make_drafter(tiny_parts)
    anchors = [5, 12, 19]
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 24, anchors)
    with torch.no_grad():
        run = lambda e, c: draft(drafter, e, c, pos, cpos, mask)  # noqa: E731
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
        alone = draft(drafter, embeds[:, B:2 * B], context[:, :12], pos[:, B:2 * B], cpos[:, :12])
        torch.testing.assert_close(alone, block(base, 1), rtol=0, atol=1e-5)


def test_every_attention_backend_computes_the_dense_masks_attention(tiny_parts):
    """The mask stays a mask; the function that reads it is passed explicitly: FlexAttention's BlockMask (eager
    kernel here), the blockwise groups, and an explicit SDPA function equal the default dense path."""
    from torch.nn.attention.flex_attention import flex_attention

    drafter, _ = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, blocks = blocks_input(drafter, 20, [4, 9, 15])

    def eager_flex(q, k, v, block_mask, scale):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

    with torch.no_grad():
        dense = draft(drafter, embeds, context, pos, cpos, mask)
        flex = draft(drafter, embeds, context, pos, cpos, masks.flex_block_mask(blocks, 20), eager_flex)
        torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
        blockwise = draft(drafter, embeds, context, pos, cpos, masks.blockwise_mask(blocks, 20),
                          masks.blockwise_attention)
        torch.testing.assert_close(blockwise, dense, rtol=0, atol=1e-5)
        explicit = draft(drafter, embeds, context, pos, cpos, mask, sdpa_attention)
        assert torch.equal(explicit, dense)


def test_block_never_sees_another_samples_context(tiny_parts):
    """A packed row (samples at 0..7 and 8..15): the block anchored at 10 sees 8..9 only, whatever the first
    sample's states are (the mask's window starts at its own sample)."""
    drafter, _ = make_drafter(tiny_parts)
    embeds, context, pos, cpos, _, _ = blocks_input(drafter, 16, [4, 10])
    doc_start = torch.tensor([[0] * 8 + [8] * 8])
    blocks = masks.make_blocks(torch.tensor([[4, 10]]), torch.tensor([[True, True]]), B, doc_start)
    mask = masks.dense_mask(blocks, 16)
    assert not mask[0, 0, B:2 * B, :8].any() and mask[0, 0, B:2 * B, 8:10].all()
    other_sample = context.clone()
    other_sample[:, :8] = 1e3
    with torch.no_grad():
        mine = block(draft(drafter, embeds, other_sample, pos, cpos, mask), 1)
        assert torch.equal(mine, block(draft(drafter, embeds, context, pos, cpos, mask), 1))


def test_incremental_cache_equals_full_recompute(tiny_parts):
    """Eval-style drafting: each step appends the newly committed context to the cache; the block's K/V are
    never cached. Every step must equal a full recompute over the whole committed context."""
    from transformers import DynamicCache

    from dflash_train.model.modeling_dflash import crop_cache

    drafter, _ = make_drafter(tiny_parts, num_layers=3)
    H, n = drafter.config.hidden_size, len(drafter.target_layer_ids)
    g = torch.Generator().manual_seed(3)
    states = torch.randn(1, 40, n * H, generator=g)  # tapped states of the committed tokens
    cache = DynamicCache()
    committed = 0
    with torch.no_grad():
        for anchor in (9, 12, 13, 18, 25):  # prompt of 9, then steps committing 3, 1, 5, 7 tokens
            embeds = torch.randn(1, B, H, generator=g)
            pos = torch.arange(anchor, anchor + B)[None]
            step = draft(drafter, embeds, states[:, committed:anchor], pos, torch.arange(committed, anchor)[None],
                         cache=cache)
            full = draft(drafter, embeds, states[:, :anchor], pos, torch.arange(anchor)[None])
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
            assert cache.get_seq_length() == anchor  # context kept, block dropped
            committed = anchor
        # a second draft at the same anchor brings no new context (an empty [1, 0, n*H] context)
        embeds = torch.randn(1, B, H, generator=g)
        step = draft(drafter, embeds, states[:, 25:25], pos, torch.arange(25, 25)[None], cache=cache)
        full = draft(drafter, embeds, states[:, :25], pos, torch.arange(25)[None])
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
        assert cache.get_seq_length() == 25
        crop_cache(cache, 20)  # rejecting committed context (e.g. a rollback) and redrafting from there
        embeds = torch.randn(1, B, H, generator=g)
        pos = torch.arange(22, 22 + B)[None]
        step = draft(drafter, embeds, states[:, 20:22], pos, torch.arange(20, 22)[None], cache=cache)
        full = draft(drafter, embeds, states[:, :22], pos, torch.arange(22)[None])
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


def test_rope_uses_absolute_positions(tiny_parts):
    drafter, _ = make_drafter(tiny_parts)
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 12, [6])
    with torch.no_grad():
        base = draft(drafter, embeds, context, pos, cpos, mask)
        shifted = draft(drafter, embeds, context, pos + 3, cpos + 3, mask)
        assert torch.allclose(base, shifted, atol=1e-4)  # relative positions unchanged: RoPE is relative
        moved = draft(drafter, embeds, context, pos + 3, cpos, mask)
        assert not torch.allclose(base, moved, atol=1e-4)


def test_every_parameter_gets_a_gradient_and_checkpointed_layers_give_the_same(tiny_parts):
    """Training reaches fc, hidden_norm, k_norm, ... through the packed-block mask (nothing is dead), and layers
    that recompute themselves in backward (transformers' gradient_checkpointing_enable) give the same gradients."""
    drafter, _ = make_drafter(tiny_parts)
    drafter.train()
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 16, [3, 9])
    draft(drafter, embeds, context, pos, cpos, mask).pow(2).mean().backward()
    dead = [name for name, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []
    grads = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad()
    drafter.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in drafter.layers)
    calls = []
    for layer in drafter.layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    draft(drafter, embeds, context, pos, cpos, mask).pow(2).mean().backward()
    assert len(calls) == len(drafter.layers)  # every layer went through the checkpoint function
    for g, p in zip(grads, drafter.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_rope_scaled_target_gives_the_same_outputs_through_automodel(tiny_parts, tmp_path):
    """A target with non-default RoPE (llama3 scaling): the saved folder loaded by AutoModel computes the same."""
    from transformers import AutoModel

    config, tok = tiny_parts
    scaled = config.__class__.from_dict({**config.to_dict(), "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    drafter, dconfig = make_drafter((scaled, tok))
    assert dconfig.rope_parameters["rope_type"] == "llama3"
    folder = save_drafter(drafter, dconfig, tmp_path / "scaled_rope_drafter")
    remote = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 100, [40, 90])  # past original_max_position
    with torch.no_grad():
        ours = draft(drafter, embeds, context, pos, cpos, mask)
        theirs = remote(position_ids=torch.cat([cpos, pos], 1), attention_mask=mask, noise_embedding=embeds,
                        target_hidden=context)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
        plain, _ = make_drafter(tiny_parts)  # same seed, default rope: must differ at these positions
        assert not torch.allclose(draft(plain, embeds, context, pos, cpos, mask), ours, atol=1e-4)


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
    drafter, dconfig = make_drafter(tiny_parts, num_layers=2)
    folder = save_drafter(drafter, dconfig, tmp_path / "drafter")
    embeds, context, pos, cpos, mask, _ = blocks_input(drafter, 20, [4, 9, 15])
    H, n = drafter.config.hidden_size, len(drafter.target_layer_ids)
    g = torch.Generator().manual_seed(7)
    states = torch.randn(1, 30, n * H, generator=g)
    steps = [(0, 10), (10, 13), (13, 14), (14, 21)]
    step_embeds = torch.randn(1, len(steps) * B, H, generator=g)
    data = dict(embeds=embeds, context=context, pos=pos, cpos=cpos, mask=mask, states=states, steps=steps,
                step_embeds=step_embeds, block_size=B, mask_token_id=dconfig.mask_token_id,
                target_layer_ids=dconfig.target_layer_ids, prompt=torch.tensor([[1, 40, 41, 42, 43]]),
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
        torch.testing.assert_close(out["packed"], draft(drafter, embeds, context, pos, cpos, mask), rtol=0,
                                   atol=1e-5)
        expected = []
        for i, (start, end) in enumerate(steps):  # our full recompute over the committed context
            e = step_embeds[:, i * B:(i + 1) * B]
            expected.append(draft(drafter, e, states[:, :end], torch.arange(end, end + B)[None],
                                  torch.arange(end)[None]))
        torch.testing.assert_close(out["steps"], torch.cat(expected, dim=1), rtol=0, atol=1e-5)
    assert torch.equal(out["spec"], out["greedy"])  # speculative decoding is lossless
    assert sum(out["lengths"]) + 1 >= data["max_new"] and all(1 <= n <= B for n in out["lengths"])
