"""Role-keyed MTP weights in one canonical form: the single place converters read a checkpoint.

Every converter starts from the same picture of module k, whatever the family stored:
  proj        [H, 2H] with columns in [e; h] order (MiMo's [h; e] halves are swapped here),
  norms       as the plain `w` of `w·x̂` (zero-centred `(1+w)` families get 1 + w, computed in fp32),
  head/embed  the module's own copy, or the trunk's tensor when the module stores none,
  block       the decoder block's tensors in checkpoint layout, FP8 dequantized block-wise.
Tensors are *lazy*: a `Lazy` knows its shape and where it comes from and reads (and checks for
NaN/Inf) only when the writer asks, so a converter stays a pure function from these weights to a
plan of (name → Lazy, config) and nothing is held in memory longer than one tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from recycle.checkpoint import DTYPES, Checkpoint
from recycle.errors import RecycleError
from recycle.families import Family, MTPMatch, MTPModule, eval_shape, first_value, match, merged_config
from recycle.fused import scale_chunks, spec_of, split
from recycle.io.writer import Lazy
from recycle.quant import SCALE_SUFFIX

EXACT, APPROX, FRESH = "exact", "approx", "fresh"
LEAF_SHAPES = {"embed_norm": ("H",), "hidden_norm": ("H",), "proj": ("H", "2H"), "final_norm": ("H",),
               "head": ("V", "H"), "embed": ("V", "H")}
# Roles a module must fill, by family kind: sequential MTP modules read an embedding and a hidden state
# through their own norms and projection; parallel heads read the
# trunk state alone; an assistant (Gemma 4) reads both through its pre-projection, into a narrower width.
REQUIRED = {"mtp": ("embed_norm", "hidden_norm", "proj", "head", "embed"), "parallel_heads": ("head", "embed"),
            "drafter": ("proj", "head", "embed")}
FINITE_CHUNK = 1 << 24  # elements per NaN/Inf check slice (a bool mask of a 129k×7k head would be 0.9 GB)
NONFINITE_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # |bits| ≥ this: exponent all ones, Inf or NaN
BITS_CHUNK = 1 << 18  # elements per 16-bit check slice: its integer copy stays in cache (4× faster than 1 << 24)


def check_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """RecycleError on NaN/Inf, scanned in slices so the check never doubles memory."""
    if t.is_floating_point():
        flat = t.reshape(-1)
        step = BITS_CHUNK if t.dtype in NONFINITE_BITS else FINITE_CHUNK
        for start in range(0, flat.numel(), step):
            if not _finite(flat[start:start + step]):
                raise RecycleError(f"{what} holds NaN or Inf values; refusing to convert corrupt weights")
    return t


def _finite(chunk: torch.Tensor) -> bool:
    """Whether a 1-D slice holds no NaN/Inf, by the cheapest exact test for its dtype."""
    limit = NONFINITE_BITS.get(chunk.dtype)
    if limit is not None:  # 16-bit floats: an integer and + max, 8× faster than a float32 sum
        return bool(torch.bitwise_and(chunk.view(torch.int16), 0x7FFF).max() < limit)
    # A float32 sum is one pass with no mask; NaN/Inf make it non-finite, and so can overflow of
    # huge finite values, so confirm with the mask.
    return bool(torch.isfinite(chunk.sum(dtype=torch.float32)) or torch.isfinite(chunk).all())


def stored(ckpt: Checkpoint, name: str, kind: str = EXACT, note: str = "", row_chunks: int = 1) -> Lazy:
    """A checkpoint tensor's values, checked for NaN/Inf when read: as stored, or a quantized one dequantized into
    float32 (`row_chunks`: a pre-sharded fused tensor's, `recycle.fused`), so that the writer rounds it once into
    the output's dtype (an fp32 output holds the dequantized values exactly, as llama.cpp's converter writes them)."""
    info = ckpt.tensors[name]
    dtype = torch.float32 if info.quantized or info.is_fp8 else None
    return Lazy(info.shape, lambda: check_finite(ckpt.get(name, dtype, row_chunks), f"{ckpt.path}: {name}"),
                (name,), kind, note, reads=ckpt.spans(name))


def raw(ckpt: Checkpoint, name: str) -> Lazy:
    """A stored tensor byte for byte in its stored dtype (FP8 stays FP8, scales included; a stored name, so a
    packed weight's parts are copied one by one)."""
    info = ckpt.stored.get(name)
    if info is None:
        raise RecycleError(f"{ckpt.path}: {name} is packed in {len(ckpt.packed[name].parts)} stored tensors "
                           f"({ckpt.packed[name].codec}), not one whose bytes can be copied" if name in ckpt.packed
                           else f"{ckpt.path}: no tensor named {name}")
    dtype = DTYPES[info.dtype][1]
    if dtype is None:
        raise RecycleError(f"{ckpt.path}: tensor {name} has dtype {info.dtype}, which torch cannot read")
    return Lazy(info.shape, lambda: ckpt.raw(name), (name,), EXACT, "stored bytes", dtype=dtype, raw=True,
                reads=(ckpt.span(name),))


@dataclass
class ModuleWeights:
    """Module k in canonical form."""

    index: int
    prefix: str
    leaves: dict[str, Lazy]  # embed_norm, hidden_norm, proj, head, embed, and final_norm when the family has one
    block: dict[str, Lazy]  # checkpoint-layout names relative to the block prefix
    module: MTPModule
    stored_leaves: dict[str, Lazy] = field(default_factory=dict)  # the same roles before canonicalisation


@dataclass
class RoleWeights:
    """Everything a converter may read from one checkpoint."""

    ckpt: Checkpoint
    match: MTPMatch
    modules: list[ModuleWeights]
    hidden_size: int
    vocab_size: int
    eps: float
    notes: list[str] = field(default_factory=list)

    @property
    def family(self) -> Family:
        return self.match.family

    @property
    def config(self) -> dict:
        return self.match.config

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config.get("num_hidden_layers") or 0)


