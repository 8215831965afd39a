"""recycle: turn pretrained Multi-Token-Prediction modules into speculative-decoding drafters."""

__version__ = "0.1.0"
