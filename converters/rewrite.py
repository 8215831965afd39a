"""A trained drafter written back in exactly its input's layout: same files, same key sets and dtypes.

Distillation trains the drafter module; its directory may hold more than the module's own file (an EAGLE
drafter's `nextn/` and `mtp_overlay/`, Medusa's FasterDecoding file). A format whose record declares the
"rewrite" hook has a rewriter in `REWRITERS` that rebuilds those other layouts from the trained weights, or drops
a layout it cannot rebuild exactly (FP8 overlay tensors, say) with a note rather than ship it stale. Everything
goes through the one atomic writer; `recycle.json` gets the run's record appended to its `distillation` list.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recycle.converters.registry import REWRITERS
from recycle.converters.roles import EXACT
from recycle.errors import RecycleError
from recycle.formats import BENCH_REPORT
from recycle.io.weights import meta_state, weight_files
from recycle.io.writer import Lazy
from recycle.preflight import load_json

WEIGHTS = "model.safetensors"


def stored_layout(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name → (shape, torch dtype) of one safetensors file, from its header alone (not its directory's others)."""
    return {name: (tuple(t.shape), t.dtype) for name, t in meta_state(path).items()}


def write_drafter(src_dir: str | os.PathLike, writer, fmt, main: dict[str, torch.Tensor], model: torch.nn.Module,
                  record: dict, metadata: dict[str, str] | None = None) -> dict[str, int]:
    """`main`: the trained weights under model.safetensors' names; `fmt`: the drafter's DrafterFormat."""
    src = Path(src_dir)
    # the input's own files for its weights (one, or its shards: --max-shard-size as convert chose it), each header
    # read once; the trained weights go back into the files that held them
    layouts = {p.relative_to(src).as_posix(): stored_layout(p) for p in weight_files(src, WEIGHTS)}
    stored = {k for layout in layouts.values() for k in layout}
    main = fmt.disk_names(main, fmt.spelling(stored))  # the file's own spelling of the names
    if set(main) - stored:
        raise RecycleError(f"{src / WEIGHTS}: trained weights do not match the stored key set "
                           f"(unexpected {sorted(set(main) - stored)[:3]})")
    planned = {rel: {k: main[k] for k in layout if k in main} for rel, layout in layouts.items()}
    dropped: list[str] = []
    notes: list[str] = []
    if "rewrite" in fmt.hooks:
        extra, dropped, notes = REWRITERS.get(fmt.name, fmt.title)(src, main, model)
        planned.update(extra)  # already by the files (shards) that hold them
    tensors: dict[str, dict[str, Lazy]] = {}
    for rel, state in planned.items():
        head = layouts.get(rel) or stored_layout(src / rel)
        if set(head) != set(state):
            missing, unknown = sorted(set(head) - set(state)), sorted(set(state) - set(head))
            raise RecycleError(f"{src / rel}: trained weights do not match the stored key set "
                               f"(missing {missing[:3]}, unexpected {unknown[:3]})")
        tensors[rel] = {k: Lazy(shp, (lambda t=state[k], d=dt: t.detach().to("cpu", d).contiguous()), (k,), EXACT,
                                dtype=dt) for k, (shp, dt) in head.items()}
    prov_path = src / "recycle.json"
    prov = load_json(prov_path, "recycle.json") if prov_path.is_file() else {}
    rec = dict(record)
    if notes:
        rec["notes"] = notes
    prov.setdefault("distillation", []).append(rec)
    with writer as d:
        d.write_safetensors(tensors, torch.float32, metadata={"recycle_format": fmt.name, "recycle_distilled": "1",
                                                               **(metadata or {})})
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src).as_posix()
            # bench.json measured the input's weights, not these: the card would publish it as the output's figures
            skip = rel in tensors or rel in ("recycle.json", BENCH_REPORT) or rel.split("/")[0] in dropped
            if skip or not p.is_file():
                continue
            d.copy_file(p, rel)
        prov["sha256"] = d.sha256()  # the files as this run wrote them (the input's digests no longer hold)
        d.write_json("recycle.json", prov)
        return dict(d.files)