def _canonical_norm(lazy: Lazy, style: str) -> Lazy:
    if style == "w":
        return lazy
    return lazy.derive(lazy.shape, lambda w: 1.0 + w.float(), note="stored zero-centred (1+w): written as 1 + w")


def _canonical_proj(lazy: Lazy, order: str, h: int) -> Lazy:
    if order == "eh":
        return lazy
    return lazy.derive(lazy.shape, lambda w: torch.cat([w[:, h:], w[:, :h]], dim=1),
                       note="stored [h; e]: halves swapped to [e; h]")


def _trunk_normed(embed: Lazy, norm: Lazy, style: str, eps: float) -> Lazy:
    """The embedding through the trunk's own norm (row by row, as a lookup then the norm computes it)."""
    def run(e: torch.Tensor) -> torch.Tensor:
        w = norm.make().float()
        e = e.float()
        e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps)
        return e * (1.0 + w) if style == "1+w" else e * w
    return embed.derive(embed.shape, run, kind=APPROX, note=f"the trunk's embedding norm ({norm.sources[0]}) folded in")


def _divided(head: Lazy, divisor: float, key: str) -> Lazy:
    return head.derive(head.shape, lambda w: w.float() / divisor, kind=APPROX,
                       note=f"divided by {key} {divisor:g} (the head reads h / {divisor:g})")


