"""A trained drafter written back in exactly its input's layout: same files, same key sets and dtypes.

Distillation trains the drafter module; its directory may hold more than the module's own file (an EAGLE
drafter's `nextn/` and `mtp_overlay/`, Medusa's FasterDecoding file). A format whose record declares the
"rewrite" hook has a rewriter in `REWRITERS` that rebuilds those other layouts from the trained weights, in their
stored form (block FP8 re-quantized in its blocks, DeepSeek-V4's e8m0-scaled FP8 and FP4 experts through their
codecs), or drops a layout it cannot rebuild exactly with a note rather than ship it stale. Everything
goes through the one atomic writer; `recycle.json` gets the run's record appended to its `distillation` list.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recycle.checkpoint import Checkpoint
from recycle.converters.registry import REWRITERS
from recycle.converters.roles import EXACT
from recycle.drafters.sharded import block_name, local_rows, per_expert, shifted
from recycle.errors import RecycleError
from recycle.families import BY_NAME
from recycle.formats import BENCH_REPORT
from recycle.io.weights import meta_state, weight_files
from recycle.io.writer import Lazy
from recycle.mtp.base import LEAF_ROLES, Norm
from recycle.preflight import load_json
from recycle.quant import CODECS, NATIVE_SCALE_SUFFIX, SCALE_SUFFIX, Codec, requantize, scheme

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
    tensors = _as_stored(src, layouts, planned)
    with writer as d:
        d.write_safetensors(tensors, torch.float32, metadata={"recycle_format": fmt.name, "recycle_distilled": "1",
                                                               **(metadata or {})})
        return _finish(src, d, set(tensors), dropped, notes, record)


def _as_stored(src: Path, layouts: dict, planned: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Lazy]]:
    """Each planned file's tensors in its input's names, shapes and dtypes (refused where the key sets differ)."""
    tensors: dict[str, dict[str, Lazy]] = {}
    for rel, state in planned.items():
        head = layouts.get(rel) or stored_layout(src / rel)
        if set(head) != set(state):
            missing, unknown = sorted(set(head) - set(state)), sorted(set(state) - set(head))
            raise RecycleError(f"{src / rel}: trained weights do not match the stored key set "
                               f"(missing {missing[:3]}, unexpected {unknown[:3]})")
        tensors[rel] = {k: Lazy(shp, (lambda t=state[k], d=dt: t.detach().to("cpu", d).contiguous()), (k,), EXACT,
                                dtype=dt) for k, (shp, dt) in head.items()}
    return tensors


def _finish(src: Path, d, written: set[str], dropped: list[str], notes: list[str], record: dict) -> dict[str, int]:
    """The rest of the input copied as it is (the weight files written aside), recycle.json with the run's record and
    the written files' digests. Call inside the writer's `with`."""
    prov_path = src / "recycle.json"
    prov = load_json(prov_path, "recycle.json") if prov_path.is_file() else {}
    rec = dict(record)
    if notes:
        rec["notes"] = notes
    prov.setdefault("distillation", []).append(rec)
    prov.pop("bench", None)  # bench --save's summary of bench.json, which measured the input's weights (below)
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        # bench.json measured the input's weights, not these: the card would publish it as the output's figures
        skip = rel in written or rel in ("recycle.json", BENCH_REPORT) or rel.split("/")[0] in dropped
        if skip or not p.is_file():
            continue
        d.copy_file(p, rel)
    prov["sha256"] = d.sha256()  # the files as this run wrote them (the input's digests no longer hold)
    d.write_json("recycle.json", prov)
    return dict(d.files)


# -- written from the shards: every rank its part ------------------------------------------------------------------

def _pieces(model: torch.nn.Module, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A runtime tensor (whole, or this rank's rows of one: experts renumbered from its first row) under the
    names model.safetensors stores, as `Unroller.file_state` writes them (the block in its checkpoint layout)."""
    split = block_name(name)
    if split is None:
        return {name: t}
    prefix, rel = split
    return {prefix + k: v for k, v in model.block_to_stored(int(prefix.split(".")[1]), {rel: t}).items()}


