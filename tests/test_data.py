"""Training data (dflash_train/stages/train/data.py): rows with and without packing, the data plan across ranks and
micro steps, the stable held-out split, collation (positions and doc starts of packed samples, top-k soft labels),
stores that must fit together, and the anchors' weights."""

from __future__ import annotations

import pytest
import torch

from dflash_train.stages.train.data import (DataPlan, StoreSet, anchor_weights, check_soft_labels, collate, make_rows,
                                            split_eval)
from dflash_train.errors import UserError


def test_rows_padding_and_packing():
    lengths = [5, 9, 3, 12, 4, 7]
    assert make_rows([0, 2, 4], lengths, 10, packing=False, seed=0) == [[0], [2], [4]]
    rows = make_rows(list(range(6)), lengths, 10, packing=True, seed=0)
    assert sorted(i for row in rows for i in row) == list(range(6))
    for row in rows:
        assert len(row) == 1 or sum(min(lengths[i], 10) for i in row) <= 10


def test_data_plan_uses_every_row_once_per_epoch_across_ranks_and_micro_steps():
    plan = DataPlan(rows=[[i] for i in range(26)], world=2, micro_batch=3, grad_accum=2, seed=1)
    assert plan.steps_per_epoch == 2
    for epoch in range(2):
        seen = [row[0] for step in range(epoch * 2, epoch * 2 + 2) for micro in range(2) for rank in range(2)
                for row in plan.rows_for(step, micro, rank)]
        assert len(seen) == len(set(seen)) == 24
    assert plan.epoch_order(0) != plan.epoch_order(1)


def test_eval_split_is_stable_and_disjoint():
    ids = [f"id{i}" for i in range(1000)]
    train, held = split_eval(ids, 0.1)
    assert set(train).isdisjoint(held) and len(train) + len(held) == 1000
    assert 60 < len(held) < 140
    assert split_eval(list(reversed(ids)), 0.1)[1] == [999 - i for i in reversed(held)]


def test_collate_packs_samples_with_their_own_positions():
    def sample(n, start):
        return {"input_ids": torch.arange(start, start + n), "loss_mask": torch.ones(n, dtype=torch.bool),
                "hidden_states": torch.full((n, 2), float(start))}

    batch = collate([[sample(3, 10), sample(4, 20)], [sample(2, 30)]], max_length=6)
    assert batch["input_ids"][0].tolist() == [10, 11, 12, 20, 21, 22]  # the second sample is cut at max_length
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2]
    assert batch["doc_start"][0].tolist() == [0, 0, 0, 3, 3, 3]
    assert batch["loss_mask"][1].tolist() == [True, True, False, False, False, False]
    assert int(batch["num_tokens"]) == 8


def test_collate_carries_topk_and_the_trainer_names_a_store_without_it(tmp_path):
    from dflash_train.stages.train.recipe import Recipe
    from dflash_train.store.writer import StoreWriter

    def sample(n, k):
        s = {"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
             "hidden_states": torch.randn(n, 8)}
        if k:
            s["topk_ids"] = torch.arange(n * k).view(n, k)
            s["topk_logprobs"] = -torch.arange(n * k, dtype=torch.float32).view(n, k)
        return s

    batch = collate([[sample(3, 4), sample(2, 5)], [sample(4, 4)]], max_length=16)
    assert batch["topk_ids"].shape == (2, 5, 4) and batch["topk_logprobs"].shape == (2, 5, 4)
    assert torch.equal(batch["topk_ids"][0, 3:], sample(2, 5)["topk_ids"][:, :4])  # packed, cut to the common K
    assert (batch["topk_logprobs"][1, 4] == float("-inf")).all() and (batch["topk_ids"][1, 4] == 0).all()
    assert "topk_ids" not in collate([[sample(3, 4)], [sample(3, 0)]], max_length=16)
    with StoreWriter(tmp_path / "st", target={"name": "x"}, target_layer_ids=[1], hidden_size=8) as writer:
        s = sample(4, 0)
        writer.add(s["input_ids"], s["loss_mask"], s["hidden_states"], id="a")
    recipe = Recipe()
    recipe.objective.soft_label_weight = 0.3
    stores = StoreSet([str(tmp_path / "st")])
    with pytest.raises(UserError, match=rf"{tmp_path / 'st'}.*--store-topk"):
        check_soft_labels(recipe, stores)
    recipe.objective.soft_label_weight = 0.0
    check_soft_labels(recipe, stores)  # hard labels only: no top-k needed