def gather(ckpt: Checkpoint, family: str | None = None) -> RoleWeights:
    """Match the checkpoint against the family table and describe its MTP modules canonically.

    Raises RecycleError for layouts recycle cannot convert: no family fits, no module stored
    (MiniMax declares modules its releases do not ship), a non-sequential kind, missing roles or
    shapes that disagree with config.json.
    """
    m = match(ckpt, family)
    fam = m.family
    if not m.modules:
        declared = f"declares {m.declared} ({', '.join(fam.keys.depth_keys) or 'config'})" if m.declared else "declares none"
        raise RecycleError(f"{ckpt.path}: stores no MTP module ({fam.title} layout; config {declared}); "
                           "there is nothing to convert")
    if fam.kind not in REQUIRED:
        raise RecycleError(f"{ckpt.path}: family '{fam.name}' is {fam.kind}, neither sequential MTP modules nor "
                           "parallel heads; there is nothing recycle convert can map")
    required = runtime_roles(fam) or REQUIRED[fam.kind]
    unmapped = [r for r in required if r not in fam.layout.roles and r not in fam.layout.trunk]
    if unmapped:
        raise RecycleError(f"{ckpt.path}: the {fam.name} MTP layout has no {', '.join(unmapped)} role (it stores "
                           f"{', '.join(sorted(fam.layout.roles))}): no drafter format recycle writes carries it yet; "
                           "its MTP runs as it is (recycle.mtp)")
    if fam.kind == "parallel_heads" and len(m.modules) < m.declared:
        raise RecycleError(f"{ckpt.path}: config declares {m.declared} extra head(s) ({', '.join(fam.keys.depth_keys)}), "
                           f"{len(m.modules)} stored: a parallel-heads checkpoint missing a head is incomplete")
    h = first_value(m.config, fam.keys.hidden_keys)
    v = first_value(m.config, fam.keys.vocab_keys)
    if not isinstance(h, int) or not isinstance(v, int):
        raise RecycleError(f"{ckpt.path}: config.json lacks hidden_size/vocab_size")
    dims = {**m.dims(), "H": h, "2H": 2 * h, "V": v}
    if "Hb" in dims:
        dims["2Hb"] = 2 * dims["Hb"]
    eps = float(m.config.get("rms_norm_eps") or m.config.get("layer_norm_epsilon") or 1e-6)
    rows = first_value(m.config, (fam.run.logit_rows_key,)) if fam.run.logit_rows_key else None
    if isinstance(rows, int) and 0 < rows < v:
        raise RecycleError(f"{ckpt.path}: its head is padded to vocab_size {v} ({fam.run.logit_rows_key} {rows} real "
                           "tokens) and no drafter format carries the real row count: recycle cannot write an exact "
                           "head for it (its MTP runs as it is: recycle bench/distill)")
    trunk_norm = next((m.outer_prefix + n for n in fam.run.embed_trunk_norm if m.outer_prefix + n in ckpt.tensors), None)
    divisor = first_value(m.config, (fam.run.logit_divisor_key,)) if fam.run.logit_divisor_key else None
    modules = []
    cache: dict[tuple[str, str], Lazy] = {}  # one Lazy per (source tensor, form): shared tensors are read once

    def once(name: str, form: str, build: Callable[[], Lazy]) -> Lazy:
        if (name, form) not in cache:
            cache[(name, form)] = build()
        return cache[(name, form)]

    for mod in m.modules:
        missing = [r for r in required if mod.tensor(r) is None]
        if missing:
            raise RecycleError(f"{ckpt.path}: MTP module {mod.index} has no tensor for {', '.join(missing)}")
        leaves: dict[str, Lazy] = {}
        plain: dict[str, Lazy] = {}
        for role in dict.fromkeys((*LEAF_SHAPES, *required)):  # a runtime row's own roles too (V4's e_proj, ...)
            name = mod.tensor(role)
            if name is None:
                continue
            want = eval_shape(fam.layout.shapes.get(role) or LEAF_SHAPES[role], dims)
            got = ckpt.tensors[name].shape
            if got != want:
                raise RecycleError(f"{ckpt.path}: {name} ({role}) has shape {list(got)}, config.json implies {list(want)}")
            src = once(name, "stored", partial(stored, ckpt, name))
            plain[role] = src
            if role.endswith("norm"):
                leaves[role] = once(name, "norm", partial(_canonical_norm, src, fam.run.norm))
            elif role == "proj":
                leaves[role] = once(name, "proj", partial(_canonical_proj, src, fam.run.concat_order, h))
            elif role == "embed" and trunk_norm is not None:
                norm = stored(ckpt, trunk_norm)
                leaves[role] = once(name, "embed", partial(_trunk_normed, src, norm, fam.run.norm, eps))
            elif role == "head" and divisor is not None:
                leaves[role] = once(name, "head", partial(_divided, src, float(divisor), fam.run.logit_divisor_key))
            else:
                leaves[role] = src
        block = {rel: once(full, "stored", partial(stored, ckpt, full,
                                                   row_chunks=scale_chunks(rel, fam.layout.fused, m.config)))
                 for rel, full in mod.block_names().items() if not rel.endswith(SCALE_SUFFIX)}
        if not block:
            raise RecycleError(f"{ckpt.path}: MTP module {mod.index} stores no decoder block under {mod.prefix}")
        modules.append(ModuleWeights(mod.index, mod.prefix, leaves, block, mod, plain))
    _check_blocks(ckpt, m, modules)
    return RoleWeights(ckpt, m, modules, h, v, eps)