def _renumbered(pieces: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor] | None:
    """Per-expert pieces of rows [first, ...) under their global expert numbers; None when they are not per row."""
    if not per_expert(pieces):
        return None
    return {shifted(n, first): v for n, v in pieces.items()}


def _gather_to(t, owner: int, rank: int, world: int) -> torch.Tensor | None:
    """A DTensor sharded on its first dimension, gathered whole onto `owner`'s host only (the others send their rows,
    padded to the largest; None on them)."""
    local = t.to_local().detach()
    rows = local_rows(t)
    spans = [None] * world
    dist.all_gather_object(spans, rows)
    most = max(b - a for a, b in spans)
    pad = local.new_zeros((most, *local.shape[1:]))
    pad[:local.shape[0]] = local
    bins = [torch.empty_like(pad) for _ in range(world)] if rank == owner else None
    dist.gather(pad, bins, dst=owner)
    if rank != owner:
        return None
    return torch.cat([b[:e - s] for b, (s, e) in zip(bins, spans)]).cpu()


def write_drafter_sharded(src_dir: str | os.PathLike, writer, fmt, model: torch.nn.Module, record: dict,
                          rank: int, world: int, metadata: dict[str, str] | None = None) -> dict[str, int] | None:
    """`write_drafter` from a sharded drafter (FSDP2, split experts), a collective: no whole drafter on any host and
    no whole tensor on any device. The files are the one-process writer's, header and order alike: rank 0 writes
    every file's header and sizes the file, then each rank writes its own tensors at their offsets. A rank's own
    tensors: the per-expert tensors of its experts (no gather), and those assigned to it by bytes among the rest,
    each gathered onto its host alone (`dist.gather`); the `nextn/` and `mtp_overlay/` copies of a weight are
    written by the rank that holds it. Rank 0's `writer` holds the output; returns its files (rank 0) or None."""
    src = Path(src_dir)
    layouts = {p.relative_to(src).as_posix(): stored_layout(p) for p in weight_files(src, WEIGHTS)}
    head = {k: v for layout in layouts.values() for k, v in layout.items()}
    spelling = fmt.spelling(set(head))
    if callable(getattr(model, "reshard", None)):  # FSDP2's root unit stays gathered after a forward: its shards
        model.reshard()
    state = model.state_dict()
    # what this rank writes: its experts' pieces, plain tensors and gathered ones assigned to it by bytes
    load = [0] * world
    mine: dict[str, torch.Tensor] = {}
    gathered: list[tuple[str, torch.Tensor, int]] = []
    for name, t in state.items():
        if isinstance(t, DTensor):
            start, _ = local_rows(t)
            probe = torch.empty((1, *t.shape[1:]), device="meta")
            if _renumbered(_pieces(model, name, probe), 0) is not None:  # per-expert: each rank its own experts
                local = _renumbered(_pieces(model, name, t.to_local().detach()), start) or {}
                mine.update(local)
                sizes = [0] * world
                dist.all_gather_object(sizes, sum(v.numel() * v.element_size() for v in local.values()))
                load = [a + b for a, b in zip(load, sizes)]
                continue
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += t.numel() * t.element_size()
        gathered.append((name, t, owner))
    for name, t, owner in gathered:  # the same order on every rank: the gathers match
        whole = _gather_to(t, owner, rank, world) if isinstance(t, DTensor) else (t.detach() if rank == owner else None)
        if whole is not None:
            mine.update(_pieces(model, name, whole))
    mine = fmt.disk_names(mine, spelling)
    names = [None] * world
    dist.all_gather_object(names, sorted(mine))
    every = [n for part in names for n in part]
    if sorted(every) != sorted(head):  # every rank sees the same lists: all refuse together
        missing, unknown = sorted(set(head) - set(every)), sorted(set(every) - set(head))
        raise RecycleError(f"{src / WEIGHTS}: trained weights do not match the stored key set "
                           f"(missing {missing[:3]}, unexpected {unknown[:3]})")
    plans = {rel: [(k, shp, dt) for k, (shp, dt) in layout.items()] for rel, layout in layouts.items()}
    makers = {(rel, k): (k, None) for rel, layout in layouts.items() for k in layout}
    # a runtime drafter's other layouts (DeepSeek-V4's overlay, in FP8 and FP4 storage) are its one-process
    # rewriter's, run on rank 0 once the ranks' files are written (`_rebuilt_whole`)
    whole = model.family.run.runtime is not None and "rewrite" in fmt.hooks
    extra, extra_makers, dropped, notes = ({}, {}, [], []) if whole else _extra_layouts(src, model, fmt, spelling)
    plans.update(extra)
    makers.update(extra_makers)
    meta = {"recycle_format": fmt.name, "recycle_distilled": "1", **(metadata or {})}
    with writer if rank == 0 else contextlib.nullcontext():
        box = [str(writer.tmp) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank != 0:  # the other ranks write into rank 0's temporary directory (its lock holds the output)
            writer.tmp, writer.files = Path(box[0]), {}
        else:
            for rel, plan in plans.items():
                writer.create_safetensors(rel, plan, meta)
        dist.barrier()  # every file is there, at its full size
        for rel, plan in plans.items():
            own = {}
            for k, shp, dt in plan:
                stored, how = makers[(rel, k)]
                if stored in mine:
                    own[k] = Lazy(shp, (lambda t=mine[stored], f=how: (f(t) if f else t).detach().to("cpu")), (k,),
                                  EXACT, dtype=dt)
            writer.write_safetensors_part(rel, plan, own, meta)
        mine.clear()
        dist.barrier()  # every rank's tensors are written
        if rank != 0:
            return None
        written = set(plans)
        if whole:
            others, dropped, notes = _rebuilt_whole(src, writer, plans, model, fmt)
            writer.write_safetensors(_as_stored(src, {}, others), torch.float32, metadata=meta)
            written |= set(others)
        return _finish(src, writer, written, dropped, notes, record)


def _rebuilt_whole(src: Path, writer, plans: dict, model: torch.nn.Module, fmt) -> tuple[dict, list[str], list[str]]:
    """A runtime drafter's other layouts from its format's one-process rewriter, on rank 0: the drafter is built whole
    once, in float32 as the one-process trainer holds it, from the trained weights as the ranks just wrote them, so
    FP8 and FP4 storage are rebuilt by the same code as in one process. Host memory on rank 0: the drafter in float32
    while the written weights are read into it (a V4-Pro module: 103 GB and 52 GB at bf16), then the float32 one."""
    from safetensors.torch import load_file

    from recycle.drafters.registry import RUNTIME_BUILDERS

    state: dict[str, torch.Tensor] = {}
    for rel in plans:
        state.update(load_file(str(writer.tmp / rel)))
    config = load_json(src / "config.json", "drafter config.json")
    drafter = RUNTIME_BUILDERS.get(model.family.run.runtime)(src, config, state)
    state.clear()
    return REWRITERS.get(fmt.name, fmt.title)(src, {}, drafter)



def canonical_concat(src: Path) -> bool:
    """Whether an EAGLE drafter's family stores the [e; h] concatenation canonically, so its `nextn/` and
    `mtp_overlay/` tensors can be rebuilt from the trained weights (zero-centred norms are stored back as the family
    stores them; a [h; e] concat is not)."""
    rc = load_json(src / "config.json", "drafter config.json").get("recycle", {})
    fam = BY_NAME.get(rc.get("family", ""))
    return fam is not None and fam.run.concat_order == "eh"


@dataclass(frozen=True)
class OverlayLayout:
    """One extra layout of an EAGLE drafter (`nextn/` or `mtp_overlay/`) as stored: its files' headers, every
    shard's tensors together (a scale may sit apart from its weight), and its block-FP8 scheme where it has one."""

    sub: str
    base: int  # the layer its module 0 is numbered from
    parts: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]
    head: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fp8: object | None
    # stored part → (its logical weight, the storage codec that packs it): DeepSeek-V4's FP4 experts (`mxfp4_native`)
    packed: dict[str, tuple[str, str]] = field(default_factory=dict)
    quant: dict = field(default_factory=dict)  # the layout's quantization_config (block sizes, scale format)

    def rebuilt_as(self, k: str, shape: tuple[int, ...] | None, canonical: bool) -> str:
        """How tensor `k` is rebuilt from a trained weight of `shape` (None: no trained weight is it): "scale" (made
        with its FP8 weight), "fp8" (re-quantized in the layout's blocks), "fp8_native" (the same with DeepSeek-V4's
        e8m0 `.scale`: power-of-two scales), "codec" (a packed part, written by its storage codec with the rest of its
        weight), "plain", or why it cannot be."""
        shp, dt = self.head[k]
        if k in self.packed:
            codec = self.packed[k][1]
            return "codec" if type(CODECS.get(codec)).quantize is not Codec.quantize else \
                f"{k}: recycle does not write the {codec} storage"
        weight = k[: -len(SCALE_SUFFIX)] if k.endswith(SCALE_SUFFIX) else \
            k[: -len(NATIVE_SCALE_SUFFIX)] + ".weight" if k.endswith(NATIVE_SCALE_SUFFIX) else None
        if weight is not None and weight in self.head and self.head[weight][1].itemsize == 1:
            return "scale"
        native = k.endswith(".weight") and self.head.get(k[: -len(".weight")] + NATIVE_SCALE_SUFFIX, ((), None))[1] \
            == torch.float8_e8m0fnu
        if dt.itemsize == 1 and dt.is_floating_point and native and shape is not None and tuple(shape) == tuple(shp):
            return "fp8_native"
        if shape is None or tuple(shape) != tuple(shp) or not dt.is_floating_point:
            return "non-canonical concat" if not canonical else f"{k} is not a trained weight"
        if dt.itemsize == 1:
            return "fp8" if self.fp8 is not None and k + SCALE_SUFFIX in self.head else "FP8 without a block-FP8 config"
        return "plain"

    def dropped(self, why: str) -> str:
        return f"{self.sub}/ dropped: its tensors cannot be rebuilt exactly from the trained weights ({why})"


