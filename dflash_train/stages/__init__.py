"""The pipeline's stages, in the order a user runs them: ingest -> capture -> train -> evaluate -> push.

Each stage is a subpackage whose `command` module is what `dflash-train STAGE` runs. Stages stand on the services
at the package's top level (store, target, engine, model, objective, ...); no service imports a stage.
"""
