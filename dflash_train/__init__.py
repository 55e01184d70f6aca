"""dflash-train: train DFlash block-diffusion drafters from an LLM service's own production traffic."""

__version__ = "0.1.0"
