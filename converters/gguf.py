"""`recycle convert SOURCE --to gguf`: an MTP-only GGUF side file that llama.cpp drafts with, next to a trunk GGUF.

llama.cpp (`--spec-type draft-mtp -md mtp.gguf`) loads the side file as a model of the trunk's architecture whose
blocks after the trunk's are the MTP modules: one, or for Step-3.5/3.7 all three, which llama.cpp drafts with in turn
(`recycle.ggufarch` says how they are named and which hyper-parameters it reads); the
trunk stays whatever GGUF the user runs, quantized or not. The names, the hyper-parameters and the tensor
transforms come from the family's `gguf` record; this module only applies them:

  * the module's leaves under `blk.{n}.nextn.*`, its decoder block under the trunk's per-layer names, routed
    experts stacked per projection (written expert by expert: the stacked tensor is never held), MLA's kv_b split;
  * `token_embd` and `output_norm`, which llama.cpp's loaders require in the side file too: the source trunk's,
    or with `--target TRUNK.gguf` the trunk file's own bytes (its quantization kept);
  * `nextn.embed_tokens` only where the module's embedding differs from the trunk's (llama.cpp falls back to
    `token_embd` without it), the head always (`nextn.shared_head_head`, or `output` where llama.cpp's own
    export puts it there: Qwen3.5);
  * zero-centred norms (Qwen3.5) stored +1, as llama.cpp's converter stores them;
  * hyper-parameters and the vocabulary: from `--target TRUNK.gguf`'s header when given (so the two files agree by
    construction; block_count and nextn_predict_layers set for the side file), else from the source's config.json
    and tokenizer.json.

Norms, biases and the router stay float32 (as llama.cpp's converter keeps them); the rest is `--dtype` (f32, f16,
bf16, or q8_0: GGML's 8-bit blocks, the head and embeddings kept f16).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recycle.checkpoint import SHORT_DTYPES
from recycle.converters.registry import CONVERTERS
from recycle.converters.roles import EXACT, Plan, RoleWeights, require_sequential, same_values, stored
from recycle.errors import RecycleError
from recycle.families import FAMILIES, merged_config
from recycle.ggufarch import CHAINED, NEXTN, TRUNK, GGUFArch
from recycle.io.writer import MXFP4, Q8_0, Lazy
from recycle.quant.fp4 import ggml_mxfp4_blocks

SIDE_FILE = "mtp.gguf"
DTYPES = {**SHORT_DTYPES, Q8_0: Q8_0}  # `--dtype` → what the writer stores
FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32, Q8_0: 7, MXFP4: 38}  # general.file_type
# (LLAMA_FTYPE_*; 38 is MOSTLY_MXFP4_MOE: the experts MXFP4, as llama.cpp's V4 converter labels its files)
# Under q8_0 the head and the embeddings stay f16: what the module's acceptance rests on most (MTP heads quantized
# hard reportedly accept nothing), and a small share of the file beside the experts.
PRECISE = ("token_embd.weight", "output.weight")  # whole names
PRECISE_SUFFIXES = (".nextn.embed_tokens.weight", ".nextn.shared_head_head.weight")
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4  # gguf.TokenType
GPT2_REGEX_PRE = "gpt-2"  # a plain ByteLevel pre-tokenizer with GPT-2's regex (the fixtures' tokenizer)


@dataclass
class Header:
    """A GGUF file's header as the writer needs it: architecture, key/values (key, value, GGUF type name, the
    array element type where the value is a list) in order, and tensors copied as they are from another GGUF."""

    arch: str
    kv: list[tuple[str, object, str, str | None]] = field(default_factory=list)
    raw: dict[str, object] = field(default_factory=dict)  # name -> gguf.ReaderTensor (copied byte for byte)
    f32: tuple[str, ...] = ()  # name suffixes kept float32 whatever the file's type (and every 1-D tensor)

    def keep_f32(self, name: str, shape: tuple[int, ...]) -> bool:
        """Tensors llama.cpp's converter keeps in float32: 1-D ones, norms, biases and the router."""
        return len(shape) <= 1 or name.endswith(self.f32)

    def storage(self, name: str, shape: tuple[int, ...], dtype):
        """What one tensor is written as under the file's `dtype` (a torch dtype or `Q8_0`): float32 where llama.cpp
        keeps it so; under q8_0, f16 for the head and embeddings and for rows not a whole number of 32-blocks."""
        if self.keep_f32(name, shape):
            return torch.float32
        if dtype == Q8_0 and (name in PRECISE or name.endswith(PRECISE_SUFFIXES) or shape[-1] % 32):
            return torch.float16
        return dtype

    def add(self, key: str, value, vtype: str, sub: str | None = None) -> None:
        if value is not None and value != []:  # GGUF has no empty arrays (a vocabulary without merges)
            self.kv = [row for row in self.kv if row[0] != key] + [(key, value, vtype, sub)]


