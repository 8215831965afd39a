"""The MTP family table: every supported layout described as data, and the one matcher over it.

A row says how to recognise a family (config `model_type`/`architectures`, and the tensors an MTP
module must hold), where module k's tensors live (name templates per role), what the module shares
with the trunk, how its input is concatenated ([e; h] or [h; e]), how its norms are parametrised
(`w·x̂` or zero-centred `(1+w)·x̂`), and which transformers decoder-layer class runs its block. A row is its
identity (name, title, model types, architectures, kind, notes) and one record per concern, each read by the code
that needs it: `layout` (ModuleLayout: where the tensors live), `keys` (ConfigKeys: how config.json is read), `run`
(Runtime: what the engines compute, read by recycle.mtp) and `exports` (Exports: what convert builds). A row like
another is `derive(OTHER, name=..., run=dict(...))`.

Name templates are `str.format` strings over:
  {k}      module index, 0-based
  {layer}  num_hidden_layers + k (DeepSeek/GLM put module k after the trunk layers)
  {first}, {last}  the first and last sublayer index of module k (Nemotron-H: k·p .. k·p+p-1)
  {s}      (block prefixes only) every sublayer index of module k
Every row is exercised by a test against a fixture in that family's exact layout
(`fixtures/families.py`).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.ggufarch import DEEPSEEK2, DEEPSEEK4, GLM4MOE, MIMO2, QWEN3NEXT, QWEN35, QWEN35MOE, STEP35, GGUFArch
from recycle.quant import NATIVE_SCALE_SUFFIX, SCALE_SUFFIX, scale_names

ROLES = ("embed_norm", "hidden_norm", "proj", "block", "final_norm", "head", "embed",
         # DeepSeek-V4: separate embedding/hidden projections (summed), and the module's own hyper-connection head
         "e_proj", "h_proj", "hc_head_fn", "hc_head_base", "hc_head_scale")
SHARED_ROLES = ("final_norm", "head", "embed")  # roles a module may borrow from the trunk

COMMON_BLOCK_SHAPES: Mapping[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
    "mlp.gate.weight": ("E", "H"),
}


@dataclass(frozen=True)
class HFLayout:
    """How a checkpoint stored under another codebase's names runs as a transformers model, as data.

    `names` maps checkpoint names (regexes) to transformers' (templates over the groups): applied to the
    trunk it gives a `model_type` causal LM's state dict; applied to a parallel head's block (after its
    prefix is swapped for `layers.N.`) it gives that decoder layer's. `rope_permute` lists the transformers
    names whose rows go from the interleaved rotary pairs of Meta's reference code to transformers'
    half-split ones (and back when saving). `config` maps transformers config keys to checkpoint ones.
    """

    model_type: str
    config: Mapping[str, str]
    names: tuple[tuple[str, str], ...]
    rope_permute: Mapping[str, str] = field(default_factory=dict)  # HF name suffix -> config key of its head count
    layer: str = r"^layers\.(\d+)\."  # a trunk layer's prefix (their count is num_hidden_layers)


META_LLAMA = HFLayout(
    model_type="llama",
    config={"hidden_size": "dim", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
            "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta", "vocab_size": "vocab_size"},
    names=(
        (r"^tok_embeddings\.weight$", "model.embed_tokens.weight"),
        (r"^norm\.weight$", "model.norm.weight"),
        (r"^output\.weight$", "lm_head.weight"),
        (r"^layers\.(\d+)\.attention\.wq\.weight$", "model.layers.{0}.self_attn.q_proj.weight"),
        (r"^layers\.(\d+)\.attention\.wk\.weight$", "model.layers.{0}.self_attn.k_proj.weight"),
        (r"^layers\.(\d+)\.attention\.wv\.weight$", "model.layers.{0}.self_attn.v_proj.weight"),
        (r"^layers\.(\d+)\.attention\.wo\.weight$", "model.layers.{0}.self_attn.o_proj.weight"),
        (r"^layers\.(\d+)\.feed_forward\.w1\.weight$", "model.layers.{0}.mlp.gate_proj.weight"),
        (r"^layers\.(\d+)\.feed_forward\.w3\.weight$", "model.layers.{0}.mlp.up_proj.weight"),
        (r"^layers\.(\d+)\.feed_forward\.w2\.weight$", "model.layers.{0}.mlp.down_proj.weight"),
        (r"^layers\.(\d+)\.attention_norm\.weight$", "model.layers.{0}.input_layernorm.weight"),
        (r"^layers\.(\d+)\.ffn_norm\.weight$", "model.layers.{0}.post_attention_layernorm.weight"),
    ),
    rope_permute={"self_attn.q_proj.weight": "num_attention_heads", "self_attn.k_proj.weight": "num_key_value_heads"},
)


@dataclass(frozen=True)
class Fused:
    """A tensor the release stores fused where the decoder-layer class holds its parts (`recycle.fused`): names
    relative to a block prefix, without `.weight`/`.bias`. With `chunks_key`, pre-sharded for tensor parallelism:
    `config[chunks_key]` row chunks, each [part_1 | part_2 | ...] of that share of every part (MiMo-V2.5's
    `qkv_proj`, vLLM's `_shard_fp8_qkv_proj`); an FP8 weight's block scales may be tiled per chunk."""

    name: str
    parts: tuple[str, ...]
    chunks_key: str | None = None


@dataclass(frozen=True)
class ModuleLayout:
    """Where the tensors live: module k's roles (name templates), its block's prefixes, what the trunk lends, and
    the whole checkpoint's names where they are another codebase's."""

    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # role -> templates (first match wins)
    block: tuple[str, ...] = ()  # block prefix templates; unclaimed tensors under them are the block
    trunk: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # role -> trunk names when the module has none
    anchor: str = "proj"  # the role whose presence says module k exists
    stores_copies: tuple[str, ...] = ()  # roles the release is expected to store inside the module
    prefixes: tuple[str, ...] = ("",)  # optional outer prefixes (multimodal wrappers)
    shapes: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "embed_norm": ("H",),
            "hidden_norm": ("H",),
            "proj": ("H", "2H"),
            "final_norm": ("H",),
            "head": ("V", "H"),
            "embed": ("V", "H"),
        }
    )
    block_shapes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: COMMON_BLOCK_SHAPES)
    # checkpoints stored under another codebase's names (Meta's reference Llama): how transformers runs them
    hf_layout: HFLayout | None = None
    # tensors stored fused, in the trunk's layers and the MTP blocks alike (recycle.fused)
    fused: tuple[Fused, ...] = ()


@dataclass(frozen=True)
class ConfigKeys:
    """How config.json is read: the MTP depth, the shape symbols, and the block config's extra entries."""

    depth_keys: tuple[str, ...] = ("num_nextn_predict_layers",)
    depth_offset: int = 0  # added to the declared count (Meta counts the next-token head too)
    default_depth: int = 0  # what engines assume when no depth key is present (vLLM: 1 for Qwen3-Next)
    switch_key: str | None = None  # a boolean config key that turns MTP off when false (MiniMax `use_mtp`)
    sublayers: tuple[str, ...] = ()  # config keys giving sublayers per module (len of str/list, or int)
    hidden_keys: tuple[str, ...] = ("hidden_size",)
    vocab_keys: tuple[str, ...] = ("vocab_size",)
    expert_keys: tuple[str, ...] = ("n_routed_experts", "num_experts", "moe_num_experts", "num_local_experts")
    backbone_keys: tuple[str, ...] = ()  # Gemma 4 assistant: the target's hidden size
    # shape symbols beyond H/V/E/Hb, each read from the first config key present (DeepSeek-V4: {"C": ("hc_mult",)})
    dim_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # the config's per-layer lists and per-layer overrides run over the MTP layers after the trunk's (Step pads
    # layer_types, swiglu limits, rope lists): the block config is built with them counted as layers
    config_counts_mtp: bool = False
    # block-config key → the config.json key (dotted: a nested block) it is read from, where config.json has no such
    # key of its own (Inkling's `mtp_config`: transformers' text config takes num_mtp_layers, mtp_local_layer_ids)
    block_config_keys: Mapping[str, str] = field(default_factory=dict)
    # a reader registered in recycle.release_config.READERS under this name: the release's own config keys (those the
    # engines read) → the transformers config class's, where transformers has no class for the model type
    release_config: str | None = None


@dataclass(frozen=True)
class Runtime:
    """What the engines compute (vLLM/SGLang), as recycle.mtp runs it; no code names a family."""

    concat_order: str | None = "eh"  # "eh": cat[embed, hidden]; "he": hidden first; None: no concat
    norm: str = "w"  # "w": w·x̂ ; "1+w": zero-centred
    block_class: str | None = None  # transformers decoder-layer class running the block (or recycle.mtp.blocks')
    block_model_type: str | None = None  # transformers model_type for the block's config, if not the family's own
    chained_state: str = "pre_norm"  # state fed to depth k+1: "pre_norm" (y+r) or "post_norm"
    zero_embed_at_pos0: bool = False
    attn_implementation: str | None = None  # forced for the block (e.g. "eager": a class without sdpa, attention sinks)
    # the block indexes its attention mask (a sparse-attention indexer): always a mask, never the None that sdpa's
    # causal shortcut gives (transformers' own DSA models force it the same way)
    mask_required: bool = False
    # (checkpoint, decoder-layer) substrings of block tensor names relative to the block prefix, applied both ways
    block_renames: tuple[tuple[str, str], ...] = ()
    # an MTP runtime registered in recycle.mtp.RUNTIMES under this name, for a layout the common forward cannot run
    runtime: str | None = None
    # per-layer config lists (`layer_types`, `mlp_layer_types`, ...) → the value for the MTP layers, where the config
    # has no `mtp_<key>` list of its own (which wins); unlisted keys repeat the trunk's last value (attention: full)
    mtp_layer_types: Mapping[str, str] = field(default_factory=dict)
    # transformers' conversion-mapping key for the block's checkpoint names, where not the block config's model_type
    # (a multimodal release's top-level type: its text config has none)
    block_conversions: str | None = None
    # config key whose value divides the head's input (a muP width multiplier); folded into the head at load
    logit_divisor_key: str | None = None
    # config key giving how many head rows are real tokens (a padded unembedding); the head keeps only those rows
    logit_rows_key: str | None = None
    # trunk norm weights the shared embedding passes through before the module's embed_norm (a trunk whose embedding
    # carries its own norm, as the engines run its MTP); folded into the embedding at load
    embed_trunk_norm: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exports:
    """What `recycle convert` builds on and writes (the converters read these, never `kind`)."""

    mtp_block: bool = True  # sequential modules with an embedding input, the block EAGLE, EAGLE-3 and GGUF are built on
    # already a drafter of its own target (reads the target's states, norm and head): convert takes `--target` as
    # its backbone, folds it into EAGLE-3 (converters/assistant.py) and builds Medusa heads at the target's width
    reads_target: bool = False
    # SGLang's stand-alone NextN draft class for this family (its `export_*_nextn.py` layout:
    # module 0 renamed to layer 0, `num_hidden_layers: 1`); None where SGLang has no such export.
    nextn_architecture: str | None = None
    # llama.cpp's names for the module and its hyper-parameters (`convert --to gguf`); None: no MTP graph there
    # that recycle writes for (recycle.ggufarch)
    gguf: GGUFArch | None = None
    # where gguf is None though llama.cpp has an MTP graph for the architecture: why recycle writes none (the
    # refusal's second sentence)
    gguf_why: str = ""
    # how many of the stored modules vLLM's MTP model for this family runs (None: every one it finds); where it is
    # fewer than the checkpoint stores, the conversion's notes (and so the model card) say so
    vllm_modules: int | None = None
    # what someone serving this family's MTP in vLLM must know, measured on vLLM 0.32 (docs/engines.md): the
    # overlay's note, and so the model card
    vllm_note: str = ""


@dataclass(frozen=True)
class Family:
    """One MTP layout, as data: its identity, and one record per concern (each reader reads the one it needs)."""

    name: str
    title: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    layout: ModuleLayout
    keys: ConfigKeys = field(default_factory=ConfigKeys)
    run: Runtime = field(default_factory=Runtime)
    exports: Exports = field(default_factory=Exports)
    kind: str = "mtp"  # "mtp" (sequential modules), "parallel_heads" (Meta), "drafter" (Gemma 4 assistant)
    notes: str = ""


RECORDS = {"layout": ModuleLayout, "keys": ConfigKeys, "run": Runtime, "exports": Exports}


def derive(base: Family, **changes) -> Family:
    """`base` with some fields changed: identity fields as given, a nested record's as a dict of its own fields
    (`derive(DEEPSEEK_V3, name="x", run=dict(mask_required=True), exports=dict(gguf=None))`)."""
    for group in RECORDS.keys() & changes.keys():
        if isinstance(changes[group], Mapping):
            changes[group] = dataclasses.replace(getattr(base, group), **changes[group])
    return dataclasses.replace(base, **changes)


DEEPSEEK_ROLES = {
    "embed_norm": ("model.layers.{layer}.enorm.weight",),
    "hidden_norm": ("model.layers.{layer}.hnorm.weight",),
    "proj": ("model.layers.{layer}.eh_proj.weight",),
    "final_norm": ("model.layers.{layer}.shared_head.norm.weight",),
    "head": ("model.layers.{layer}.shared_head.head.weight",),
    "embed": ("model.layers.{layer}.embed_tokens.weight",),
}
LLAMA_TRUNK = {"head": ("lm_head.weight", "model.embed_tokens.weight"), "embed": ("model.embed_tokens.weight",)}

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    title="DeepSeek-V3 / R1 / V3.1 (and GLM-4.7-Flash: MLA trunk)",
    model_types=("deepseek_v3", "glm4_moe_lite", "pangu_ultra_moe"),
    architectures=("DeepseekV3ForCausalLM",),
    layout=ModuleLayout(
        roles=DEEPSEEK_ROLES,
        block=("model.layers.{layer}.",),
        trunk=LLAMA_TRUNK,
        stores_copies=("embed", "head"),
    ),
    run=Runtime(
        block_class="transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer",
        zero_embed_at_pos0=True,
    ),
    exports=Exports(nextn_architecture="DeepseekV3ForCausalLMNextN", gguf=DEEPSEEK2),
    notes="MTP module k at model.layers.{L+k}; embed/head copies stored in the release",
)