def _check_blocks(ckpt: Checkpoint, m: MTPMatch, modules: list[ModuleWeights]) -> None:
    """Each module's block tensors are exactly its decoder layer's parameters, names and shapes, as the runtime loads
    them (built on the meta device: no memory): a layout read under the wrong row (a config naming a row whose
    templates its tensors also fit) is refused here, in one line, instead of becoming a drafter no engine runs right."""
    fam = m.family
    if fam.kind != "mtp" or fam.run.block_class is None or fam.run.runtime is not None:
        return
    from recycle.mtp import MTP, family_config, misfit, to_runtime_layout

    try:
        config = family_config(m.config, fam)
        with torch.device("meta"):
            model = MTP(config, fam, len(modules))
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise RecycleError(f"{ckpt.path}: cannot build {fam.run.block_class} from this config "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for mw, layer in zip(modules, model.layers):
        if fam.layout.fused:  # q/k/v stored as one pre-sharded tensor: the parts the layer holds, read from it lazily
            try:
                mw.block = _split_lazily(mw.block, fam, m.config, layer.block.state_dict())
            except RecycleError as e:
                raise RecycleError(f"{ckpt.path}: {mw.prefix}{e}") from None
        stored_ = {rel: torch.empty(lazy.shape, device="meta") for rel, lazy in mw.block.items()}
        why = misfit(to_runtime_layout(stored_, model.config, fam.run.block_renames, fam.run.block_conversions),
                     layer.block.state_dict())
        if why is not None:
            raise RecycleError(f"{ckpt.path}: MTP module {mw.index}'s block does not fit {fam.run.block_class} (the "
                               f"{fam.name} row): {why}")


def _split_lazily(block: dict[str, Lazy], fam: Family, config: dict, own: dict[str, torch.Tensor]) -> dict[str, Lazy]:
    """A block's fused tensors as the parts its decoder layer holds (`recycle.fused.split`, sized by the layer's own
    parameters `own`), each a Lazy over the stored tensor; a tensor the cut does not fit is refused in one line now."""
    from recycle.mtp import part_rows

    rows_of = part_rows(own, fam.run.block_renames)
    out: dict[str, Lazy] = {}
    for rel, lazy in block.items():
        if spec_of(rel, fam.layout.fused) is None:
            out[rel] = lazy
            continue
        parts = split({rel: torch.empty(lazy.shape, device="meta")}, fam.layout.fused, config, rows_of)
        for part, meta in parts.items():
            out[part] = lazy.derive(tuple(meta.shape), lambda w, rel=rel, part=part: split(
                {rel: w}, fam.layout.fused, config, rows_of)[part], note=f"its share of the stored {rel}")
    return out


@dataclass
class Backbone:
    """What a converter needs of the model a narrower drafter (a Gemma 4 assistant) drafts for: its width,
    depth, final norm and LM head, read lazily from `--target` (the assistant stores none of them)."""

    path: Path
    hidden_size: int
    num_layers: int
    final_norm: Lazy
    head: Lazy
    embed: Lazy  # the input embedding, as stored (Gemma scales it by sqrt(hidden_size) when it runs)
    ckpt: Checkpoint
    config: dict  # the text model's config (merged)
    prefix: str  # where the text model's tensors live ("model.", "model.language_model.")

    def tensor(self, name: str) -> Lazy:
        """A tensor of the text model by its name under `prefix`; RecycleError when absent."""
        full = f"{self.prefix}{name}"
        if full not in self.ckpt.tensors:
            raise RecycleError(f"{self.path}: no tensor {full}")
        return stored(self.ckpt, full)


TEXT_PREFIXES = ("model.language_model.", "model.", "")  # multimodal wrapper, causal LM, bare model


def backbone(path: str | os.PathLike) -> Backbone:
    """The target's final norm and head (its tied embedding when it stores no lm_head), by transformers' names."""
    ckpt = Checkpoint(path)
    cfg = merged_config(ckpt.config)
    h, n = cfg.get("hidden_size"), cfg.get("num_hidden_layers")
    if not isinstance(h, int) or not isinstance(n, int):
        raise RecycleError(f"{ckpt.path}/config.json: no hidden_size/num_hidden_layers for the target")
    for prefix in TEXT_PREFIXES:
        norm = f"{prefix}norm.weight"
        embed = f"{prefix}embed_tokens.weight"
        if norm in ckpt.tensors and embed in ckpt.tensors:
            head = "lm_head.weight" if "lm_head.weight" in ckpt.tensors else embed
            return Backbone(ckpt.path, h, n, stored(ckpt, norm), stored(ckpt, head), stored(ckpt, embed), ckpt, cfg,
                            prefix)
    raise RecycleError(f"{ckpt.path}: no final norm and LM head under transformers' names (model.norm.weight, "
                       "model.embed_tokens.weight, and lm_head.weight unless tied)")


def same_values(ckpt: Checkpoint, a: str, b: str) -> bool:
    """Whether two stored tensors hold equal values, compared in row chunks (heads are large)."""
    if a == b:
        return True
    ia, ib = ckpt.tensors[a], ckpt.tensors[b]
    if ia.shape != ib.shape:
        return False
    return all(torch.equal(x, y) for x, y in zip(ckpt.iter_chunks(a), ckpt.iter_chunks(b)))


def block_norm(weights: RoleWeights, lazy: Lazy) -> Lazy:
    """A norm weight from inside the block, in plain-`w` form (for formats with their own layers)."""
    return _canonical_norm(lazy, weights.family.run.norm)


@dataclass
class Plan:
    """What a converter returns: tensors per output file, JSON files, and the mapping it documents."""

    tensors: dict[str, dict[str, Lazy]]  # relative file -> tensor name -> Lazy
    jsons: dict[str, dict]  # relative file -> object (config.json, index files)
    tokenizer_dirs: tuple[str, ...] = ("",)  # subfolders that get the source's tokenizer files
    notes: list[str] = field(default_factory=list)
    layouts: tuple[str, ...] = ()  # the layouts chosen among a format's several (`--layouts`); () where it has one
    gguf: dict[str, object] = field(default_factory=dict)  # relative .gguf file -> its header (converters.gguf.Header)


def runtime_roles(fam: Family) -> tuple[str, ...]:
    """The roles a module of a family with a runtime of its own fills (every role its row names, then the trunk's
    embedding and head: DeepSeek-V4's e_proj, h_proj, hc_head_*), or () for the common layout."""
    if fam.run.runtime is None:
        return ()
    return (*fam.layout.roles, "head", "embed")


def require_sequential(w: RoleWeights, to: str) -> None:
    """Formats built on the MTP block itself (EAGLE, EAGLE-3) need sequential modules with an embedding input; a
    family whose modules run on a runtime of their own (DeepSeek-V4's streams) only as themselves (`--to eagle`)."""
    if w.family.run.runtime is not None and to != "eagle" and not (to == "gguf" and w.family.exports.gguf):
        raise RecycleError(f"{w.ckpt.path}: the {w.family.name} modules run on their own runtime (recycle.mtp."
                           f"{w.family.run.runtime}); of recycle's formats only --to eagle carries them"
                           f"{' (and --to gguf, to llama.cpp)' if w.family.exports.gguf else ''}")
    if w.family.exports.mtp_block:
        return
    if w.family.exports.reads_target:
        raise RecycleError(f"{w.ckpt.path}: a {w.family.title} has no MTP block for --to {to}; use --to eagle3 "
                           "or --to medusa")
    raise RecycleError(f"{w.ckpt.path}: family '{w.family.name}' holds {w.family.kind.replace('_', ' ')}, not "
                       f"sequential MTP modules: there is no embedding input for --to {to}; use --to medusa")


def zeros(shape: tuple[int, ...], note: str) -> Lazy:
    """A fresh all-zero tensor (identity-preserving initialisations)."""
    return Lazy(tuple(shape), lambda: torch.zeros(shape), (), FRESH, note)


def ones(shape: tuple[int, ...], note: str) -> Lazy:
    return Lazy(tuple(shape), lambda: torch.ones(shape), (), FRESH, note)


def normal(shape: tuple[int, ...], seed: int, note: str, std: float = 0.02) -> Lazy:
    """A fresh N(0, std²) tensor, deterministic per seed."""
    return Lazy(tuple(shape), lambda: torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std,
                (), FRESH, note)
