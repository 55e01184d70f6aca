"""The run folder: what a run writes where, the claim on it, and the checkpoint a rerun resumes.

Run folder (`output_dir`):
  checkpoints/step-NNNNNNN/   accelerate/DeepSpeed state (model, optimizer, scheduler, RNG) + trainer_state.json
                              (with the recipe it was written under)
  drafter/                    the final drafter (public DFlash format: config.json names the target) and
                              training_args.json
  metrics.jsonl               one row per logged step and per eval
  recipe.yaml, provenance.json
  .dflash-train.lock          held by the run writing the folder: a second training into it is refused

Before anything is written, rank 0 claims the folder (a folder of another stage, or a run in progress, is refused)
and compares the recipe with the checkpoint it would resume (RESUMABLE_KEYS may change; anything else is refused).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dflash_train.device import Precision
from dflash_train.errors import UserError
from dflash_train.provenance import OutputClaim, config_differences, shown_pair, write_provenance
from dflash_train.stages.train.recipe import Recipe

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
STAGE = "train"
# Recipe keys that may change when a run resumes: how it is named, logged, validated, checkpointed and published,
# how long it runs (the schedule then follows the new length, and the run says so), and settings that change speed
# or memory but not the result (threads, gradient checkpointing, the LM-head chunk). Any other change (data, drafter,
# objective, optimizer, batch, precision, DeepSpeed, seed) would make the checkpoint's weights, optimizer state or
# data order mean something else, and is refused before anything is written.
# data.hidden_states (stored or online) may change too: both are the states of the same tokens from the same target
# (its identity and tap ids are checked against the store either way), and they differ only by rounding: the storage
# dtype (bf16, or fp8 with its per-token scale) and the order of the sums in a differently shaped forward. Stores of
# bf16 and of fp8 states already train together as the same data; a run that runs out of disk may go on online.
RESUMABLE_KEYS = ("name", "output_dir", "license", "logging", "eval", "checkpoint", "push", "data.eval_samples",
                  "data.hidden_states", "train.max_steps", "train.epochs", "train.time_budget_s",
                  "train.max_bad_steps", "train.cpu_threads", "train.gradient_checkpointing",
                  "objective.head_chunk_tokens")


def is_run_folder(out: Path) -> bool:
    """A run folder train wrote before folders recorded their stage: a checkpoint's trainer state or the drafter's
    training_args.json (a recipe.yaml alone may be the user's own)."""
    return any(out.glob(f"checkpoints/step-*/{STATE_FILE}")) or (out / "drafter" / "training_args.json").exists()


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (they have trainer_state.json; temporary folders never do), oldest first."""
    found = []
    for path in (run_dir / "checkpoints").glob(CHECKPOINT_PREFIX + "*"):
        suffix = path.name[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and (path / STATE_FILE).exists():
            found.append((int(suffix), path))
    return sorted(found)


def find_resume_checkpoint(recipe: Recipe, run_dir: Path) -> Path | None:
    mode = recipe.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        found = checkpoint_dirs(run_dir)
        return found[-1][1] if found else None
    path = Path(mode)
    if not (path / STATE_FILE).exists():
        raise UserError(f"recipe checkpoint.resume names {path}, which is not a complete checkpoint (no {STATE_FILE})")
    return path


def check_resumable(checkpoint: Path, recipe: Recipe, run_dir: Path, world: int) -> None:
    """Refuse to resume `checkpoint` under a recipe that changed what matters (anything outside RESUMABLE_KEYS) or
    with another number of processes; a UserError listing every such change, raised before anything is written."""
    state_file = checkpoint / STATE_FILE
    try:
        saved = json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {state_file} ({err}): the checkpoint cannot be resumed") from None
    if not isinstance(saved, dict):
        raise UserError(f"{state_file} holds a JSON {type(saved).__name__}, not an object: the checkpoint cannot be "
                        f"resumed")
    old = saved.get("recipe")
    source = state_file
    written_by = checkpoint.parent.parent / "recipe.yaml"  # checkpoints written before they kept their recipe
    if old is None and written_by.exists():
        old, source = yaml.safe_load(written_by.read_text()), written_by
    changes = []
    if saved.get("world_size") not in (None, world):
        changes.append(f"processes {saved['world_size']} -> {world} (the batch per step and the data order depend "
                       f"on it)")
    if isinstance(old, dict):
        for key, before, now in config_differences(old, recipe.to_dict()):
            if not any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
                shown = shown_pair(before, now, width=40)
                changes.append(f"{key} {shown[0]} -> {shown[1]}")
    if changes:
        raise UserError(f"{run_dir} would resume {checkpoint} with a changed recipe ({'; '.join(changes)}; as "
                        f"recorded in {source}): these change what the checkpoint means. Restore them to resume, or "
                        f"train into a new output_dir (or set checkpoint.resume: never to start over). Only "
                        f"{', '.join(RESUMABLE_KEYS)} may change on resume; nothing was written")


def claim_run_folder(recipe: Recipe, run_dir: Path, world: int) -> OutputClaim:
    """Rank 0, before anything is written: claim and lock the run folder, and refuse a resume whose recipe
    changed what matters."""
    claim = OutputClaim(run_dir, STAGE, legacy=is_run_folder)
    try:
        checkpoint = find_resume_checkpoint(recipe, run_dir)
        if checkpoint is not None:
            check_resumable(checkpoint, recipe, run_dir, world)
    except BaseException:
        claim.release(failed=True)
        raise
    return claim


def write_run_records(run_dir: Path, recipe: Recipe, recipe_path: str | None, overrides: tuple[str, ...], world: int,
                      precision: Precision) -> None:
    """Main process, once the inputs are checked: recipe.yaml and provenance.json of the run folder."""
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_provenance(run_dir, config=recipe.to_dict(), stage=STAGE, recipe_file=recipe_path,
                     overrides=list(overrides), world_size=world, precision=precision.as_dict())
    print(f"train: compute dtype {precision.describe()}", flush=True)