FAMILIES: tuple[Family, ...] = (
    DEEPSEEK_V3,
    # V3.2 is V3's layout with the DSA indexer in the block's attention: only the block class differs.
    derive(
        DEEPSEEK_V3,
        name="deepseek_v32",
        title="DeepSeek-V3.2 (MLA + DSA indexer)",
        model_types=("deepseek_v32",),
        architectures=("DeepseekV32ForCausalLM",),
        run=dict(
            block_class="transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32DecoderLayer",
            mask_required=True,
        ),
        exports=dict(gguf=None),  # llama.cpp's deepseek32 graph has the indexer: not written by recycle yet
        notes="DeepSeek's layout; the block's attention carries the sparse-attention indexer (self_attn.indexer.*)",
    ),
    # GLM-4.5 stores DeepSeek-V3's layout: only its block class and its engines' names differ.
    derive(
        DEEPSEEK_V3,
        name="glm4_moe",
        title="GLM-4.5 / 4.6 / 4.7",
        model_types=("glm4_moe",),
        architectures=("Glm4MoeForCausalLM",),
        run=dict(block_class="transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer"),
        exports=dict(nextn_architecture="Glm4MoeForCausalLMNextN", gguf=GLM4MOE),
        notes="GLM-4.6 ships the MTP layer in mtp.safetensors without the embed/head copies",
    ),
    QWEN3_NEXT := Family(
        name="qwen3_next",
        title="Qwen3-Next",
        model_types=("qwen3_next",),
        architectures=("Qwen3NextForCausalLM",),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("mtp.pre_fc_norm_embedding.weight",),
                "hidden_norm": ("mtp.pre_fc_norm_hidden.weight",),
                "proj": ("mtp.fc.weight",),
                "final_norm": ("mtp.norm.weight",),
            },
            block=("mtp.layers.{k}.",),
            anchor="block",
            trunk={
                "head": ("lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
                "embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
            },
            block_shapes={**COMMON_BLOCK_SHAPES, "mlp.shared_expert_gate.weight": ("1", "H")},
        ),
        keys=ConfigKeys(depth_keys=("num_nextn_predict_layers", "mtp_num_hidden_layers"), default_depth=1),
        run=Runtime(
            norm="1+w",
            block_class="transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextDecoderLayer",
            chained_state="post_norm",
        ),
        exports=Exports(gguf=QWEN3NEXT),
        notes="fc and the pre-fc/final norms are shared by every depth; norms are zero-centred (1+w)",
    ),
    # Qwen3.5 / 3.6: Qwen3-Next's MTP layout over their own decoder layers (a gated full-attention layer with
    # a dense MLP, or the MoE one); released as the multimodal class (trunk under model.language_model.) or
    # text-only (Qwen3_5ForCausalLM, which vLLM and llama.cpp's converter also take).
    derive(
        QWEN3_NEXT,
        name="qwen3_5",
        title="Qwen3.5 / Qwen3.6 (dense)",
        model_types=("qwen3_5", "qwen3_5_text"),
        architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        layout=dict(block_shapes={k: v for k, v in COMMON_BLOCK_SHAPES.items() if k != "mlp.gate.weight"}),
        run=dict(block_class="transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5DecoderLayer"),
        exports=dict(gguf=QWEN35),
        notes="Qwen3-Next's mtp.* layout; the MTP layer is a gated full-attention layer with a dense MLP",
    ),
    derive(
        QWEN3_NEXT,
        name="qwen3_5_moe",
        title="Qwen3.5 / Qwen3.6 (MoE)",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        run=dict(block_class="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer"),
        exports=dict(gguf=QWEN35MOE),
        notes="Qwen3-Next's mtp.* layout; the MTP layer is a gated full-attention layer with the MoE MLP",
    ),
    Family(
        name="mimo",
        title="Xiaomi MiMo",
        model_types=("mimo",),
        architectures=("MiMoForCausalLM",),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp_layers.{k}.token_layernorm.weight",),
                "hidden_norm": ("model.mtp_layers.{k}.hidden_layernorm.weight",),
                "proj": ("model.mtp_layers.{k}.input_proj.weight",),
                "final_norm": ("model.mtp_layers.{k}.final_layernorm.weight",),
            },
            block=("model.mtp_layers.{k}.",),
            trunk=LLAMA_TRUNK,
        ),
        run=Runtime(
            concat_order="he",
            block_class="transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",
            block_model_type="qwen2",
            chained_state="post_norm",
            zero_embed_at_pos0=True,
        ),
        notes="hidden state first in the concat: input_proj(cat[hidden_layernorm(h), token_layernorm(e)])",
    ),
    Family(
        name="ernie4_5",
        title="Baidu ERNIE 4.5",
        model_types=("ernie4_5_moe", "ernie4_5"),
        architectures=("Ernie4_5_MoeForCausalLM", "Ernie4_5_ForCausalLM"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp_emb_norm.{k}.weight",),
                "hidden_norm": ("model.mtp_hidden_norm.{k}.weight",),
                "proj": ("model.mtp_linear_proj.{k}.weight",),
            },
            block=("model.mtp_block.{k}.",),
            trunk={**LLAMA_TRUNK, "final_norm": ()},
        ),
        run=Runtime(
            block_class="transformers.models.ernie4_5.modeling_ernie4_5.Ernie4_5DecoderLayer",
            block_model_type="ernie4_5",
            zero_embed_at_pos0=True,
        ),
        notes="no final norm before the shared lm_head (vLLM's reading)",
    ),
    Family(
        name="longcat_flash",
        title="Meituan LongCat-Flash",
        model_types=("longcat_flash",),
        architectures=("LongcatFlashForCausalLM", "LongcatCausalLM"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp.layers.{k}.enorm.m.weight",),
                "hidden_norm": ("model.mtp.layers.{k}.hnorm.m.weight",),
                "proj": ("model.mtp.layers.{k}.eh_proj.weight",),
                "final_norm": ("model.mtp.norm.weight",),
                "embed": ("model.mtp.embed_tokens.weight",),
            },
            block=("model.mtp.layers.{k}.",),
            anchor="embed_norm",  # its '.m.' norm: MiMo-V2-Flash stores eh_proj under the same prefix
            trunk=LLAMA_TRUNK,
            stores_copies=("embed",),
        ),
        run=Runtime(chained_state="post_norm"),
        notes="MLA attention with a dense MLP; note the extra '.m.' in enorm/hnorm",
    ),
    Family(
        name="nemotron_h",
        title="NVIDIA Nemotron-H (Nemotron 3 Super)",
        model_types=("nemotron_h", "nemotron_h_puzzle"),
        architectures=("NemotronHForCausalLM",),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("mtp.layers.{first}.enorm.weight",),
                "hidden_norm": ("mtp.layers.{first}.hnorm.weight",),
                "proj": ("mtp.layers.{first}.eh_proj.weight",),
                "final_norm": ("mtp.layers.{last}.final_layernorm.weight",),
            },
            block=("mtp.layers.{s}.",),
            trunk={"head": ("lm_head.weight",), "embed": ("backbone.embeddings.weight",)},
            prefixes=("", "language_model."),
            block_shapes={"mixer.gate.weight": ("E", "H"), "norm.weight": ("H",)},
        ),
        keys=ConfigKeys(
            sublayers=("mtp_hybrid_override_pattern", "mtp_layers_block_type"),
            expert_keys=("n_routed_experts", "mtp_n_routed_experts"),
        ),
        run=Runtime(chained_state="post_norm"),
        notes="module k = sublayers k·p .. k·p+p-1 of the MTP pattern (e.g. '*E': attention then MoE)",
    ),
    Family(
        name="minimax_m2",
        title="MiniMax-M2 / M2.5 / M2.7",
        model_types=("minimax_m2", "minimax"),
        architectures=("MiniMaxM2ForCausalLM",),
        layout=ModuleLayout(roles=DEEPSEEK_ROLES, block=("model.layers.{layer}.",), trunk=LLAMA_TRUNK),
        keys=ConfigKeys(depth_keys=("num_mtp_modules",), switch_key="use_mtp"),
        notes="config declares MTP (use_mtp, num_mtp_modules) but the public releases store none",
    ),
    Family(
        name="meta_mtp",
        title="Meta multi-token-prediction (parallel heads)",
        model_types=("llama_mtp",),
        architectures=(),
        layout=ModuleLayout(
            block=("extra_heads.{k}.",),
            anchor="block",
            trunk={"final_norm": ("norm.weight",), "head": ("output.weight",), "embed": ("tok_embeddings.weight",)},
            block_shapes={"attention_norm.weight": ("H",), "ffn_norm.weight": ("H",)},
            hf_layout=META_LLAMA,
        ),
        keys=ConfigKeys(depth_keys=("n_future_tokens",), depth_offset=-1, hidden_keys=("dim", "hidden_size")),
        run=Runtime(concat_order=None, block_class="transformers.models.llama.modeling_llama.LlamaDecoderLayer"),
        exports=Exports(mtp_block=False),
        kind="parallel_heads",
        notes="extra_heads.{k} are transformer blocks reading the trunk state in parallel; no embedding input",
    ),
    Family(
        name="gemma4_assistant",
        title="Gemma 4 assistant drafter (and the Gemma 4 unified assistant)",
        # the unified assistant (transformers' gemma4_unified_assistant) holds exactly these tensors
        model_types=("gemma4_assistant", "gemma4_unified_assistant"),
        architectures=("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM"),
        layout=ModuleLayout(
            roles={
                "proj": ("pre_projection.weight",),
                "final_norm": ("model.norm.weight",),
                "head": ("lm_head.weight",),
                "embed": ("model.embed_tokens.weight",),
            },
            block=("model.layers.{s}.", "post_projection.", "masked_embedding."),
            trunk={"head": ("model.embed_tokens.weight",)},
            shapes={"proj": ("H", "2Hb"), "final_norm": ("H",), "head": ("V", "H"), "embed": ("V", "H")},
        ),
        keys=ConfigKeys(depth_keys=(), sublayers=("num_hidden_layers",), backbone_keys=("backbone_hidden_size",)),
        exports=Exports(mtp_block=False, reads_target=True),
        kind="drafter",
        notes="already a drafter (Q-only layers attending the target's KV cache): drafts as it is; convert --to "
              "eagle3|medusa --target rewrites it",
    ),
    # -- deepseek_v4 (v4) --
    # DeepSeek-V4 as released: DeepSeek's own names (transformers renames them on load: conversion_mapping
    # "deepseek_v4"), trunk `embed`/`layers.{i}`/`hc_head_*`/`norm`/`head`, MTP module k at `mtp.{k}.`.
    Family(
        name="deepseek_v4",
        title="DeepSeek-V4 (Pro / Flash): hyper-connection streams, separate e/h projections",
        model_types=("deepseek_v4",),
        architectures=("DeepseekV4ForCausalLM",),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("mtp.{k}.enorm.weight",),
                "hidden_norm": ("mtp.{k}.hnorm.weight",),
                "e_proj": ("mtp.{k}.e_proj.weight",),
                "h_proj": ("mtp.{k}.h_proj.weight",),
                "hc_head_fn": ("mtp.{k}.hc_head_fn",),
                "hc_head_base": ("mtp.{k}.hc_head_base",),
                "hc_head_scale": ("mtp.{k}.hc_head_scale",),
                "final_norm": ("mtp.{k}.norm.weight",),
            },
            block=("mtp.{k}.",),
            anchor="e_proj",
            trunk={"head": ("head.weight",), "embed": ("embed.weight",)},
            shapes={"embed_norm": ("H",), "hidden_norm": ("H",), "e_proj": ("H", "H"), "h_proj": ("H", "H"),
                    "hc_head_fn": ("C", "C*H"), "hc_head_base": ("C",), "hc_head_scale": ("1",), "final_norm": ("H",),
                    "head": ("V", "H"), "embed": ("V", "H")},
            block_shapes={"attn_norm.weight": ("H",), "ffn_norm.weight": ("H",), "ffn.gate.weight": ("E", "H")},
        ),
        keys=ConfigKeys(dim_keys={"C": ("hc_mult",)}),
        run=Runtime(
            block_class="transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4DecoderLayer",
            zero_embed_at_pos0=True,
            attn_implementation="eager",  # V4 ships eager only (attention sinks; head_dim 512)
            runtime="deepseek_v4",
            # the releases' MTP layer: compress ratio 0 (sliding window only), a top-k routed MoE (hash routing is
            # the first trunk layers'); the config's `compress_ratios` past the trunk say so where present
            # (recycle.mtp.deepseek_v4)
            mtp_layer_types={"layer_types": "sliding_attention", "mlp_layer_types": "moe"},
        ),
        exports=Exports(gguf=DEEPSEEK4),
        notes="x = e_proj(enorm(e)) + h_proj(hnorm(h)) per stream, h = the trunk's hc_mult hyper-connection streams "
              "before its hc_head; a V4 block (mHC, compressed sparse attention, sinks, MoE), then the module's own "
              "hc_head and norm; embed and head are the trunk's. FP8 (e8m0 `.scale`) attention, FP4 routed experts",
    ),
    # -- mimo_v2_flash, mimo_v2, bailing_hybrid (mimo_ling) --
    MIMO_V2_FLASH := Family(
        name="mimo_v2_flash",
        title="Xiaomi MiMo-V2-Flash",
        model_types=("mimo_v2_flash",),
        architectures=("MiMoV2FlashForCausalLM",),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp.layers.{k}.enorm.weight",),
                "hidden_norm": ("model.mtp.layers.{k}.hnorm.weight",),
                "proj": ("model.mtp.layers.{k}.eh_proj.weight",),
                "final_norm": ("model.mtp.layers.{k}.final_layernorm.weight",),
            },
            block=("model.mtp.layers.{k}.",),
            anchor="embed_norm",  # plain enorm: LongCat stores eh_proj under the same prefix, with '.m.' norms
            trunk=LLAMA_TRUNK,
        ),
        # the config has no depth key; the releases store 3 modules. The release's own keys (the ones vLLM and
        # llama.cpp read) fill in what transformers' keys leave to the config class's defaults
        keys=ConfigKeys(default_depth=3, release_config="mimo_v2"),
        run=Runtime(
            block_class="transformers.models.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashDecoderLayer",
            chained_state="post_norm",
            attn_implementation="eager",  # attention sinks: the class has no sdpa path
            block_renames=(("pre_mlp_layernorm.", "post_attention_layernorm."),),  # attention_sink_bias: transformers'
            mtp_layer_types={"layer_types": "sliding_attention", "mlp_layer_types": "dense"},
        ),
        exports=Exports(
            vllm_modules=1,  # MiMoV2MultiTokenPredictor: num_mtp_layers = 1 (mimo_v2_mtp.py:177)
            vllm_note="vLLM 0.32 attends to `sliding_window_size` keys at a sliding layer, the query among them; "
                      "transformers and recycle, as the reference, to that many before the query (128 keys against "
                      "129 in the release; measured with the module on vLLM's CPU build, docs/engines.md)",
            gguf=MIMO2,  # q/k/v stacked into the fused attn_qkv the mimo2 MTP graph asserts (mimo2.cpp:285), which
            # llama.cpp's own export of V2-Flash leaves separate (llama-server then aborts drafting)
        ),
        notes="3 separately trained modules, each a sliding-window attention layer with sinks and a dense MLP; "
              "vLLM's MiMoV2MTP runs only module 0",
    ),
    derive(
        MIMO_V2_FLASH,
        name="mimo_v2",
        title="Xiaomi MiMo-V2.5 / V2.5-Pro (mimo_v2)",
        model_types=("mimo_v2",),
        architectures=("MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM"),
        # q, k and v fused into `qkv_proj`, pre-sharded in num_key_value_heads chunks of [Q_c | K_c | V_c]
        # (vLLM's _shard_fp8_qkv_proj); FP8 scales tiled per chunk where a chunk is not whole blocks
        layout=dict(fused=(Fused("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                 "num_key_value_heads"),)),
        # its config keys read as the row it derives from reads them (there is no transformers class for mimo_v2), its
        # GGUF side file as that row's; the vLLM note adds what vLLM does with the fused tensor in BF16 (measured)
        exports=dict(vllm_note=MIMO_V2_FLASH.exports.vllm_note + ". A fused qkv_proj stored in BF16 (stitch "
                               "--mtp-dtype bf16) vLLM 0.32 reads right only at --tensor-parallel-size = "
                               "num_key_value_heads (its MTP loader takes tensor-parallel-size chunks: at size 1, one "
                               "unsharded [Q|K|V], measured); the FP8 the releases ship, and stitch writes by default, "
                               "at any size"),
        notes="MiMo-V2-Flash's modules with q/k/v stored as one pre-sharded `qkv_proj`; the release's own config keys "
              "(transformers has no mimo_v2 class) read into transformers' MiMo-V2-Flash layers; vLLM's MiMoV2MTP "
              "runs only module 0",
    ),
    Family(
        name="bailing_hybrid",
        title="inclusionAI Ling-2.6 / Ling-3.0 (bailing_hybrid)",
        model_types=("bailing_hybrid",),
        architectures=("BailingHybridForCausalLM", "BailingMoeV3ForCausalLM", "BailingMoeV2_5ForCausalLM"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.layers.{layer}.enorm.weight",),
                "hidden_norm": ("model.layers.{layer}.hnorm.weight",),
                "proj": ("model.layers.{layer}.eh_proj.weight",),
                "final_norm": ("model.layers.{layer}.final_layernorm.weight",),
            },
            block=("model.layers.{layer}.",),
            anchor="final_norm",  # final_layernorm, where DeepSeek's layout stores shared_head.norm
            trunk={"head": ("lm_head.weight",), "embed": ("model.word_embeddings.weight",)},
        ),
        keys=ConfigKeys(depth_keys=("num_nextn_predict_layers", "num_mtp_layers")),
        run=Runtime(
            block_class="transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDecoderLayer",
            chained_state="post_norm",
            # transformers' own renames need the full name's leading dot; the block's names are relative to its prefix
            block_renames=(("attention.dense.", "self_attn.o_proj."), ("attention.", "self_attn."),
                           ("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias")),
        ),
        notes="MTP module k at model.layers.{L+k}: an MLA (gated) attention layer with the MoE MLP and its own "
              "final_layernorm; embedding and head are the trunk's (vLLM BailingMoeV3MTP). Ling-2.6's MLA has no "
              "g_proj: transformers' layer cannot run it",
    ),
    # glm_moe_dsa (GLM-5 / 5.1 / 5.2) and glm5_next (GLM-5.3-Flash): DeepSeek's NextN wrapper around GLM's DSA blocks
    derive(
        DEEPSEEK_V3,
        name="glm_moe_dsa",
        title="GLM-5 / 5.1 / 5.2 (MLA + DSA indexer)",
        model_types=("glm_moe_dsa",),
        architectures=("GlmMoeDsaForCausalLM",),
        layout=dict(stores_copies=()),
        run=dict(
            # GLM's indexer applies interleaved RoPE (V3.2's: half-split): past index_topk tokens the blocks differ
            block_class="transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaDecoderLayer",
            mask_required=True,
            # GLM-5.2's indexer_types marks trunk layers "shared" (reusing the previous top-k); the MTP layer stores and
            # runs its own indexer
            mtp_layer_types={"layer_types": "indexed_attention", "indexer_types": "full"},
        ),
        exports=dict(gguf=None),  # llama.cpp's glm-dsa converter writes the NextN tensors, its loader skips them
        notes="MTP module k at model.layers.{L+k} without embed/head copies; GLM-5.2's one layer was trained as 7 "
              "recurrent steps (chain it deeper than stored)",
    ),
    Family(
        name="glm5_next",
        title="GLM-5.3-Flash (glm5_next)",
        model_types=("glm5_next", "glm5_next_text"),
        architectures=("Glm5NextForConditionalGeneration",),
        layout=ModuleLayout(
            roles={role: tuple("model.language_model." + t[len("model."):] for t in ts)
                   for role, ts in DEEPSEEK_ROLES.items()},
            block=("model.language_model.layers.{layer}.",),
            trunk={"head": ("lm_head.weight", "model.language_model.embed_tokens.weight"),
                   "embed": ("model.language_model.embed_tokens.weight",)},
        ),
        run=Runtime(
            zero_embed_at_pos0=True,
            # transformers' Glm5NextTextDecoderLayer always mixes hyper-connection streams; the MTP layer has none: its
            # block is composed of that model file's attention, MoE and norms with a plain residual
            block_class="recycle.mtp.blocks.Glm5NextPlainDecoderLayer",
            mask_required=True,
            mtp_layer_types={"layer_types": "indexed_attention", "mlp_layer_types": "sparse", "indexer_types": "full"},
        ),
        notes="MTP module k at model.language_model.layers.{L+k}: DeepSeek's NextN wrapper around a plain-residual "
              "NoPE-MLA + k-pool DSA + MoE block (no hyper-connections), run as transformers' Glm5Next attention "
              "and MoE composed with a plain residual (recycle/mtp/blocks.py)",
    ),
    # -- minimax_m3, inkling (m3_inkling) --
    # MiniMax-M3 (transformers' minimax_m3_vl): the text model under `language_model.model.`, MTP module k at
    # `language_model.model.mtp.layers.{k}.` around a `transformer_layer.` (vLLM's MiniMaxM3MTP, rtp-llm); a
    # standalone MTP export (`minimax_m3_mtp`) drops the `language_model.` prefix.
    Family(
        name="minimax_m3",
        title="MiniMax-M3 (minimax_m3_vl)",
        model_types=("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3", "minimax_m3_mtp"),
        architectures=("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM",
                       "MiniMaxM3VLForCausalLM", "MiniMaxM3MTP"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp.layers.{k}.enorm.weight",),
                "hidden_norm": ("model.mtp.layers.{k}.hnorm.weight",),
                "proj": ("model.mtp.layers.{k}.eh_proj.weight",),
                "final_norm": ("model.mtp.layers.{k}.final_layernorm.weight",),
            },
            block=("model.mtp.layers.{k}.transformer_layer.",),
            trunk={"head": ("lm_head.weight",), "embed": ("model.embed_tokens.weight",)},
            prefixes=("language_model.", ""),
            block_shapes={"input_layernorm.weight": ("H",), "post_attention_layernorm.weight": ("H",),
                          "block_sparse_moe.gate.weight": ("E", "H")},
        ),
        keys=ConfigKeys(depth_keys=("num_mtp_modules",), switch_key="use_mtp", expert_keys=("num_local_experts",)),
        run=Runtime(
            norm="1+w",
            block_class="transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLDecoderLayer",
            block_model_type="minimax_m3_vl_text",
            zero_embed_at_pos0=True,
            # the conversion's MoE and indexer renames are anchored on a leading '.', which block-relative names lack
            block_renames=(("block_sparse_moe.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
                           ("block_sparse_moe.", "mlp."), ("self_attn.index_", "self_attn.indexer.")),
            # vLLM builds the MTP layer with force_sparse_attn and force_moe, whatever the trunk's last layer is
            mtp_layer_types={"layer_types": "minimax_m3_sparse", "mlp_layer_types": "sparse"},
            block_conversions="minimax_m3_vl",
        ),
        notes="enorm/hnorm/final_layernorm zero-centred (1+w); the block is sparse (MSA indexer) attention + MoE; "
              "whether the public MiniMax-M3 weights ship these modules is disputed (rtp-llm loads module 0, a "
              "deployment note finds none in the NVFP4 export)",
    ),
    # Inkling (transformers' inkling_mm_model): trunk `model.llm.*` (embed, embed_norm, layers, norm, unembed), MTP
    # module k at `model.mtp.layers.{k}.` with the decoder block nested under `transformer_block.`; the count and
    # the optional shared chain norm are in config.json's top-level `mtp_config`.
    Family(
        name="inkling",
        title="Thinking Machines Inkling",
        model_types=("inkling_mm_model", "inkling_text"),
        architectures=("InklingForConditionalGeneration", "InklingForCausalLM"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.mtp.layers.{k}.embed_norm.weight",),
                "hidden_norm": ("model.mtp.layers.{k}.hidden_norm.weight",),
                "proj": ("model.mtp.layers.{k}.input_proj.weight",),
                "final_norm": ("model.mtp.chain_norm.weight",),  # only with mtp_config.chain_hidden_post_norm
            },
            block=("model.mtp.layers.{k}.transformer_block.",),
            trunk={"head": ("model.llm.unembed.weight",), "embed": ("model.llm.embed.weight",), "final_norm": ()},
            block_shapes={"attn_norm.weight": ("H",), "mlp_norm.weight": ("H",)},
        ),
        keys=ConfigKeys(
            depth_keys=("num_mtp_layers", "mtp_config.num_nextn_predict_layers"),
            expert_keys=("n_routed_experts",),
            # with these, the text config's own mtp_layer_types marks mtp_config.local_layer_ids "hybrid_sliding"
            block_config_keys={"num_mtp_layers": "mtp_config.num_nextn_predict_layers",
                               "mtp_local_layer_ids": "mtp_config.local_layer_ids"},
        ),
        run=Runtime(
            concat_order="he",
            block_class="transformers.models.inkling.modeling_inkling.InklingDecoderLayer",
            block_model_type="inkling_text",
            # transformers' MtpModel, vLLM, SGLang: the chain norm's output (or the raw block's)
            chained_state="post_norm",
            block_renames=(("attn.q_norm.", "self_attn.q_norm."), ("attn.k_norm.", "self_attn.k_norm."),
                           ("attn.k_sconv.", "self_attn.k_sconv.conv1d."),
                           ("attn.v_sconv.", "self_attn.v_sconv.conv1d."),
                           ("attn.rel_logits_proj.", "self_attn.rel_logits_proj.")),
            # transformers' mtp_layer_types / mtp_mlp_layer_types without mtp_config.local_layer_ids: full attention
            # with its short convolutions ("hybrid", whose cache layer holds conv states), a dense MLP
            mtp_layer_types={"layer_types": "hybrid", "mlp_layer_types": "dense"},
            block_conversions="inkling_mm_model",
            logit_divisor_key="logits_mup_width_multiplier",
            logit_rows_key="unpadded_vocab_size",
            embed_trunk_norm=("model.llm.embed_norm.weight",),
        ),
        notes="hidden state first; the head is the trunk's unembed on h / logits_mup_width_multiplier, sliced to "
              "unpadded_vocab_size; the embedding passes the trunk's embed_norm first, as vLLM and SGLang run it "
              "(transformers' MtpModel drops it); no final norm unless mtp_config.chain_hidden_post_norm",
    ),
    # -- step3p7, mellum (step_mellum) --
    # Step-3.5-Flash (text-only, step3p5) and Step-3.7-Flash (step3p7: that text model under text_config, plus a
    # vision tower): DeepSeek's NextN wrapper at model.layers.{L+k} with the module's own head
    # (modeling_step3p7.py, vLLM step3p5_mtp.py).
    Family(
        name="step3p7",
        title="StepFun Step-3.5-Flash / Step-3.7-Flash",
        model_types=("step3p7", "step3p5"),
        architectures=("Step3p7ForConditionalGeneration", "Step3p5ForCausalLM"),
        layout=ModuleLayout(
            roles={
                "embed_norm": ("model.layers.{layer}.enorm.weight",),
                "hidden_norm": ("model.layers.{layer}.hnorm.weight",),
                "proj": ("model.layers.{layer}.eh_proj.weight",),
                # released under `transformer.`; vLLM's loader also takes them without it
                "final_norm": ("model.layers.{layer}.transformer.shared_head.norm.weight",
                               "model.layers.{layer}.shared_head.norm.weight"),
                "head": ("model.layers.{layer}.transformer.shared_head.output.weight",
                         "model.layers.{layer}.shared_head.output.weight"),
            },
            block=("model.layers.{layer}.",),
            trunk={"head": ("lm_head.weight",), "embed": ("model.embed_tokens.weight",)},
            stores_copies=("head",),
            block_shapes={"input_layernorm.weight": ("H",), "post_attention_layernorm.weight": ("H",)},
        ),
        keys=ConfigKeys(
            depth_keys=("num_nextn_predict_layers", "num_mtp_layers"),
            default_depth=3,  # the releases store 3 modules (layers 45-47)
            config_counts_mtp=True,
        ),
        run=Runtime(
            norm="1+w",  # Step3p7RMSNorm: (1 + w)·x̂, as vLLM's GemmaRMSNorm
            block_class="transformers.models.step3p7.modeling_step3p7.Step3p7DecoderLayer",
            # vLLM's Step3p5MTP (and NeMo's trainer): the block's output goes on to the next module before the
            # module's own shared_head.norm, and position 0 keeps its embedding; transformers' MtpModel chains the
            # normed state and reads the trunk's lm_head instead (it also misses the `transformer.` names): recycle
            # follows the engine
            chained_state="pre_norm",
        ),
        exports=Exports(
            gguf=STEP35,
            vllm_note="vLLM 0.32 cannot serve these modules on any device: its Step3p5MTP indexes the config's "
                      "layer_types past the trunk's layers, which its config class cut off (step3p5.py:421; open "
                      "upstream as vllm#49642); and its Step model hands a state-reading drafter (Medusa, EAGLE) the "
                      "state before the final norm. llama.cpp's step35 graph runs all three modules (--to gguf)",
        ),
        notes="3 separately trained modules; each block is a dense sliding-window (or full) Step layer (gated GQA, "
              "q/k norms; moe_layers_enum lists trunk layers only) with the release's per-layer config entries for "
              "its index; its own head transformer.shared_head.output (released as a copy of lm_head; after the trunk "
              "moves, the module's own is what the engine reads); llama.cpp's step35 graph drafts with all three in turn",
    ),
    # Mellum2: Qwen3-Next's mtp.* names over Mellum's sliding-window MoE layer, with plain `w` norms where Qwen3-Next's
    # are zero-centred: the names alone cannot tell the two apart (config.json's model_type does)
    derive(
        QWEN3_NEXT,
        name="mellum",
        title="JetBrains Mellum2",
        model_types=("mellum",),
        architectures=("MellumForCausalLM",),
        layout=dict(block_shapes=COMMON_BLOCK_SHAPES),
        keys=dict(depth_keys=("num_nextn_predict_layers", "num_mtp_layers")),
        run=dict(
            norm="w",  # MellumRMSNorm: w·x̂
            block_class="transformers.models.mellum.modeling_mellum.MellumDecoderLayer",
            # MellumConfig's defaults
            mtp_layer_types={"layer_types": "sliding_attention", "mlp_layer_types": "sparse"},
        ),
        exports=dict(gguf=None),  # llama.cpp runs Mellum2 without its MTP layer
        notes="one sliding-window MoE MTP layer; fc and the pre-fc/final norms as Qwen3-Next's, norms plain (w)",
    ),
)

