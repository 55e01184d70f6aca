"""The drafter a run starts from: checked against the store and the target, then built new (shaped like the
target), from the target's top layers, or from a published drafter (`drafter.init_from`)."""

from __future__ import annotations

import torch

from dflash_train.errors import UserError
from dflash_train.stages.train.data import OnlineStates, StoreSet, context_scale
from dflash_train.stages.train.recipe import Recipe
from dflash_train.target import Features, check_fits

NEW_DRAFTER_LAYERS = 5  # drafter.num_layers left unset on a new drafter: the reference drafters' depth


def check_store_against_target(stores: StoreSet, target_name: str) -> None:
    """The target named by the recipe must be the target the store was captured from."""
    from dflash_train.target import resolve_target, target_identity

    identity = target_identity(resolve_target(target_name), target_name)
    check_fits(f"store {stores.folders[0]} (captured from target {stores.manifest['target'].get('name')!r})",
               Features.of_store(stores.manifest), f"target {target_name!r} (set drafter.target to the captured "
               f"target)", Features(identity, None, identity.hidden_size))


def build_drafter(recipe: Recipe, stores: StoreSet, target_name: str, train_indices: list[int] | None = None,
                  online: OnlineStates | None = None):
    """(model, config) of the drafter this recipe starts from: shaped like the target, tapping the store's layers,
    random (seeded), from the target's top layers, or from a published drafter (`drafter.init_from`, whose shape
    it takes; its source is recorded in config.json as `fine_tuned_from`). `online`: the states drafter.context_norm
    measures are computed."""
    from transformers import AutoConfig

    from dflash_train.model.checkpoint import create_drafter, init_from_target, load_decoder_layers, load_start
    from dflash_train.model.published import drafter_to_start_from
    from dflash_train.model.configuration import DFlashConfig
    from dflash_train.target import checkpoint_stop_token_ids, load_tokenizer, resolve_target

    d = recipe.drafter
    store_layers = list(stores.manifest["target_layer_ids"])
    if d.target_layer_ids is not None and list(d.target_layer_ids) != store_layers:
        raise UserError(f"recipe drafter.target_layer_ids {d.target_layer_ids} differ from the layers store "
                        f"{stores.folders[0]} captured ({store_layers}): remove the key or capture the layers you want")
    path = resolve_target(target_name)
    target_config, tokenizer = AutoConfig.from_pretrained(path), load_tokenizer(str(path))
    start = None
    if d.init_from is not None:
        start = drafter_to_start_from(d.init_from, d.init_revision, {"num_layers": d.num_layers,
                                      "mask_token_id": d.mask_token_id, "target_layer_ids": d.target_layer_ids},
                                      d.block_size, Features.of_store(stores.manifest), target_name, target_config,
                                      tokenizer, checkpoint_stop_token_ids(path, tokenizer))
        config = start.config
        config.extra["fine_tuned_from"] = start.source.record()
    else:
        config = DFlashConfig.from_target(target_config, num_layers=d.num_layers or NEW_DRAFTER_LAYERS,
                                          block_size=d.block_size, target_layer_ids=store_layers,
                                          mask_token_id=d.mask_token_id, tokenizer=tokenizer,
                                          target_identity=stores.manifest["target"])
    torch.manual_seed(recipe.seed)
    drafter = create_drafter(config)
    if d.context_norm:
        drafter.set_context_scale(context_scale(stores, train_indices or list(range(len(stores))), online=online))
    if start is not None:
        load_start(drafter, start.state)
    elif d.init == "target":
        n, k = config.num_target_layers, config.num_hidden_layers
        layers, final_norm = load_decoder_layers(target_name, list(range(n - k, n)))
        init_from_target(drafter, layers, final_norm)
    return drafter, config
