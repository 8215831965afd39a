"""The command-line flags that several commands share, declared once (name, help, metavar): the same flag means
the same thing in every command, and a choice list is shown as one (`[eagle|eagle3|medusa]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from recycle.formats import convertible
from recycle.options import DTYPES as DTYPE_NAMES

FORMATS = f"[{'|'.join(convertible())}]"
DTYPES = f"[{'|'.join(DTYPE_NAMES)}]"


def opt(*names: str, help: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help, **kw)


DEPRECATED: list[str] = []  # notes the CLI prints once the command has succeeded (a refusal stays one line)


def renamed(new_value, old_value, new: str, old: str):
    """A hidden old flag still works, with a one-line deprecation note."""
    if old_value is None:
        return new_value
    DEPRECATED.append(f"{old} is deprecated; use {new}")
    return old_value


def output_path(given: Path | None, source: Path, suffix: str) -> str:
    """-o, or ./SOURCE-suffix in the current directory (the same rule in every command that writes)."""
    return str(given) if given is not None else str(Path.cwd() / f"{Path(source).resolve().name}-{suffix}")


# -- flags shared by several commands ---------------------------------------------------------------
Json = Annotated[bool, opt("--json", help="Print one JSON object instead of the report.")]
Overwrite = Annotated[bool, opt("--overwrite", help="Replace an existing output directory that recycle wrote (or "
                                 "an empty one).")]
Output = Annotated[Path | None, opt("-o", "--output", help="Output directory (default: ./INPUT-SUFFIX here; it must "
                                     "not exist, see --overwrite).", metavar="OUT_DIR")]
Target = Annotated[Path | None, opt("--target", help="Target model directory.", metavar="TARGET_DIR")]
DrafterArg = Annotated[Path | None, typer.Argument(help="Drafter directory (from `recycle convert` or `distill`), or the "
                                                   "target directory itself to draft with its own MTP modules.",
                                                   metavar="DRAFTER_DIR")]
Tokens = Annotated[str, opt("--tokens", help="Budget in target tokens read: 64k, 2M, 1.5B ...")]
Data = Annotated[str | None, opt("--data", help="Text file, JSONL/JSON rows ('text', OpenAI 'messages' or ShareGPT "
                                  "'conversations'), directory of text files, a saved `datasets` dataset, or hf:NAME "
                                  "(a dataset in the local datasets cache, offline); its tail is held out. Or a "
                                  "corpus: stdlib (default) or py:PACKAGE (an installed package's source). "
                                  "Conversations render with the target's chat template; only assistant tokens count.")]
ChatTemplate = Annotated[str | None, opt("--chat-template", help="A Jinja chat template file, used in place of the "
                                          "target tokenizer's own (needed for conversations when it has none).")]
SaveRegenerated = Annotated[str | None, opt("--save-regenerated", help="With --self-distill on conversations: append "
                                            "each regenerated conversation to this JSONL (reuse it as --data).")]
SeqLen = Annotated[int, opt("--seq-len", help="Tokens per packed sequence.")]
Batch = Annotated[int, opt("--batch", help="Sequences per optimizer step and rank.")]
Seed = Annotated[int, opt("--seed", help="Seed for the data order (and initialisation, sampling).")]
SelfDistill = Annotated[bool, opt("--self-distill", help="The target writes each sequence after its first "
                                   "--prompt-len tokens (its own distribution); on conversations, every assistant "
                                   "turn, turn by turn.")]
PromptLen = Annotated[int, opt("--prompt-len", help="Self-distillation prompt tokens per sequence.")]
SdTemperature = Annotated[float, opt("--sd-temperature", help="Self-distillation sampling temperature (0: greedy).")]
Device = Annotated[str | None, opt("--device", help="Default: cuda when available.", metavar="[cpu|cuda]")]
Precision = Annotated[str | None, opt("--precision", help="Compute dtype.", metavar=DTYPES)]
OldDtype = Annotated[str | None, opt("--dtype", hidden=True, help="Old name of --precision.")]
Threads = Annotated[int | None, opt("--threads", help="torch CPU threads (default: torch's choice).")]
Prompts = Annotated[str | None, opt("--prompts", help='JSONL, one {"prompt": "..."} or conversation ("messages" / '
                                     '"conversations", rendered with the chat template up to the assistant turn) '
                                     'per line (a "set" field groups them); or a corpus: stdlib (held-out code + '
                                     "English, the default) or py:PACKAGE.")]
Tree = Annotated[str | None, opt("--tree", help="chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or a JSON list of "
                                  "Medusa-style paths (or a file holding one).")]
MaxNew = Annotated[int | None, opt("--max-new-tokens", help="New tokens per prompt.")]
NativeMtp = Annotated[bool, opt("--native-mtp", help="Draft with the target's own MTP modules.")]


# -- inspect ---------------------------------------------------------------------------------------------------
CkptArg = Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).", metavar="CKPT_DIR")]
Stats = Annotated[bool, opt("--stats", help="Also read the MTP tensors: finite, all-zero, RMS, norms.")]
ShowAll = Annotated[bool, opt("--all", help="With --stats: one row per tensor.")]
Strict = Annotated[bool, opt("--strict", help="Exit 1 when a finding is an error (for CI); bad input stays exit 2.")]

# -- convert ---------------------------------------------------------------------------------------------------
To = Annotated[str, opt("--to", help="Drafter format.", metavar=FORMATS)]
Heads = Annotated[int | None, opt("--heads", help="--to medusa: heads (default 3).")]
DraftVocab = Annotated[int | None, opt("--draft-vocab", help="--to eagle3: draft vocabulary size (the top-N corpus "
                                       "tokens; default: the full vocabulary).")]
VocabCorpus = Annotated[Path | None, opt("--vocab-corpus", help="--to eagle3: text to count tokens in (default: "
                                         "recycle's stdlib corpus).")]
Eagle3Attention = Annotated[str | None, opt("--eagle3-attention", help="--to eagle3: llama (default; every engine) or "
                                            "mla (MLA sources: vLLM's DeepSeek EAGLE-3, which pairs with MLA targets on "
                                            "vLLM's CPU backend).", metavar="[llama|mla]")]
Eagle3Mlp = Annotated[str | None, opt("--eagle3-mlp", help="--to eagle3 with --calibrate: wide (the default for a "
                                      "MoE block: the target's dense width, the shared expert plus the routed experts "
                                      "picked most often, then fitted) or shared (the shared expert's width).",
                                      metavar="[shared|wide]")]
StorageDtype = Annotated[str, opt("--dtype", help="Storage dtype of the output (--to gguf also q8_0: llama.cpp's "
                                 "8-bit blocks, the head and embeddings kept f16).", metavar=DTYPES)]
Layouts = Annotated[str | None, opt("--layouts", help="--to eagle: comma list of recycle, nextn, overlay (default: "
                                    "all three).")]
Calibrate = Annotated[str | None, opt("--calibrate", help="--to medusa: fit each ResBlock to the source head on this "
                                      "many tokens (e.g. 64k) instead of the identity. --to eagle3: fit the folded "
                                      "midlayer to the MTP module on them.", metavar="TOKENS")]
CalibrateSteps = Annotated[int | None, opt("--calibrate-steps", help="With --calibrate: optimizer steps of the fit "
                                           "(fewer: faster, looser; default: Medusa 400, EAGLE-3 one per 80 tokens "
                                           "and at least 400, e.g. 1,600 for 128k).")]
CalibrationTarget = Annotated[Path | None, opt("--target", help="With --calibrate: the model whose states the heads "
                                               "read (default: the checkpoint). From a Gemma 4 assistant: the model it "
                                               "drafts for. --to gguf: the trunk GGUF the side file pairs with (its "
                                               "header and token_embd are copied).", metavar="TARGET")]
Eagle3Names = Annotated[str | None, opt("--eagle3-names", help="--to eagle3: tensor names for official (midlayer.*: "
                                        "vLLM, SGLang, SpecForge; the default) or speculators (layers.0.*: vLLM, "
                                        "speculators).", metavar="[official|speculators]")]
Module = Annotated[int | None, opt("--module", help="--to gguf: the MTP module to write (llama.cpp drafts with one; "
                                    "needed when the checkpoint has several).")]
CalibrationData = Annotated[str | None, opt("--data", help="With --calibrate: calibration text, as distill's --data.")]

MaxShardSize = Annotated[str, opt("--max-shard-size", help="Split each safetensors file larger than this into shards "
                                  "with an index (huggingface_hub's naming: model-00001-of-00003.safetensors; every "
                                  "engine and recycle command reads either form); none: one file each.",
                                  metavar="SIZE")]

# -- stitch, harvest: the target's old place -------------------------------------------------------------------
OldTargetArg = Annotated[Path | None, typer.Argument(hidden=True, help="Old place of --target.")]
MtpDtype = Annotated[str, opt("--mtp-dtype", help="Into a quantized target: auto writes the MTP weights in its "
                              "scheme (block FP8: re-quantized, fresh scales); bf16 keeps them BF16 and adds them to "
                              "its ignore list.", metavar="[auto|bf16]")]
OverlayArg = Annotated[Path, typer.Argument(help="An MTP overlay directory (OUT/mtp_overlay from convert --to eagle or "
                                            "distill).", metavar="OVERLAY_DIR")]

# -- bench, plan -----------------------------------------------------------------------------------------------
Quick = Annotated[bool, opt("--quick", help="The first 4 prompts, 64 new tokens: a look in about a minute.")]
Temperature = Annotated[float, opt("--temperature", help="0: greedy; > 0: lossless speculative sampling.")]
CompareHf = Annotated[bool, opt("--compare-hf", help="Also time transformers' generate: plain, use_mtp, assistant_model= "
                                "(a Gemma 4 assistant) and prompt lookup.")]
Repeats = Annotated[int, opt("--repeats", help="Time each prompt N times per decoder, keep the fastest; the report "
                               "gives the spread over the N.")]
Save = Annotated[bool, opt("--save", help="Also write the --json report as DRAFTER_DIR/bench.json, which `recycle "
                           "push` puts in the model card (not with native MTP: recycle never writes into a target).")]
Gpus = Annotated[str, opt("--gpu", help="GPUs for the roofline, comma-separated (H100, H200, H100-PCIe, A100, "
                          "A100-40GB, L40S, L4, RTX4090).")]
BatchSizes = Annotated[str | None, opt("--batch-sizes", help="Batch sizes for the roofline table [default: "
                                       "1,8,32,128].")]
OldBatchSizes = Annotated[str | None, opt("--batch", hidden=True, help="Old name of --batch-sizes.")]
Context = Annotated[int, opt("--context", help="Tokens cached per sequence in the roofline.")]
ModelConfig = Annotated[str | None, opt("--model-config", help="Roofline this config.json instead of the target's (the "
                                        "full-size model a stand-in was measured for).")]
MaxChain = Annotated[int, opt("--max-chain", help="Longest chain measured (shorter ones are derived).")]
Plot = Annotated[Path | None, opt("--plot", help="Write speedup against batch size (PNG).", metavar="OUT.png")]

# -- push ------------------------------------------------------------------------------------------------------
PushDrafterArg = Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert` or `recycle distill`).",
                                                metavar="DRAFTER_DIR")]
Repo = Annotated[str, opt("--repo", help="Hub repository, OWNER/NAME (created if missing).", metavar="OWNER/NAME")]
Private = Annotated[bool, opt("--private", help="Create the repository private.")]
Revision = Annotated[str | None, opt("--revision", help="Branch to commit to (created if missing; default main).")]
CommitMessage = Annotated[str | None, opt("--commit-message", help="Commit summary.")]
BaseModel = Annotated[str | None, opt("--base-model", help="Hub id of the target model for the card's base_model.")]
License = Annotated[str | None, opt("--license", help="Hub license id for the card (default: from the source's "
                                    "config, README or LICENSE).")]
DryRun = Annotated[bool, opt("--dry-run", help="Validate, write the card and list the files; upload nothing.")]
CardOut = Annotated[Path | None, opt("--card-out", help="Also write the model card here (outside the drafter "
                                     "directory); --dry-run prints it otherwise.")]

# -- distill ---------------------------------------------------------------------------------------------------
DistillDrafterArg = Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert`, or a Gemma 4 "
                                                   "assistant: re-aligned in its own layout).", metavar="DRAFTER_DIR")]
OldOutput = Annotated[Path | None, opt("--out", hidden=True, help="Old name of --output.")]
Resume = Annotated[bool, opt("--resume", help="Continue from the last checkpoint in OUT.distill/.")]
CacheHidden = Annotated[Path | None, opt("--cache-hidden", help="Store/reuse the target's features per batch here; a "
                                         "`recycle harvest` cache is read without loading the target.",
                                         metavar="CACHE_DIR")]
Online = Annotated[int | None, opt("--online", help="Harvest in vLLM while training, at most N steps' windows ahead in "
                                   "--cache-hidden (disk stays flat); the target is never loaded here. Under torchrun vLLM runs "
                                   "beside rank 0.", metavar="N")]
Lr = Annotated[float, opt("--lr", help="Peak AdamW learning rate.")]
DraftSteps = Annotated[int | None, opt("--draft-steps", help="Unrolled draft steps (default 3; Medusa: its heads).")]
CeWeight = Annotated[float, opt("--ce-weight", help="Weight of CE to the data label.")]
KlWeight = Annotated[float, opt("--kl-weight", help="β: weight of KL(P_target ‖ P_draft).")]
FeatureWeight = Annotated[float, opt("--feature-weight", help="Smooth-L1 feature regression (EAGLE).")]
StepDecay = Annotated[float, opt("--step-decay", help="Weight of draft step k ∝ decay^k.")]
MemoryPlan = Annotated[bool, opt("--plan", help="Print the per-rank memory by part (weights, grads, optimizer, "
                                 "teacher, activations) from the configs alone, and whether it fits --gpu; loads and "
                                 "trains nothing (--tokens not needed).")]
WorldSize = Annotated[int | None, opt("--world-size", help="With --plan: the ranks to plan for (default: "
                                      "WORLD_SIZE, else 1).")]
TrainGpu = Annotated[str | None, opt("--gpu", help="With --plan: the GPU to fit (H100, H200, A100, L40S, ...).")]
MicroBatch = Annotated[int | None, opt("--micro-batch", help="Rows per forward/backward; the step's "
                                      "gradient accumulates over them, so --batch is the step and memory follows this.")]
ActivationCheckpointing = Annotated[bool, opt("--activation-checkpointing", help="EAGLE drafters: recompute each "
                                             "draft step's decoder layer in backward instead of keeping its "
                                             "activations (one more forward of each layer; --plan shows what "
                                             "it saves).")]
Freeze = Annotated[str | None, opt("--freeze", metavar="GROUP,...", help="Parameter groups that stay as they are: "
                                  "experts, shared_experts, router, mlp, attention, norms, projection (e.g. --freeze experts: "
                                  "DeepSeek-V3's drafter then trains 0.34B of its 11.6B parameters).")]
Init = Annotated[str, opt("--init", help="The converted weights, or re-initialised (the same architecture).",
                          metavar="[recycled|scratch]")]
CheckpointEvery = Annotated[int, opt("--checkpoint-every", help="Steps between checkpoints.")]
EvalEvery = Annotated[int, opt("--eval-every", help="Steps between held-out agreement checks.")]
TrainPrecision = Annotated[str | None, opt("--precision", help="Compute dtype (default: bf16 on CUDA and CPUs with "
                                           "native bf16, else fp32).", metavar="[bf16|fp32]")]
DistillOverwrite = Annotated[bool, opt("--overwrite", help="Replace OUT and any earlier run's checkpoint.")]

# -- harvest ---------------------------------------------------------------------------------------------------
HarvestDrafter = Annotated[Path | None, opt("--drafter", help="The drafter the cache is for: an EAGLE-3 directory's "
                                            "aux layers are harvested too.", metavar="DRAFTER_DIR")]
TensorParallel = Annotated[int, opt("--tensor-parallel-size", help="vLLM's own.")]
PipelineParallel = Annotated[int, opt("--pipeline-parallel-size", help="vLLM's own.")]
DataParallel = Annotated[int, opt("--data-parallel-size", help="vLLM's own.")]
GpuMemoryUtilization = Annotated[float | None, opt("--gpu-memory-utilization", help="vLLM's own: its share of each "
                                                   "device's memory (default 0.9 on GPUs, 0.5 of RAM on CPUs).")]
