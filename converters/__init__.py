"""Weight mappings from role-keyed MTP weights into drafter formats (EAGLE, EAGLE-3, Medusa, llama.cpp's GGUF side
file), and the rewriting of a trained drafter's other layouts.

Two registries, keyed by format name (`registry.py`): `CONVERTERS`, one per format whose record
declares the "converter" hook (`converters/api.py` calls it), and `REWRITERS`, one per format that declares
"rewrite" (`converters/rewrite.py` calls it). Each format's module registers its own
(`@CONVERTERS.register("eagle3")`) when this file imports it.
"""

from recycle.converters import eagle, eagle3, gguf, medusa  # each registers its converter (and rewriter)
from recycle.converters.registry import CONVERTERS, REWRITERS, Converter, ConvertRequest, Rewriter

__all__ = ["CONVERTERS", "REWRITERS", "ConvertRequest", "Converter", "Rewriter", "eagle", "eagle3", "gguf", "medusa"]
