"""Frozen-target self-distillation of converted drafters."""