def test_stores_trained_together_must_fit(tmp_path):
    from dflash_train.store.writer import StoreWriter

    def store(name, layers, target):
        with StoreWriter(tmp_path / name, target=target, target_layer_ids=layers, hidden_size=8) as writer:
            writer.add(torch.arange(4), torch.ones(4, dtype=torch.bool), torch.randn(4, 8 * len(layers)), id=name)
        return str(tmp_path / name)

    identity = {"name": "t", "config_hash": "a", "tokenizer_hash": "b", "chat_template_hash": "c"}
    a = store("a", [1], identity)
    assert len(StoreSet([a, store("b", [1], identity)])) == 2
    with pytest.raises(UserError, match=r"store .*/c does not fit store .*/a .*target_layer_ids \[2\] != \[1\]"):
        StoreSet([a, store("c", [2], identity)])
    with pytest.raises(UserError, match=r"store .*/d does not fit .*its target's tokenizer differs"):
        StoreSet([a, store("d", [1], {**identity, "tokenizer_hash": "x"})])


# --- hidden states computed online (data.hidden_states: online) ---------------------------------------------------


def _tokens(target, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 800, (n,), generator=g)


def test_online_states_of_a_padded_micro_batch_are_each_samples_own_states(tiny_target):
    """Rows of packed samples of different lengths, one batched prefill: every sample gets the states a forward of it
    alone gives (HF hidden_states[i + 1] of the tapped layers, every position), cut at max_length, and collate puts
    them where a store's states go."""
    from tolerance import model_tolerance

    from dflash_train.stages.train.data import OnlineStates

    layers = [1, 3, 5]
    samples = [{"input_ids": _tokens(tiny_target, n, n), "loss_mask": torch.ones(n, dtype=torch.bool)}
               for n in (7, 19, 12, 30)]
    online = OnlineStates(tiny_target, layers, max_length=24)
    rows = online.add([[samples[0], samples[1]], [samples[2]], [samples[3]]])
    flat = [s for row in rows for s in row]
    assert [len(row) for row in rows] == [2, 1, 1]
    assert all(s["input_ids"] is o["input_ids"] for s, o in zip(flat, samples))  # only the states are added
    for sample, got in zip(samples, flat):
        ids = sample["input_ids"][:24]
        hidden = tiny_target.model(ids[None], output_hidden_states=True).hidden_states
        ref = torch.cat([hidden[i + 1][0] for i in layers], dim=-1)
        assert got["hidden_states"].shape == (len(ids), 3 * 64)
        torch.testing.assert_close(got["hidden_states"], ref, rtol=0,
                                   atol=model_tolerance(tiny_target.config, ref))
    batch = collate(rows, max_length=24)
    assert torch.equal(batch["hidden_states"][0, 7:24], rows[0][1]["hidden_states"][:17])  # packed after sample 0
    assert not batch["hidden_states"][1, 12:].any()  # padding stays zero, as with stored states


def test_stored_states_need_a_store_that_holds_them(tmp_path):
    from dflash_train.stages.train.data import check_state_source, prepare_data
    from dflash_train.stages.train.recipe import Recipe
    from dflash_train.store.writer import StoreWriter

    for name, storage in (("states", "bf16"), ("tokens", "none")):
        with StoreWriter(tmp_path / name, target={"name": "x"}, target_layer_ids=[1], hidden_size=8,
                         storage_dtype=storage) as writer:
            for k in range(4):
                writer.add(torch.arange(6), torch.ones(6, dtype=torch.bool),
                           torch.randn(6, 8) if storage == "bf16" else None, id=f"s{k}")
    recipe = Recipe()
    recipe.data.stores = [str(tmp_path / "states")]
    recipe.data.eval_store = str(tmp_path / "tokens")
    with pytest.raises(UserError, match=rf"^store {tmp_path / 'tokens'} is token-only .* set data.hidden_states: "
                                        r"online"):
        prepare_data(recipe, 1)
    recipe.data.hidden_states = "online"  # the trainer computes them: token-only stores are fine, mixed too
    data = prepare_data(recipe, 1)
    assert "hidden_states" not in data.eval_samples[0]
    check_state_source(recipe, [StoreSet([str(tmp_path / "tokens")])])
    assert data.stores.summary()["stores"][0]["kind"] == "states"