def overlay_layouts(src: Path) -> list[OverlayLayout]:
    """The extra layouts an EAGLE drafter directory holds (`nextn/`, `mtp_overlay/`), read from their headers."""
    rc = load_json(src / "config.json", "drafter config.json").get("recycle", {})
    out = []
    for sub, base in (("nextn", 0), ("mtp_overlay", int(rc.get("source_num_hidden_layers", 0)))):
        parts = {p.name: stored_layout(p) for p in sorted((src / sub).glob("*.safetensors"))} \
            if (src / sub).is_dir() else {}
        if not parts:
            continue
        config = load_json(src / sub / "config.json", f"{sub}/config.json")
        try:
            fp8 = scheme(config, f"{src / sub}")
        except RecycleError:
            fp8 = None
        packed = {}
        if fp8 is not None or config.get("quantization_config"):  # the codecs' groups, from the headers alone
            ck = Checkpoint(src / sub)
            packed = {part: (logical, p.codec) for logical, p in ck.packed.items() for part in p.parts.values()}
        out.append(OverlayLayout(sub, base, parts, {k: v for part in parts.values() for k, v in part.items()}, fp8,
                                 packed, dict(config.get("quantization_config") or {})))
    return out

def _overlay_sources(model: torch.nn.Module, base: int) -> dict[str, tuple[str, bool]]:
    """The names `MTP.checkpoint_tensors(num_hidden_layers=base)` gives each weight (what an EAGLE drafter's `nextn/`
    and `mtp_overlay/` store), each with the module name of the weight it copies and whether it is stored
    zero-centred (`w - 1`); a block's names are model.safetensors' (the drafter's `block_to_stored`)."""
    fam = model.family
    stored_norm = BY_NAME[fam.name].run.norm if fam.name in BY_NAME else fam.run.norm
    out: dict[str, tuple[str, bool]] = {}
    for k, layer in enumerate(model.layers):
        ctx = {"k": k, "layer": base + k, "first": k, "last": k}
        for role in LEAF_ROLES:
            module, name = getattr(layer, role), f"layers.{k}.{role}.weight"
            if module is None and role in fam.layout.stores_copies:
                module, name = model._shared.get(role), f"{role}.weight"
            if module is None or role not in fam.layout.roles:
                continue
            out[fam.layout.roles[role][0].format(**ctx)] = (name, isinstance(module, Norm) and module.style == "w"
                                                     and stored_norm == "1+w")
        prefix = fam.layout.block[0].format(s=k, **ctx)
        for n, t in layer.block.state_dict().items():
            there = model.block_to_stored(k, {n: torch.empty(tuple(t.shape), device="meta")})
            out.update({prefix + rel: (f"layers.{k}.block.{rel}", False) for rel in there})
    return out


