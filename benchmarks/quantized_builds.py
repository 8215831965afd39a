"""The builds users serve (issue 48): what their stale MTP drafts, what re-alignment against the build gives back,
and the re-aligned module written back in the build's own scheme against its BF16 self, on the post-trained
DeepSeek fixture (stale MTP modules).

Builds (each the trunk the drafter is served on and, for re-alignment, the teacher):

  w4a16   llm-compressor's W4A16 of the post-trained fixture (compressed-tensors `pack-quantized`, int4 in groups of
          64: the preset's 128 does not divide the fixture's 64-column weights; `fixtures/quant/`, the MTP dropped)
  nvfp4   llm-compressor's NVFP4A16 of the same fixture (compressed-tensors `nvfp4-pack-quantized`, FP4 with an e4m3
          scale per 16 and a global scale; `fixtures/quant/`, MTP dropped)
  mxfp4   DeepSeek-V4's layout, written here with recycle's codecs: routed experts MXFP4 (`mxfp4_native`: I8 pairs +
          e8m0 `.scale` per 32, as DeepSeek-V4 stores them), every other attention/MLP Linear block FP8 (128×128,
          V4's power-of-two `ue8m0` scale values, stored as float32 `weight_scale_inv`: recycle's target loader
          refuses V4's own e8m0 `.scale` beside an FP8 weight), `quant_method: deepseek_v4_fp8`

Drafters, each measured by `recycle bench --tree chain:2` (greedy, held-out py:transformers code prompts):

  native      the BF16 release's stale MTP modules put back into the build in BF16, named in the scheme's ignore
              key (compressed-tensors `ignore`, ModelOpt `exclude_modules`, FP8 `ignored_layers`)
  realigned   the base fixture's modules distilled `--tokens` of py:transformers with the build as teacher (one
              distillation per build), stitched into the BF16 release (`recycle stitch`) and from there put into the
              build (`with_mtp`: stitch writes only block FP8 today): `bf16` (BF16 + ignore entries), `auto` (what
              `stitch --mtp-dtype auto` writes for the
              scheme: BF16 + ignore for compressed-tensors and ModelOpt; FP8 linears and MXFP4 experts for
              DeepSeek-V4), and where auto writes BF16 also `codec` (the MTP quantized with the codec the trunk's
              same layer uses and no ignore entry: what the engine builds when the entry is missing)

    python benchmarks/quantized_builds.py --tokens 256k --threads 2 --json /tmp/quantized_builds.json
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import torch
from quantized_drafters import BASE, DOMAIN, POST, chain2, setup
from safetensors.torch import save_file

from recycle.checkpoint import INDEX_FILE, QUANT_CONFIG_FILE, Checkpoint
from recycle.converters.api import convert_checkpoint
from recycle.converters.overlay import stitch as stitch_overlay
from recycle.distill.train import DistillOptions, distill
from recycle.errors import RecycleError
from recycle.families import match
from recycle.preflight import parse_tokens
from recycle.quant import CODECS, engine_fp8, ignore_entries, module_of, with_ignored
from recycle.quant.schemes import detect, engine_ignores, scheme_config

from _common import FIXTURES, write_json
from fixtures.fp8 import COPIED

QUANT = FIXTURES / "quant"
V4_CONFIG = {"quant_method": "deepseek_v4_fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
             "weight_block_size": [128, 128]}
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
MTP_UNQUANTIZED = ("eh_proj.weight",)  # deepseek_mtp builds eh_proj as a plain nn.Linear (vllm 0.32 deepseek_mtp.py:87)


# -- the builds ---------------------------------------------------------------------------------------------------

def _write(tensors: dict[str, torch.Tensor], config: dict, src: Path, out: Path, extra: dict | None = None) -> Path:
    """One-file checkpoint `out`: the tensors, config.json, the tokenizer files of `src`, and `extra` JSON files."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    (out / INDEX_FILE).unlink(missing_ok=True)
    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in COPIED:
        if (src / f).exists():
            shutil.copy2(src / f, out / f)
    for name, obj in (extra or {}).items():
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    return out


