"""The MTP runtime: a checkpoint's Multi-Token-Prediction modules run as the serving engines run them.

`base` holds the common runtime (`MTP`: embedding, norms, projection, one decoder block per depth, the head) and the
`RUNTIMES` registry; a layout the common forward cannot run has its own module here, registered under the name its
family row gives in `runtime` (`deepseek_v4`: hyper-connection streams as the chained state); `blocks` holds decoder
layers composed from transformers' own parts where no transformers class runs a release's MTP block as stored.
"""

from recycle.mtp import deepseek_v4  # registers its runtime in RUNTIMES
from recycle.mtp.base import (
    LEAF_ROLES,
    MASKS,
    MTP,
    REQUIRED_ROLES,
    RUNTIMES,
    MTPDepth,
    MTPOutput,
    Norm,
    block_config,
    block_rotary,
    chained_streams,
    family_config,
    misfit,
    mtp_layer_types,
    part_rows,
    renamed,
    to_checkpoint_layout,
    to_runtime_layout,
)

__all__ = ["LEAF_ROLES", "MASKS", "MTP", "REQUIRED_ROLES", "RUNTIMES", "MTPDepth", "MTPOutput", "Norm", "block_config",
           "block_rotary", "chained_streams", "deepseek_v4", "family_config", "misfit", "mtp_layer_types", "part_rows", "renamed", "to_checkpoint_layout",
           "to_runtime_layout"]
