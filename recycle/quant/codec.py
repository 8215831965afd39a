"""What a storage codec is: how a quantized weight's stored parts are found, read back and written.

A quantized release stores one logical weight (`...q_proj.weight`, [out, in]) as several tensors: packed codes and
their scales (NVFP4: `weight` u8 + `weight_scale` e4m3 + `weight_scale_2` f32; AWQ: `qweight` + `qzeros` +
`scales`; gpt-oss MXFP4: `X_blocks` + `X_scales`; ...). A `Codec` knows one such storage:

- `group(stored)` finds, in a checkpoint's headers, the weights it stores: logical name → `Packed` (the logical
  shape and the stored parts by role). Headers only: no tensor is read, no torch imported; a codec that sets
  `scan_dtypes` is asked only where a tensor of one of them is stored;
- `dequantize(parts, packed, config, dtype)` makes the logical weight from its parts' tensors;
- `quantize(weight, name, config)` (where recycle writes the codec) makes the stored parts of a weight.

Codecs register themselves in `CODECS` under their name (`recycle/quant/*.py`), and a scheme record
(`recycle/quant/schemes.py`) names the codec its releases store; `tests/test_registries.py` resolves each.
The reader (`recycle.checkpoint`) folds each `Packed` weight into one entry of `Checkpoint.tensors` whose dtype
is the codec's `tag` (`TensorInfo.is_packed`), and `Checkpoint.get` dequantizes it through the codec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from recycle.errors import RecycleError
from recycle.registry import Registry

if TYPE_CHECKING:
    import torch


class Packed(NamedTuple):
    """One logical weight stored by a codec: its name and shape as the model sees it, the codec's name and dtype
    tag, and the stored tensors it is made from (role → stored name: "codes", "scale", "global_scale", ...)."""

    name: str
    codec: str
    tag: str  # what `Checkpoint.tensors[name].dtype` says: "MXFP4", "NVFP4", "INT4", ...
    shape: tuple[int, ...]
    parts: Mapping[str, str]


class Codec(ABC):
    """One storage of quantized weights. Subclasses set `name`, `tag`, `bits` (stored bits per weight element,
    codes only) and implement `group` and `dequantize`; `quantize` where recycle writes the codec."""

    name: str = ""
    tag: str = ""
    bits: float = 16.0
    # the stored dtypes its codes part can have: the reader asks `group` only of a checkpoint storing a tensor of one
    # (DeepSeek-V3's 92k names and V4-Pro's 145k are not walked for a storage they hold no tensor of); None: always
    scan_dtypes: frozenset[str] | None = None

    def bits_of(self, tag: str) -> float:
        """Stored bits per element of the codes of a weight this codec tagged `tag` (a codec storing several
        widths, INT4 and INT8, says per tag)."""
        return self.bits

    @abstractmethod
    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        """The weights this codec stores among `stored` (stored name → TensorInfo: `.dtype`, `.shape`), by logical
        name. `config` is the release's quantization config ({} where it has none)."""

    @abstractmethod
    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        """The logical weight (`packed.shape`, `dtype`) from its parts' stored tensors (role → tensor)."""

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        """The stored tensors (stored name → tensor) of logical weight `name` with values `weight`."""
        raise RecycleError(f"{name}: recycle does not write the {self.name} storage")


CODECS: Registry[Codec] = Registry("storage codec")


def check_shape(packed: Packed, role: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    """One line naming the part, when a stored part's shape is not what its logical weight needs."""
    if tuple(got) != tuple(want):
        raise RecycleError(f"{packed.parts.get(role, packed.name)}: shape {list(got)}, but a {packed.tag} "
                           f"{list(packed.shape)} weight needs {list(want)} (corrupt or mislabelled {packed.codec} tensor)")