def test_copy_anchor_weight_favours_anchors_the_context_already_holds():
    ids = torch.tensor([[5, 6, 7, 5, 6, 9, 6, 9]])
    batch = {"input_ids": ids, "doc_start": torch.zeros_like(ids)}
    assert anchor_weights(batch, 1.0) is None  # uniform: the sampler's own path, bit for bit
    assert anchor_weights(batch, 4.0)[0].tolist() == [1, 1, 1, 1, 4, 1, 1, 4]


# --- replaying earlier rounds' stores (data.replay_stores, data.replay_samples) -----------------------------------


def replay_store(folder, ids: list[str], layers=(1,), tokens: dict[str, list[int]] | None = None) -> str:
    """A tiny store of samples with these ids: each sample 4 tokens ([1, 2] prompt, [3, 4] answer unless `tokens`
    gives its own), all of one target."""
    from dflash_train.store.writer import StoreWriter

    with StoreWriter(folder, target={"name": "x"}, target_layer_ids=list(layers), hidden_size=8) as writer:
        for sid in ids:
            got = torch.tensor((tokens or {}).get(sid, [1, 2, 3, 4]))
            writer.add(got, torch.arange(len(got)) >= 2, torch.randn(len(got), 8 * len(layers)), id=sid)
    return str(folder)


def replay_recipe(stores: list[str], replay: list[str], **data):
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    recipe.data.stores, recipe.data.replay_stores = stores, replay
    for key, value in data.items():
        setattr(recipe.data, key, value)
    return recipe


def test_replay_samples_are_chosen_by_their_ids_bounded_and_never_held_out(tmp_path):
    """The replay samples that train are the same in every run and whatever the order of the replay stores,
    data.replay_samples bounds them, max_samples and the eval split leave them alone, and a replay sample whose id
    is held out from data.stores does not train; the summary says how many trained out of how many."""
    from dflash_train.stages.train.data import prepare_data

    new = replay_store(tmp_path / "new", [f"n{k}" for k in range(20)])
    held = {f"n{k}" for k in split_eval([f"n{k}" for k in range(20)], 0.3)[1]}
    assert held
    r1 = replay_store(tmp_path / "r1", [f"a{k}" for k in range(10)] + sorted(held))  # an eval id again, as if seen
    r2 = replay_store(tmp_path / "r2", [f"b{k}" for k in range(10)])

    def trained(stores, replay, **data):
        got = prepare_data(replay_recipe(stores, replay, eval_fraction=0.3, **data), 1)
        ids = got.stores.ids()
        return ([ids[i] for i in got.train_indices if i < got.stores.replay_start],
                {ids[i] for i in got.train_indices if i >= got.stores.replay_start},
                {s["id"] for s in got.eval_samples}, got)

    train, chosen, eval_ids, data = trained([new], [r1, r2], replay_samples=5)
    assert set(train) == {f"n{k}" for k in range(20)} - held and len(chosen) == 5
    assert eval_ids == held  # the eval samples come from data.stores only
    assert trained([new], [r2, r1], replay_samples=5)[1] == chosen  # stable, whatever the replay stores' order
    everything = trained([new], [r1, r2])[1]
    assert everything == {f"a{k}" for k in range(10)} | {f"b{k}" for k in range(10)}  # held-out ids never train
    assert chosen < everything and trained([new], [r1, r2], replay_samples=0)[1] == set()
    few, chosen_few, _, _ = trained([new], [r1, r2], replay_samples=5, max_samples=3)
    assert len(few) == 3 and chosen_few == chosen  # max_samples concerns data.stores alone
    summary = data.stores.summary(data.train_indices)
    assert [s["replay"] for s in summary["stores"]] == [False, True, True]
    assert (summary["replay_samples_trained"], summary["replay_samples_total"]) == (5, 20 + len(held))
    assert "replay_samples_trained" not in prepare_data(replay_recipe([new], []), 1).stores.summary([0])


def test_a_replay_store_that_does_not_fit_is_one_line_naming_it(tmp_path):
    from dflash_train.stages.train.data import prepare_data

    new = replay_store(tmp_path / "new", ["n0", "n1"])
    odd = replay_store(tmp_path / "odd", ["o0"], layers=(2,))
    with pytest.raises(UserError, match=rf"^replay store {tmp_path / 'odd'} \(data.replay_stores\) does not fit store "
                                        rf"{tmp_path / 'new'} .*target_layer_ids \[2\] != \[1\]$"):
        prepare_data(replay_recipe([new], [odd]), 1)
