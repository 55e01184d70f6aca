"""The DFlash drafter, its contract in one place. It stands on dflash_train.target (the target it drafts for), never
the other way round.

  configuration.py    config.json both ways (DFlashConfig), tensor names, the mask-token rule, the default taps, a
                      new drafter's config
  modeling_dflash.py  THE model (torch + transformers only); copied verbatim into every drafter folder as dflash.py
  masks.py            the blocks of a training row, the one visibility rule and its dense / flex / blockwise backends
  checkpoint.py       create, save (context-scale fold), load, read a folder for push, start from the target or a
                      published drafter
  published.py        a published drafter in any public layout (z-lab, SpecForge, speculators, ours), from a folder
                      or a Hub repo: its config and weights, checked against the run that starts from it
"""