BY_NAME = {f.name: f for f in FAMILIES}

# Releases (by model_type) that store no MTP module: what each offers instead (a separate drafter model, an
# in-checkpoint drafter of another kind, or nothing), said in one line when one is given to recycle.
_GEMMA4 = ("Gemma 4 ships its MTP drafter as a separate assistant model (model_type gemma4_assistant, e.g. "
           "google/gemma-4-E2B-it-assistant): pass that directory")
NO_MTP = {"gemma4": _GEMMA4, "gemma4_text": _GEMMA4}
# -- m3_inkling: releases that store no MTP --
_GEMMA4_UNIFIED = ("Gemma 4 unified ships its MTP drafter as a separate assistant model (model_type "
                   "gemma4_unified_assistant): pass that directory")
_KIMI = ("Kimi K2 / K2.5 / K2.6 store no MTP module (their DeepSeek-V3 text model declares num_nextn_predict_layers "
         "0) and ship no drafter: there is nothing to convert")
_HUNYUAN = ("Hunyuan-A13B stores no MTP module and ships no drafter: there is nothing to convert (Tencent's "
            "releases with MTP layers are Hy3/Hy4, model_type hy_v3/hy_v4, another layout)")
_INKLING2 = ("Inkling 2 stores no MTP module (unlike Inkling, its config has no mtp_config) and ships no drafter: "
             "there is nothing to convert")
