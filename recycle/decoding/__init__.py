"""The built-in tree-verification decoder: draft trees, masks, KV-cache gather, verification, the decode loop."""

from recycle.decoding.drafting.base import AutoRegressive, Drafter
from recycle.decoding.drafting.native_mtp import MTPStack
from recycle.decoding.loop import DecodeStats, Generation, generate
from recycle.decoding.target import Target, load_target
from recycle.decoding.tree import DynamicTreeSpec, MaskCache, StaticTree, Tree

__all__ = ["AutoRegressive", "Drafter", "MTPStack", "DecodeStats", "Generation", "generate", "Target", "load_target",
           "DynamicTreeSpec", "MaskCache", "StaticTree", "Tree"]
