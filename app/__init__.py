"""dflash-gateway: an OpenAI-compatible gateway for SGLang DFlash workers."""

__version__ = "0.1.0"