NO_MTP |= {"gemma4_unified": _GEMMA4_UNIFIED, "gemma4_unified_text": _GEMMA4_UNIFIED,
           "kimi_k25": _KIMI, "kimi_k2": _KIMI, "hunyuan_v1_moe": _HUNYUAN,
           "inkling2": _INKLING2, "inkling2_text": _INKLING2}


@dataclass
class MTPModule:
    """Module k of a checkpoint: role → stored tensor names, and what it borrows from the trunk."""

    index: int
    prefix: str
    roles: dict[str, list[str]]
    shared: dict[str, str | None]  # role -> trunk tensor used instead of a stored copy (None: none found)
    block_prefixes: list[str]

    @property
    def names(self) -> list[str]:
        return [n for names in self.roles.values() for n in names]

    def tensor(self, role: str) -> str | None:
        """The weight (not scale) tensor that fills a single-tensor role, stored or shared."""
        own = [n for n in self.roles.get(role, []) if not n.endswith((SCALE_SUFFIX, NATIVE_SCALE_SUFFIX))]
        return own[0] if own else self.shared.get(role)

    def block_names(self) -> dict[str, str]:
        """Block tensors keyed by their name relative to the block prefix (as a decoder layer sees it).

        A module spanning several prefixes (Nemotron-H's sublayers, Gemma 4's layers) would repeat
        relative names, so there the key is `{i}.{relative}`, i the prefix's position: the names an
        nn.ModuleList of the sublayers sees.
        """
        several = len(self.block_prefixes) > 1
        out = {}
        for name in self.roles.get("block", []):
            for i, p in enumerate(self.block_prefixes):
                if name.startswith(p):
                    out[f"{i}.{name[len(p):]}" if several else name[len(p):]] = name
                    break
        return out


