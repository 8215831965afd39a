"""GGUF files read through the `gguf` package: one opener that turns a broken file into one line, and
`recycle inspect FILE.gguf` (architecture, declared and stored MTP blocks, their tensor types, findings).

llama.cpp declares MTP blocks with `{arch}.nextn_predict_layers` (the last that many of `{arch}.block_count`
blocks) and stores a block's MTP leaves as `blk.{n}.nextn.*`. A file can hold the trunk and its MTP block, the
trunk alone (llama.cpp's converter with `--no-mtp`, or DeepSeek-V3's, which drops MTP), or the MTP block alone
(a side file for `-md`: no `blk.0.*`).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from recycle.errors import RecycleError
from recycle.ggufarch import CHAINED

MAGIC = b"GGUF"
NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
BLOCK = re.compile(r"^blk\.(\d+)\.")


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path`, or RecycleError in one line (missing, not a GGUF, truncated)."""
    p = Path(path)
    if not p.is_file():
        raise RecycleError(f"{p}: no such GGUF file")
    with open(p, "rb") as f:
        if f.read(4) != MAGIC:
            raise RecycleError(f"{p}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        from gguf import GGUFReader

        r = GGUFReader(str(p))
    except Exception as e:  # whatever a cut or corrupt header makes the reader raise is bad input
        raise RecycleError(f"{p}: unreadable GGUF ({type(e).__name__}: {' '.join(str(e).split())[:120]}); "
                           "truncated or corrupt?") from None
    size = p.stat().st_size
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size:
            raise RecycleError(f"{p}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes:,}, "
                               f"the file has {size:,}")
    return r


def value_of(reader, key: str):
    f = reader.fields.get(key)
    return f.contents() if f is not None else None


def inspect_gguf(path: str | os.PathLike) -> dict:
    """The `recycle inspect FILE.gguf --json` object."""
    r = open_gguf(path)
    arch = value_of(r, "general.architecture")
    blocks = int(value_of(r, f"{arch}.block_count") or 0)
    declared = int(value_of(r, f"{arch}.nextn_predict_layers") or 0)
    names = [t.name for t in r.tensors]
    stored_blocks = sorted({int(m.group(1)) for n in names if (m := BLOCK.match(n))})
    nextn_blocks = sorted({int(m.group(1)) for n in names if (m := NEXTN.match(n))})
    mtp_ids = list(range(blocks - declared, blocks)) if declared else nextn_blocks
    types: dict[int, Counter] = {b: Counter() for b in mtp_ids}
    params = 0
    for t in r.tensors:
        m = BLOCK.match(t.name)
        if m and int(m.group(1)) in types:
            types[int(m.group(1))][t.tensor_type.name] += 1
            params += int(t.n_elements)
    trunk = any(b < blocks - declared for b in stored_blocks) if declared else bool(stored_blocks)
    holds = ("trunk and MTP" if trunk and nextn_blocks else "MTP side file" if nextn_blocks
             else "trunk only" if trunk else "no blocks")
    findings = []
    missing = [b for b in mtp_ids if b not in nextn_blocks]
    if declared and missing:
        findings.append({"severity": "error" if not nextn_blocks else "warning", "code": "mtp_declared_missing",
                         "message": f"{arch}.nextn_predict_layers = {declared} declares MTP block(s) {missing}, "
                                    "but no blk.N.nextn.* tensor is stored for them (llama.cpp's draft-mtp would fail "
                                    "with 'model doesn't contain MTP layers')"})
    if nextn_blocks and not declared:
        findings.append({"severity": "warning", "code": "mtp_undeclared",
                         "message": f"blk.{nextn_blocks}.nextn.* stored, but {arch}.nextn_predict_layers is not set"})
    if not nextn_blocks and not declared:
        findings.append({"severity": "info", "code": "no_mtp",
                         "message": "no MTP block: recycle convert CHECKPOINT --to gguf writes a side file for it"})
    if declared > 1 and arch not in CHAINED:
        findings.append({"severity": "warning", "code": "mtp_depth_unsupported",
                         "message": f"{declared} MTP blocks declared; llama.cpp's {arch} MTP graph takes one "
                                    f"(only {', '.join(CHAINED)} draft with several in turn)"})
    worst = next((s for s in ("error", "warning", "info") if any(f["severity"] == s for f in findings)), "ok")
    return {"path": str(path), "format": "gguf", "architecture": arch, "name": value_of(r, "general.name"),
            "block_count": blocks, "holds": holds,
            "mtp": {"declared": declared, "stored": nextn_blocks, "blocks": mtp_ids, "params": params,
                    "tensor_types": {str(b): dict(c) for b, c in types.items()}},
            "vocab": len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None,
            "tensors": len(r.tensors), "bytes": Path(path).stat().st_size, "findings": findings, "worst": worst}