def _extra_layouts(src: Path, model: torch.nn.Module, fmt, spelling: str | None
                   ) -> tuple[dict[str, list], dict[tuple[str, str], tuple[str, object]], list[str], list[str]]:
    """An EAGLE drafter's `nextn/` and `mtp_overlay/` as the one-process rewriter writes them (`converters/eagle.py`):
    per file, its tensors' (name, shape, dtype) in the stored order, and per tensor the model.safetensors name of the
    weight it is made from with how (None: as it is; zero-centred; FP8 requantized in the stored blocks, weight or
    scale); the layouts dropped, with their notes, where the rewriter would drop them."""
    if "rewrite" not in fmt.hooks or fmt.name != "eagle":
        return {}, {}, [], []
    canonical = canonical_concat(src)
    plans: dict[str, list] = {}
    makers: dict[tuple[str, str], tuple[str, object]] = {}
    dropped, notes = [], []

    def disk(module_name: str) -> str:
        return next(iter(fmt.disk_names({module_name: None}, spelling)))

    def minus(t: torch.Tensor) -> torch.Tensor:
        return t.float() - 1.0

    for lay in overlay_layouts(src):
        sources = _overlay_sources(model, lay.base) if canonical else {}
        out, why = {}, None
        for k in lay.head:
            source = sources.get(k)
            how = lay.rebuilt_as(k, _source_shape(model, source[0]) if source else None, canonical)
            if how == "fp8":
                first = minus if source[1] else None
                out[k] = (disk(source[0]), lambda t, b=lay.fp8.block, f=first: requantize(f(t) if f else t, b)[0])
                out[k + SCALE_SUFFIX] = (disk(source[0]),
                                         lambda t, b=lay.fp8.block, f=first: requantize(f(t) if f else t, b)[1])
            elif how == "plain":
                out[k] = (disk(source[0]), minus if source[1] else None)
            elif how != "scale":
                why = how
        if why is None:
            for name, part in lay.parts.items():
                rel = f"{lay.sub}/{name}"
                plans[rel] = [(k, shp, dt) for k, (shp, dt) in part.items()]
                makers.update({(rel, k): out[k] for k in part})
        else:
            dropped.append(lay.sub)
            notes.append(lay.dropped(why))
    return plans, makers, dropped, notes


def _source_shape(model: torch.nn.Module, module_name: str) -> tuple[int, ...]:
    """The shape model.safetensors stores `module_name` in (a block tensor in its checkpoint layout)."""
    split = block_name(module_name)
    if split is None:
        return tuple(model.get_parameter(module_name).shape)
    prefix, rel = split
    for n, t in model.get_submodule(prefix[:-1]).state_dict().items():
        got = model.block_to_stored(int(prefix.split(".")[1]), {n: torch.empty(tuple(t.shape), device="meta")})
        if rel in got:
            return tuple(got[rel].shape)
    return ()