@dataclass
class MTPMatch:
    """The result of matching a checkpoint against the family table."""

    family: Family
    outer_prefix: str
    config: dict  # text config, merged over the top level
    declared: int
    modules: list[MTPModule]
    config_match: bool
    # one line when the tensors match this row while config.json's model_type/architectures name another row or
    # none (`match(..., strict=True)` raises it; inspect reports it as an error)
    conflict: str | None = None

    @property
    def mtp_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for m in self.modules:
            seen.update(dict.fromkeys(m.names))
        return list(seen)

    def dims(self) -> dict[str, int]:
        """Symbols the shape specs use: H, V, E, Hb and the row's `dim_keys` (those the config gives)."""
        keys, cfg = self.family.keys, self.config
        out = {}
        for sym, names in (("H", keys.hidden_keys), ("V", keys.vocab_keys), ("E", keys.expert_keys),
                           ("Hb", keys.backbone_keys), *keys.dim_keys.items()):
            v = first_value(cfg, names)
            if isinstance(v, int) and not isinstance(v, bool):
                out[sym] = v
        return out


def first_value(cfg: Mapping, keys: tuple[str, ...]):
    """The value of the first key present; a dotted key reads a nested block (Inkling's `mtp_config.*`)."""
    for k in keys:
        v: object = cfg
        for part in k.split("."):
            v = v.get(part) if isinstance(v, Mapping) else None
        if v is not None:
            return v
    return None


