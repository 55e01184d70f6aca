"""train: the DFlash drafter's recipe, its data and the trainer (accelerate launch train.py RECIPE)."""