def supported() -> str:
    """Families llama.cpp drafts with that recycle writes, for messages."""
    return ", ".join(f"{f.title.split(' (')[0]} ({f.exports.gguf.arch})" for f in FAMILIES if f.exports.gguf is not None)


def arch_of(w: RoleWeights) -> GGUFArch:
    arch = w.family.exports.gguf
    if arch is None:
        why = f" ({w.family.exports.gguf_why})" if w.family.exports.gguf_why else ""
        raise RecycleError(f"{w.ckpt.path}: llama.cpp has no MTP graph recycle writes for {w.family.title}{why}; "
                           f"--to gguf covers {supported()}")
    return arch


def _block(arch: GGUFArch, block: Mapping[str, Lazy], n: int, cfg: Mapping, ckpt=None) -> dict[str, Lazy]:
    """The decoder block under llama.cpp's per-layer names (experts stacked, kv_b split; FP4 experts of `ckpt`
    repacked where the record says so)."""
    out: dict[str, Lazy] = {}
    experts: dict[str, dict[int, Lazy]] = {}
    for template, rels in arch.block_fused.items():  # several block tensors as one (MiMo's [Q; K; V])
        if all(r in block for r in rels):
            parts = [block[r] for r in rels]
            out[template.format(n=n)] = Lazy(
                (sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                lambda ps=parts: torch.cat([p.make() for p in ps]), tuple(s for p in parts for s in p.sources),
                EXACT, f"{', '.join(rels)} stacked along the rows, as llama.cpp's fused tensor reads them")
            block = {r: v for r, v in block.items() if r not in rels}
    for rel, lazy in block.items():
        if ckpt is not None and ckpt.tensors[lazy.sources[0]].dtype == "F8_E8M0" \
                and rel.removesuffix(".scale") + ".weight" in block:
            continue  # DeepSeek's native e8m0 `.scale` of an FP8 weight: read with that weight, which is dequantized
        if m := re.match(arch.experts, rel):
            experts.setdefault(m.group(2), {})[int(m.group(1))] = lazy
            continue
        if arch.split_kv_b and rel == "self_attn.kv_b_proj.weight":
            out.update(_split_kv_b(lazy, n, cfg))
            continue
        for pattern, template in arch.block:
            if m := re.match(pattern, rel):
                out[template.format(*m.groups(), n=n)] = lazy
                break
        else:
            raise RecycleError(f"MTP block tensor {rel}: llama.cpp's {arch.arch} graph has no name for it "
                               f"({arch.source})")
    for proj, by_index in sorted(experts.items()):
        parts = [by_index[i] for i in sorted(by_index)]
        if sorted(by_index) != list(range(len(parts))):
            raise RecycleError(f"MTP block: routed experts {sorted(by_index)[:4]}... are not numbered 0..{len(parts) - 1}")
        fp4 = arch.fp4_experts and ckpt is not None and all(
            getattr(ckpt.packed.get(p.sources[0]), "codec", None) == "mxfp4_native" for p in parts)
        if fp4:
            parts = [_mxfp4(ckpt, p) for p in parts]
        out[f"blk.{n}.ffn_{arch.expert_names[proj]}_exps.weight"] = Lazy(
            (len(parts), *parts[0].shape), lambda ps=parts: torch.stack([p.make() for p in ps]),
            tuple(s for p in parts for s in p.sources), EXACT,
            f"{len(parts)} experts stacked (expert-major){', FP4 repacked as MXFP4 blocks' if fp4 else ''}",
            dtype=MXFP4 if fp4 else None, parts=tuple(parts))
    return out


def _mxfp4(ckpt, lazy: Lazy) -> Lazy:
    """An FP4-stored expert (`mxfp4_native`) as GGML MXFP4 block bytes, from its stored codes and scales."""
    parts = ckpt.packed[lazy.sources[0]].parts
    return Lazy(lazy.shape, lambda: ggml_mxfp4_blocks(ckpt.raw(parts["codes"]), ckpt.raw(parts["scale"])),
                lazy.sources, EXACT, "FP4 repacked as MXFP4 blocks", dtype=MXFP4,
                reads=tuple(ckpt.span(p) for p in parts.values()))


def _concat(parts: list[Lazy], roles: tuple[str, ...]) -> Lazy:
    """Several [out, in_i] leaves as one [out, Σ in_i] (DeepSeek-V4's e_proj and h_proj as llama.cpp's eh_proj)."""
    if len({p.shape[0] for p in parts}) != 1 or any(len(p.shape) != 2 for p in parts):
        raise RecycleError(f"{' + '.join(roles)}: shapes {[list(p.shape) for p in parts]} do not concatenate along "
                           "their inputs")
    return Lazy((parts[0].shape[0], sum(p.shape[1] for p in parts)), lambda: torch.cat([p.make() for p in parts], 1),
                tuple(s for p in parts for s in p.sources), EXACT, f"{' and '.join(roles)} side by side",
                reads=tuple(r for p in parts for r in p.reads))


def _split_kv_b(lazy: Lazy, n: int, cfg: Mapping) -> dict[str, Lazy]:
    """MLA's kv_b_proj [heads·(nope+v), kv_lora] → attn_k_b [heads, kv_lora, nope] (transposed) and attn_v_b
    [heads, v, kv_lora], as llama.cpp's absorbed-MLA graph reads them."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    rank = lazy.shape[1]
    if lazy.shape[0] != heads * (nope + v):
        raise RecycleError(f"kv_b_proj has {lazy.shape[0]} rows, config implies {heads}·({nope}+{v})")

    def part(t: torch.Tensor, k: bool) -> torch.Tensor:
        t = t.reshape(heads, nope + v, rank)
        return t[:, :nope].transpose(1, 2).contiguous() if k else t[:, nope:].contiguous()

    return {f"blk.{n}.attn_k_b.weight": lazy.derive((heads, rank, nope), lambda t: part(t, True),
                                                    note="kv_b_proj's key rows per head, transposed"),
            f"blk.{n}.attn_v_b.weight": lazy.derive((heads, v, rank), lambda t: part(t, False),
                                                    note="kv_b_proj's value rows per head")}


def _trunk(w: RoleWeights, role: str) -> str | None:
    """The source trunk's tensor name for `embed` / `final_norm` (None when the source stores no trunk)."""
    names = {"embed": w.family.layout.trunk.get("embed", ()),
             "final_norm": ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")}[role]
    return next((n for n in names if n in w.ckpt.tensors), None)


def _modules(w: RoleWeights, arch: GGUFArch, opts) -> list[int]:
    """The modules the side file holds: `--module K`, else every module where llama.cpp chains them (CHAINED),
    else the only one."""
    if opts.module is not None:
        if not 0 <= opts.module < len(w.modules):
            raise RecycleError(f"--module {opts.module}: {opts.source} has modules 0..{len(w.modules) - 1}")
        return [opts.module]
    if len(w.modules) > 1 and arch.arch not in CHAINED:
        raise RecycleError(f"{opts.source}: {len(w.modules)} MTP modules, and llama.cpp drafts with one (its "
                           f"{arch.arch} graph asserts n_layer_nextn == 1, {arch.source}; it reuses that module "
                           "for every draft position): pass --module 0 to write the first")
    return list(range(len(w.modules)))


@CONVERTERS.register("gguf")
def convert(w: RoleWeights, req) -> Plan:
    """The side file's tensors and header (see the module docstring)."""
    require_sequential(w, "gguf")
    arch = arch_of(w)
    opts = req.options
    ks = _modules(w, arch, opts)
    cfg = merged_config(w.ckpt.config)
    n = w.num_hidden_layers
    trunk_gguf = read_trunk(opts.target, arch, w, n) if opts.target else None
    tensors: dict[str, Lazy] = {}
    notes = [f"module {k} as llama.cpp's blk.{n + i}" for i, k in enumerate(ks)]
    notes[0] += f" ({arch.arch}, {arch.source})"
    if len(ks) > 1:
        notes.append(f"llama.cpp drafts with the {len(ks)} modules in turn, module k at draft step k")
    header = trunk_gguf if trunk_gguf is not None else Header(arch.arch)
    header.f32 = arch.f32
    if trunk_gguf is not None:
        notes.append(f"token_embd, output_norm and the header's keys copied from {opts.target}")
    if trunk_gguf is None:
        for gname, role in TRUNK.items():
            name = _trunk(w, role)
            if name is None:
                raise RecycleError(f"{opts.source}: no trunk {role.replace('_', ' ')} ({gname} of the side file, "
                                   "which llama.cpp requires); pass --target TRUNK.gguf to copy it from the trunk file")
            tensors[gname] = stored(w.ckpt, name)
    for gname, get in arch.computed.items():
        try:
            values = get(cfg)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise RecycleError(f"{w.ckpt.path}/config.json: cannot compute {gname} ({e})") from None
        if values is not None:
            tensors[gname] = Lazy((len(values),), lambda v=tuple(values): torch.tensor(v, dtype=torch.float32), (),
                                  EXACT, "computed from config.json, as llama.cpp's converter computes it",
                                  dtype=torch.float32)
    blocks: set[str] = set()
    for i, k in enumerate(ks):
        block = _module(w, arch, w.modules[k], n + i, cfg, tensors, notes)
        blocks.update(block)
    if arch.norm_offset:  # zero-centred norms stored as llama.cpp multiplies by them: w + offset (the module's
        off = arch.norm_offset  # role leaves are plain `w` already: recycle's roles hold every norm that way)
        for name, lazy in list(tensors.items()):
            if (name in blocks or name == "output_norm.weight") and name.endswith(arch.norms):
                tensors[name] = lazy.derive(lazy.shape, lambda t, o=off: t.float() + o,
                                            note=f"{lazy.note + '; ' if lazy.note else ''}stored +{off:g} "
                                                 "(zero-centred norm, as llama.cpp's converter stores it)")
    dtype = DTYPES[opts.dtype]
    file_type = dtype
    if any(tensors[b].dtype == MXFP4 for b in blocks):
        notes.append("routed experts stored FP4: repacked bit for bit as MXFP4 blocks (whatever --dtype says)")
        file_type = MXFP4
    _metadata(header, arch, w, cfg, n, ks, file_type, opts.source, trunk_gguf is not None)
    return Plan({SIDE_FILE: tensors}, {}, tokenizer_dirs=(), notes=list(dict.fromkeys(notes)),
                gguf={SIDE_FILE: header})


def _module(w: RoleWeights, arch: GGUFArch, mod, b: int, cfg: Mapping, tensors: dict[str, Lazy],
            notes: list[str]) -> dict[str, Lazy]:
    """One module as llama.cpp's block `b`: its leaves (blk.{b}.nextn.*, the record's own) and its decoder block,
    added to `tensors`; returns the block's tensors."""
    for role, suffix in NEXTN.items():
        lazy = mod.leaves.get(role)
        if lazy is None:
            continue
        if role == "embed":
            trunk = _trunk(w, "embed")
            if trunk is not None and len(lazy.sources) == 1 and same_values(w.ckpt, lazy.sources[0], trunk):
                notes.append("nextn.embed_tokens left out: the module's embedding equals the trunk's token_embd")
                continue
        name = arch.head.format(n=b) if role == "head" else arch.final_norm.format(n=b) if role == "final_norm" \
            else f"blk.{b}.nextn.{suffix}.weight"
        tensors[name] = lazy
    for role, name in arch.leaves.items():
        tensors[name.format(n=b)] = mod.leaves[role]
    for name, roles in arch.fused.items():
        tensors[name.format(n=b)] = _concat([mod.leaves[r] for r in roles], roles)
    block = _block(arch, mod.block, b, cfg, w.ckpt)
    tensors.update(block)
    return block


def _layers(value: list, n: int, ks: list[int], key: str) -> list:
    """A per-layer array (trunk layers, then the stored MTP layers) cut to the trunk's and the written modules'."""
    if len(value) < n + max(ks) + 1:
        raise RecycleError(f"config.json: {key} has {len(value)} per-layer entries, and the side file needs the "
                           f"{n} trunk layers' and MTP layer {n + max(ks)}'s")
    return [*value[:n], *(value[n + k] for k in ks)]


def _metadata(h: Header, arch: GGUFArch, w: RoleWeights, cfg: Mapping, n: int, ks: list[int], dtype, source: str,
              from_trunk: bool) -> None:
    a = arch.arch
    if not from_trunk:
        h.add("general.architecture", a, "STRING")
        h.add("general.type", "model", "STRING")
        h.add("general.name", f"{Path(source).name}-mtp", "STRING")
        for key, vtype, get in arch.hparams:
            try:
                value = get(cfg)
            except (KeyError, TypeError, ZeroDivisionError) as e:
                raise RecycleError(f"{w.ckpt.path}/config.json: cannot derive {a}.{key} ({e})") from None
            kind, _, sub = vtype.partition(":")  # "ARRAY:INT32": an array of INT32; "LAYERS:INT32": one per layer
            if kind == "LAYERS" and value is not None:
                value, kind = _layers(value, n, ks, f"{a}.{key}"), "ARRAY"
            h.add(f"{a}.{key}", value, kind, sub or None)
        for key, value, vtype, sub in tokenizer_kv(w.ckpt.path, int(cfg["vocab_size"]), arch):
            h.add(key, value, vtype, sub)
    else:  # the trunk file's per-layer arrays cover its n blocks; the side file has n + len(ks)
        _extend_arrays(h, arch, cfg, n, ks)
    h.add(f"{a}.block_count", n + len(ks), "UINT32")
    h.add(f"{a}.nextn_predict_layers", len(ks), "UINT32")
    h.add("general.file_type", FILE_TYPES[dtype], "UINT32")
    h.add("general.quantization_version", 2, "UINT32")
    h.add("recycle.source", Path(source).resolve().name, "STRING")


def _extend_arrays(h: Header, arch: GGUFArch, cfg: Mapping, n: int, ks: list[int]) -> None:
    """Per-layer arrays copied from a trunk GGUF of n blocks (Step's head counts and sliding pattern, DeepSeek-V4's
    swiglu clamps; llama.cpp's loader reads one entry per block of the side file, n + len(ks)): the record's values
    from the source's config where its trunk entries are the trunk file's, else the trunk's last entry repeated."""
    have = {row[0]: row for row in h.kv}
    for key, vtype, get in arch.hparams:
        row = have.get(f"{arch.arch}.{key}")
        if row is None or not vtype.startswith("LAYERS") or not isinstance(row[1], list) or len(row[1]) != n:
            continue
        try:
            value = _layers(get(cfg), n, ks, key)
        except (KeyError, TypeError, RecycleError):
            value = None
        if value is None or value[:n] != list(row[1]):
            value = [*row[1], *[row[1][-1]] * len(ks)]
        h.add(row[0], value, row[2], row[3])


def tokenizer_kv(path: Path, vocab_size: int, arch: GGUFArch) -> list[tuple[str, object, str, str | None]]:
    """The vocabulary as llama.cpp's `gpt2` tokenizer reads it, from tokenizer.json (a byte-level BPE): tokens in id
    order ([PAD{i}] where an id has none), their types, merges, and the special ids of config.json."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise RecycleError(f"{path}: no tokenizer.json for the side file's vocabulary; pass --target TRUNK.gguf")
    spec = json.loads(f.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise RecycleError(f"{f}: a {model.get('type')} tokenizer; recycle writes byte-level BPE vocabularies only: "
                           "pass --target TRUNK.gguf to take the trunk file's")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [UNUSED] * vocab_size
    for tok, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = tok, NORMAL
    for t in spec.get("added_tokens", []):
        if t["id"] < vocab_size:
            tokens[t["id"]], types[t["id"]] = t["content"], CONTROL if t.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = spec.get("pre_tokenizer") or {}
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    cfg = json.loads((Path(path) / "config.json").read_text())
    tok_cfg = Path(path) / "tokenizer_config.json"
    tcfg = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
    out: list[tuple[str, object, str, str | None]] = [
        ("tokenizer.ggml.model", "gpt2", "STRING", None),
        ("tokenizer.ggml.pre", GPT2_REGEX_PRE if gpt2 else arch.tokenizer_pre, "STRING", None),
        ("tokenizer.ggml.tokens", tokens, "ARRAY", "STRING"),
        ("tokenizer.ggml.token_type", types, "ARRAY", "INT32"),
        ("tokenizer.ggml.merges", merges, "ARRAY", "STRING"),
    ]
    for key, cfg_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("padding_token_id", "pad_token_id")):
        value = cfg.get(cfg_key)
        if value is None:  # a multimodal release's language model keeps them in its text_config (Step-3.7)
            value = (cfg.get("text_config") or {}).get(cfg_key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            out.append((f"tokenizer.ggml.{key}", value, "UINT32", None))
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tcfg.get(key), bool):
            out.append((f"tokenizer.ggml.{key}", tcfg[key], "BOOL", None))
    return out


def read_trunk(path: str | Path, arch: GGUFArch, w: RoleWeights, n: int) -> Header:
    """`--target TRUNK.gguf`: its header (every key but the file's own general ones) and its token_embd /
    output_norm, after checking it is the same model's trunk (architecture, layers, width, vocabulary)."""
    from recycle.gguf_file import open_gguf, value_of

    r = open_gguf(path)
    got = value_of(r, "general.architecture")
    where = f"--target {path}"
    if got != arch.arch:
        raise RecycleError(f"{where}: a {got} GGUF, and this side file is {arch.arch} ({w.family.title})")
    checks = ((f"{got}.block_count", n, "layers"), (f"{got}.embedding_length", w.hidden_size, "hidden size"))
    for key, want, what in checks:
        have = value_of(r, key)
        if have is not None and int(have) != want:
            raise RecycleError(f"{where}: {what} {have}, the MTP source's is {want} ({key})")
    vocab = len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None
    if vocab is not None and vocab != w.vocab_size:
        raise RecycleError(f"{where}: vocabulary of {vocab} tokens, the MTP source's is {w.vocab_size}")
    h = Header(arch.arch)
    for key, field_ in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.file_type", "general.quantization_version") \
                or key.startswith("split."):
            continue
        vtype = field_.types[0].name
        sub = field_.types[-1].name if vtype == "ARRAY" else None
        h.add(key, field_.contents(), vtype, sub)
    present = {t.name: t for t in r.tensors}
    for gname in TRUNK:
        if gname not in present:
            raise RecycleError(f"{where}: holds no {gname} (a trunk GGUF from llama.cpp's converter does)")
        h.raw[gname] = present[gname]
    return h