def merged_config(config: Mapping) -> dict:
    """Top-level config with the language model's config (`text_config`: Qwen3.5, Gemma 4;
    `llm_config`: NVIDIA's VL wrappers) laid over it."""
    text = config.get("text_config") or config.get("llm_config")
    return {**config, **text} if isinstance(text, Mapping) else dict(config)


def eval_shape(spec: tuple[str, ...], dims: Mapping[str, int]) -> tuple[int, ...] | None:
    """("H", "2H", "C*H") → (H, 2H, C·H); None when a symbol is unknown for this config."""
    out = []
    for term in spec:
        size = 1
        for factor in term.split("*"):
            m = re.fullmatch(r"(\d*)([A-Za-z]*)", factor)
            sym = m.group(2)
            if sym and sym not in dims:
                return None
            size *= (int(m.group(1)) if m.group(1) else 1) * (dims[sym] if sym else 1)
        out.append(size)
    return tuple(out)


def declared_depth(family: Family, cfg: Mapping) -> int:
    keys = family.keys
    if keys.switch_key and cfg.get(keys.switch_key) is False:
        return 0
    v = first_value(cfg, keys.depth_keys)
    return max(0, int(v) + keys.depth_offset) if isinstance(v, int) else keys.default_depth


def _sublayers(family: Family, cfg: Mapping) -> int:
    v = first_value(cfg, family.keys.sublayers)
    if isinstance(v, (str, list, tuple)):
        return max(1, len(v))
    return int(v) if isinstance(v, int) and v > 0 else 1