def fp8_pow2(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's FP8 linears (`scale_fmt: ue8m0`): e4m3 codes with one power-of-two scale per 128×128 block,
    2^ceil(log2(amax / 448)) so that nothing clips; returned as (codes, float32 `weight_scale_inv` multipliers)."""
    w = weight.float()
    m, n = w.shape
    bm, bn = math.ceil(m / block), math.ceil(n / block)
    tiles = torch.nn.functional.pad(w, (0, bn * block - n, 0, bm * block - m)).view(bm, block, bn, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)))
    q = (tiles / scale[:, None, :, None]).view(bm * block, bn * block)[:m, :n]
    return q.to(torch.float8_e4m3fn), scale


def mxfp4_build(src_dir: Path, out: Path) -> Path:
    """The DeepSeek-V4-layout build of `src_dir`'s trunk (its MTP left out, as the other builds' tools do): routed
    experts MXFP4 through recycle's `mxfp4_native` codec, the other attention/MLP linears block FP8."""
    src = Checkpoint(src_dir)
    mtp = set(match(src).mtp_names)
    codec = CODECS.get("mxfp4_native")
    tensors: dict[str, torch.Tensor] = {}
    for name, info in src.tensors.items():
        if name in mtp:
            continue
        if EXPERT.search(name):
            tensors.update(codec.quantize(src.get(name, torch.float32), name, V4_CONFIG))
        elif engine_fp8(name, info.shape):
            tensors[name], tensors[name + "_scale_inv"] = fp8_pow2(src.get(name, torch.float32))
        else:
            tensors[name] = src.get(name)
    config = {**src.config, "quantization_config": dict(V4_CONFIG), "expert_dtype": "fp4"}
    return _write(tensors, config, src.path, out)


# -- an MTP put into a build --------------------------------------------------------------------------------------

def _with_entries(config: dict, build: Path, modules: list[str]) -> tuple[dict, dict]:
    """config.json (and ModelOpt's hf_quant_config.json, {} where none) with `modules` in the scheme's ignore key."""
    scheme = detect(config, build)
    hf = json.loads((build / QUANT_CONFIG_FILE).read_text()) if (build / QUANT_CONFIG_FILE).is_file() else {}
    if not modules:
        return config, hf
    q = dict(config["quantization_config"])
    if scheme.name == "compressed_tensors":
        q["ignore"] = sorted(set(q.get("ignore") or []) | set(modules))
    elif scheme.name == "modelopt":
        q["ignore"] = sorted(set(q.get("ignore") or []) | set(modules))
        if hf:
            hq = dict(hf["quantization"])
            hq["exclude_modules"] = sorted(set(hq.get("exclude_modules") or []) | set(modules))
            hf = {**hf, "quantization": hq}
    elif scheme.name in ("fp8_block", "deepseek_v4"):
        return with_ignored(config, modules), hf
    else:
        raise RecycleError(f"{build}: no ignore key for scheme {scheme.name}")
    return {**config, "quantization_config": q}, hf


def _trunk_twin(name: str, layers: int) -> str:
    """The last trunk layer's tensor of the same kind as MTP tensor `name` (how the build stores that kind)."""
    return re.sub(r"^model\.layers\.\d+\.", f"model.layers.{layers - 1}.", name)


def with_mtp(build_dir: Path, source: Path, out: Path, mode: str) -> tuple[Path, dict]:
    """`build_dir` with `source`'s MTP modules (a BF16 checkpoint holding them under the target's names) in place
    of its own: `bf16` keeps them BF16 with every module the engine would quantize named in the scheme's ignore
    key; `codec` quantizes those weights with the codec the trunk's same layer is stored in (block FP8 for FP8
    layers), with no entry. Returns the directory and what was done (per mode: quantized / ignored counts)."""
    build, src = Checkpoint(build_dir), Checkpoint(source)
    sm = match(src)
    names = list(sm.mtp_names)
    layers = int(build.config["num_hidden_layers"])
    drop = set(match(build).mtp_names)
    drop |= {p for n in drop if n in build.packed for p in build.packed[n].parts.values()}
    drop |= {n + "_scale_inv" for n in list(drop)}
    tensors = {n: build.raw(n) for n in build.stored if n not in drop}
    scheme = detect(build.config, build_dir)
    qcfg = scheme_config(build.config, build_dir)
    quantized, ignored = [], []
    for n in names:
        w = src.get(n) if src.tensors[n].quantized else src.raw(n)  # the source's own dtype (F32 router bias)
        twin = _trunk_twin(n, layers)
        engine_quantizes = (engine_fp8(n, src.tensors[n].shape) and not n.endswith(MTP_UNQUANTIZED)
                            and not engine_ignores(scheme, module_of(n), qcfg))
        if not engine_quantizes or mode == "bf16":
            tensors[n] = w
            if engine_quantizes:
                ignored.append(n)
            continue
        if twin in build.packed:
            codec = build.packed[twin].codec
            tensors.update(CODECS.get(codec).quantize(w.float(), n, build.quant_config))
        elif build.stored.get(twin) is not None and build.stored[twin].is_fp8:
            codec = "fp8_block"
            tensors[n], tensors[n + "_scale_inv"] = fp8_pow2(w)
        else:
            raise RecycleError(f"{build_dir}: {twin} (the trunk's twin of {n}) is stored {build.tensors[twin].dtype}, "
                               "but the engine quantizes it")
        quantized.append(f"{n}: {codec}")
    config = dict(build.config)
    for key in ("num_nextn_predict_layers",):
        config[key] = src.config.get(key, config.get(key))
    config, hf = _with_entries(config, build_dir, ignore_entries(ignored))
    _write(tensors, config, build.path, out, {QUANT_CONFIG_FILE: hf} if hf else None)
    agrees(out, [n for n in names if engine_fp8(n, src.tensors[n].shape) and not n.endswith(MTP_UNQUANTIZED)])
    done = {"quantized": len(quantized), "ignored": len(ignored), "codecs": sorted({q.split(": ")[1] for q in quantized})}
    if quantized:  # what the codec did to each weight: ‖read back − BF16‖ / ‖BF16‖, as the reader dequantizes it
        back = Checkpoint(out)
        err = [float((back.get(n, torch.float32) - w).norm() / w.norm().clamp(min=1e-12))
               for n in (q.split(": ")[0] for q in quantized) for w in (src.get(n, torch.float32),)]
        done["rel_error"] = {"mean": round(sum(err) / len(err), 4), "max": round(max(err), 4)}
    return out, done


