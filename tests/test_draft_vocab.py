"""The draft vocabulary the training export chooses (dflash_train/stages/train/draft_vocab.py)."""

from __future__ import annotations

from collections import Counter

import torch

from dflash_train.stages.train.data import StoreSet
from dflash_train.stages.train.draft_vocab import choose, choose_draft_vocabulary, token_counts


def test_the_answers_most_used_ids_come_first_then_the_prompts_and_the_stop_tokens_always():
    answers, prompts = Counter({7: 5, 9: 3, 4: 1}), Counter({11: 9, 7: 2, 12: 1})
    assert choose(answers, prompts, 3, [2]) == [2, 7, 9]  # the stop token, then the answers' most used
    assert choose(answers, prompts, 5, [2]) == [2, 4, 7, 9, 11]  # every answer id, then the prompts' most used
    assert choose(answers, prompts, 100, [2]) == [2, 4, 7, 9, 11, 12]  # fewer where the stores use fewer ids


def test_token_counts_read_every_shard_without_the_states_and_weigh_each_sample_by_its_copies(tmp_path):
    """Counted from the token tensors alone (`Store.tokens`), across shards and stores, each sample as often as
    dedup found it, answers (loss-masked positions) apart from prompts; the record says what the ids cover."""
    from dflash_train.store.writer import StoreWriter

    samples = {"a": ([1, 2, 3, 5, 5, 6], 3, 2), "b": ([1, 2, 6, 6, 7], 2, 1), "c": ([4, 8, 8, 9], 1, 3)}
    folders = []
    for name, keys in (("s1", "ab"), ("s2", "c")):
        # a shard per sample: the reader walks several
        with StoreWriter(tmp_path / name, target={"name": "x"}, target_layer_ids=[1], hidden_size=4,
                         shard_bytes=1) as writer:
            for key in keys:
                ids, prompt, weight = samples[key]
                mask = torch.arange(len(ids)) >= prompt
                writer.add(torch.tensor(ids), mask, torch.randn(len(ids), 4), id=key, weight=weight)
        folders.append(str(tmp_path / name))
    stores = StoreSet(folders)
    assert sum(len(store._shards) for store in stores.stores) == 3
    answers, prompts = token_counts(stores, [0, 1, 2])
    assert answers == Counter({5: 4, 6: 2 + 2, 7: 1, 8: 6, 9: 3})
    assert prompts == Counter({1: 3, 2: 3, 3: 2, 4: 3})
    vocab = choose_draft_vocabulary(stores, [0, 1, 2], 4, [0])
    assert vocab["ids"] == [0, 5, 6, 8] and vocab["answer_ids"] == 5
    assert vocab["answer_tokens_covered"] == round((4 + 4 + 6) / 18, 4)


def test_only_the_samples_that_train_are_counted(tmp_path):
    """Held-out samples and replay samples data.replay_samples leaves out add no id: a token only they use is not
    drafted."""
    from test_data import replay_recipe, replay_store

    from dflash_train.stages.train.data import prepare_data

    new = replay_store(tmp_path / "new", [f"n{k}" for k in range(8)])
    ids = [f"r{k}" for k in range(6)]
    old = replay_store(tmp_path / "old", ids, tokens={sid: [1, 2, 3, 100 + k] for k, sid in enumerate(ids)})
    data = prepare_data(replay_recipe([new], [old], eval_fraction=0.3, replay_samples=2), 1)
    trained = [data.stores.ids()[i] for i in data.train_indices]
    answers, _ = token_counts(data.stores, data.train_indices)
    assert set(answers) == {3, 4} | {100 + k for k, sid in enumerate(ids) if sid in trained}
    assert sum(answers.values()) == 2 * len(trained) and len(answers) == 4  # 2 answer tokens a sample, 2 replayed