class NameIndex:
    """A checkpoint's tensor names, sorted once, so the names under a prefix are a binary search away: the
    matcher's cost grows with the names it returns, not with rows × prefixes × every stored name (DeepSeek-V3
    stores 91,991)."""

    def __init__(self, names) -> None:
        self.order = {n: i for i, n in enumerate(names)}
        self.sorted = sorted(self.order)

    def __contains__(self, name: str) -> bool:
        return name in self.order

    def under(self, prefixes, skip=frozenset()) -> list[str]:
        """Every name that starts with one of `prefixes`, not in `skip`, in the checkpoint's own order."""
        found: set[str] = set()
        for pf in prefixes:
            i = bisect.bisect_left(self.sorted, pf)
            while i < len(self.sorted) and self.sorted[i].startswith(pf):
                found.add(self.sorted[i])
                i += 1
        return sorted(found - set(skip), key=self.order.__getitem__)


def _modules(names: NameIndex, family: Family, outer: str, cfg: Mapping, limit: int) -> list[MTPModule]:
    trunk_layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layers") or 0)
    p = _sublayers(family, cfg)
    modules = []
    used: set[str] = set()  # anchor tensors of earlier modules
    for k in range(limit):
        ctx = {"k": k, "layer": trunk_layers + k, "first": k * p, "last": k * p + p - 1}
        roles: dict[str, list[str]] = {}
        for role, templates in family.layout.roles.items():
            for t in templates:
                name = outer + t.format(**ctx)
                if name in names:
                    roles[role] = [name] + [s for s in scale_names(name) if s in names][:1]
                    break
        prefixes = [outer + t.format(s=s, **ctx) for t in family.layout.block for s in range(k * p, k * p + p)]
        prefixes = list(dict.fromkeys(prefixes))
        claimed = {n for ns in roles.values() for n in ns}
        block = names.under(prefixes, claimed)
        if block:
            roles["block"] = block
        # A module needs an anchor tensor of its own: templates without {k} (Gemma's pre_projection,
        # Qwen's shared mtp.fc) match again at every k and must not conjure further modules.
        anchor = set(roles.get(family.layout.anchor, ()))
        if not anchor - used:
            break
        used |= anchor
        shared = {}
        for role in SHARED_ROLES:
            if role not in roles and role in family.layout.trunk:
                shared[role] = next((outer + t for t in family.layout.trunk[role] if outer + t in names), None)
        first_name = next(iter(roles[family.layout.anchor]))
        prefix = next((pf for pf in prefixes if first_name.startswith(pf)), prefixes[0])
        modules.append(MTPModule(k, prefix, roles, shared, prefixes))
    return modules