def agrees(directory: Path, weights: list[str]) -> None:
    """Each of these weights is stored quantized exactly where the engine's rule (the scheme record's, with the
    config as written) builds its layer quantized: the check that the directory is what an engine loads."""
    c = Checkpoint(directory)
    scheme, cfg = detect(c.config, directory), scheme_config(c.config, directory)
    for n in weights:
        stored_q = n in c.packed or c.stored[n].is_fp8
        if stored_q == engine_ignores(scheme, module_of(n), cfg):
            raise RecycleError(f"{directory}: {n} is stored {'quantized' if stored_q else c.tensors[n].dtype}, but "
                               f"the engine builds it {'unquantized' if stored_q else 'quantized'}")


# -- DeepSeek-V3's MTP module at full size, per scheme (computed from shapes, not measured) ------------------------

def mtp_bytes_v3() -> dict:
    """Stored bytes of DeepSeek-V3's MTP module (layer 61: inspect_scale's layout of the release) per scheme: the
    linear weights each engine builds quantized (attention, shared and 256 routed experts × 2048) in the scheme's
    storage, the rest (eh_proj, router, norms) BF16, and the embedding/head copies apart (BF16 in every build)."""
    from inspect_scale import layer, mtp_extras

    shapes = {n: s for n, _, s in layer(61) + mtp_extras(61) if not n.endswith("_scale_inv")}
    lin = {n: s for n, s in shapes.items() if engine_fp8(n, s)}
    copies = {n: s for n, s in shapes.items() if n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    rest = sum(math.prod(s) * (4 if n.endswith("bias") else 2) for n, s in shapes.items()
               if n not in lin and n not in copies)

    def fp8_block(m: int, k: int, scale_bytes: int = 4) -> int:
        return m * k + scale_bytes * math.ceil(m / 128) * math.ceil(k / 128)

    per = {  # bytes of one [m, k] weight
        "BF16": lambda m, k: 2 * m * k,
        "FP8 block 128×128 (DeepSeek-V3)": fp8_block,
        "W4A16 int4 group 128, BF16 scales (pack-quantized)": lambda m, k: m * k // 2 + 2 * m * math.ceil(k / 128) + 16,
        "NVFP4 (e4m3 scale per 16, F32 global)": lambda m, k: m * k // 2 + m * k // 16 + 4,
        "MXFP4 (e8m0 scale per 32), every linear": lambda m, k: m * k // 2 + m * k // 32,
        "DeepSeek-V4 layout (routed experts MXFP4, other linears FP8 with e8m0 scales)":
            lambda m, k, n="": (m * k // 2 + m * k // 32) if EXPERT.search(n) else fp8_block(m, k, 1),
    }
    out = {"linear_params": sum(math.prod(s) for s in lin.values()), "other_bf16_bytes": rest,
           "embed_head_copies_bf16_bytes": sum(2 * math.prod(s) for s in copies.values()), "schemes": {}}
    for scheme, f in per.items():
        total = sum(f(*s, n) if "V4" in scheme else f(*s) for n, s in lin.items())
        out["schemes"][scheme] = {"linear_bytes": total, "module_bytes": total + rest}
    return out


# -- the run --------------------------------------------------------------------------------------------------------

def builds(work: Path) -> dict[str, tuple[Path, str]]:
    """The quantized trunks measured: name → (directory, how it was made)."""
    out = {}
    for name, fixture in (("w4a16", "ds_v3_w4a16_llmc"), ("nvfp4", "ds_v3_nvfp4a16_llmc")):
        if (QUANT / fixture / "config.json").is_file():
            out[name] = (QUANT / fixture, f"fixtures/quant/{fixture} (llm-compressor)")
        else:
            print(f"{name}: fixtures/quant/{fixture} is not built: skipped", flush=True)
    out["mxfp4"] = (mxfp4_build(POST, work / "post-mxfp4"), "DeepSeek-V4 layout, recycle's mxfp4_native codec")
    return out


def auto_writes(build: Path) -> str:
    """What `stitch --mtp-dtype auto` writes into this build's scheme, as the scheme record says: "bf16" (BF16 with
    the scheme's ignore entry) or "codec" (the scheme's own storage)."""
    from recycle.quant.schemes import BF16_IGNORE

    scheme = detect(json.loads((build / "config.json").read_text()), build)
    return "bf16" if scheme.writes == (BF16_IGNORE,) else "codec"


def main() -> None:
    a, work, prompts = setup(__doc__, "/tmp/recycle-quantized-builds")
    t0 = time.perf_counter()
    result = {"tokens": parse_tokens(a.tokens), "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
              "domain": DOMAIN, "rows": [], "distills": {}, "mtp_bytes_deepseek_v3_computed": mtp_bytes_v3()}
    rows = result["rows"]

    def row(build: str, drafter: str, teacher: str | None, mtp: str, directory: Path, **extra) -> None:
        t = time.perf_counter()
        rows.append({"build": build, "drafter": drafter, "teacher": teacher, "mtp_weights": mtp,
                     **chain2(directory, prompts, a.max_new_tokens), "bench_s": round(time.perf_counter() - t),
                     "dir": str(directory), **extra})
        print(json.dumps(rows[-1]), flush=True)
        if a.json:
            write_json(a.json, {**result, "seconds": round(time.perf_counter() - t0)})

    targets = builds(work)
    result["builds"] = {k: how for k, (_, how) in targets.items()}
    natives = {}
    for name, (build, _) in targets.items():
        natives[name], done = with_mtp(build, POST, work / f"{name}-native", "bf16")
        row(name, "native (stale, BF16 release's)", None, f"BF16, ignore entries ({done['ignored']})", natives[name])
    eagle = Path(convert_checkpoint(BASE, "eagle", work / "base-eagle", layouts="recycle,overlay",
                                    overwrite=True)["out"])
    for name, (build, _) in targets.items():
        out = work / f"realigned-{name}"
        rec = distill(DistillOptions(drafter=str(eagle), target=str(natives[name]), tokens=result["tokens"],
                                     data=DOMAIN, out=str(out), overwrite=True, threads=a.threads))
        result["distills"][name] = {"tokens": rec["tokens"], "train_s": round(rec["train_s"]),
                                    "estimate": [rec["final"]["heldout_estimate_before"],
                                                 rec["final"]["heldout_estimate_after"]]}
        print(f"distilled against {name}: {json.dumps(result['distills'][name])}", flush=True)
        if a.json:
            write_json(a.json, {**result, "seconds": round(time.perf_counter() - t0)})
        # the re-aligned modules in BF16 under the BF16 release's names (stitch into the unquantized source), then
        # into the build in each form
        source = Path(stitch_overlay(out / "mtp_overlay", POST, work / f"realigned-{name}-bf16src",
                                     overwrite=True, mtp_dtype="auto")["out"])
        auto = auto_writes(build)
        for mode in ("bf16", "codec"):
            d, done = with_mtp(build, source, work / f"st-{name}-{mode}", mode)
            mtp = (f"BF16, ignore entries ({done['ignored']})" if mode == "bf16"
                   else f"quantized ({done['quantized']}: {', '.join(done['codecs'])}), no entries")
            row(name, "realigned", name, mtp, d, mtp_dtype=("auto, " if mode == auto else "") + mode,
                quantization_error=done.get("rel_error"))
    row("bf16", "native (stale, as released)", None, "BF16", POST)  # issue 30's first row, on the same prompts
    result["seconds"] = round(time.perf_counter() - t0)
    if a.json:
        write_json(a.json, result)
    head = ("build", "drafter", "taught by", "MTP weights", "--mtp-dtype", "α1", "α2", "τ (chain:2)", "greedy = AR")
    print("| " + " | ".join(head) + " |\n|---|---|---|---|---|---:|---:|---:|---|")
    for r in rows:
        a1, a2 = (r["acceptance"] + [0.0, 0.0])[:2]
        cells = (r["build"], r["drafter"], r["teacher"] or "-", r["mtp_weights"], r.get("mtp_dtype", "-"),
                 f"{a1:.3f}", f"{a2:.3f}", f"{r['tau']:.3f}", r["greedy_match"])
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