def config_rows(model_type: str, archs: set[str]) -> list[Family]:
    """The rows that list this config's model_type or one of its architectures."""
    return [f for f in FAMILIES if model_type in f.model_types or archs & set(f.architectures)]


def _conflict(ckpt: Checkpoint, fam: Family, model_type: str, archs: set[str]) -> str:
    said = ", ".join([f"model_type '{model_type}'"] * bool(model_type) + [f"architectures {sorted(archs)}"] * bool(archs))
    others = [f.name for f in config_rows(model_type, archs)]
    whose = f"which is the {'/'.join(others)} row's" if others else "which no row of recycle's family table lists"
    return (f"{ckpt.path}: its MTP tensor names match the {fam.name} row ({fam.title}) but config.json says "
            f"{said or 'nothing (no model_type, no architectures)'}, {whose}: a wrong row makes a silently wrong "
            f"drafter; pass --family {fam.name} if the tensors are right (or --family NAME of the right row)")


def match(ckpt: Checkpoint, family: str | None = None, *, strict: bool = True) -> MTPMatch:
    """Find the family whose layout the checkpoint holds, and its MTP modules.

    Detection is by the tensors present (a module exists when its anchor tensor is stored); the
    config's `model_type`/`architectures` break ties and name the family when no module is stored.
    Raises RecycleError when nothing in the table fits, or a release is known to store no MTP, and (with
    `strict`, unless `family` names the row) when the tensors match a row the config does not name: the
    conflict is in the result's `conflict` either way.
    """
    family = family or ckpt.family
    cfg = merged_config(ckpt.config)
    model_type = str(cfg.get("model_type", ckpt.config.get("model_type", "")))
    archs = set(ckpt.config.get("architectures") or [])
    if family and family not in BY_NAME:
        raise RecycleError(f"--family {family}: unknown family '{family}' (known: {', '.join(BY_NAME)})")
    candidates = [BY_NAME[family]] if family else list(FAMILIES)
    best: MTPMatch | None = None
    names = NameIndex(ckpt.tensors)
    for fam in candidates:
        config_match = model_type in fam.model_types or bool(archs & set(fam.architectures))
        declared = declared_depth(fam, cfg)
        for outer in fam.layout.prefixes:
            mods = _modules(names, fam, outer, cfg, limit=max(declared, 0) + 64)
            if not mods and not config_match:
                continue
            m = MTPMatch(fam, outer, cfg, declared, mods, config_match)
            key = (bool(mods), config_match, len(mods))
            if best is None or key > (bool(best.modules), best.config_match, len(best.modules)):
                best = m
            if mods:
                break
    if best is None:
        what = model_type or ",".join(sorted(archs)) or "no model_type"
        if model_type in NO_MTP:
            raise RecycleError(f"{ckpt.path}: {model_type} stores no MTP modules; {NO_MTP[model_type]}")
        raise RecycleError(
            f"{ckpt.path}: unknown layout ({what}): no MTP family in the table fits its config or tensor names"
        )
    if family is None and best.modules and not best.config_match:
        best.conflict = _conflict(ckpt, best.family, model_type, archs)
        if strict:
            raise RecycleError(best.conflict)
    return best
