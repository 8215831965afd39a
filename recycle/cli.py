"""The `recycle` command line: parse flags into the command's options object (`recycle.options`), call the
library, render (`recycle.report`, or --json); `report.user_errors` turns bad input into one line and exit 2.

Every flag is declared once, in `recycle.flags`; the heavy libraries are imported only after the checks that
need none of them, so bad input fails in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from recycle import __version__
from recycle import flags as f
from recycle.errors import RecycleError
from recycle.preflight import DEFAULT_SHARD_SIZE
from recycle.report import EXIT_FINDINGS, JsonErrors, conventional_help, note, print_json, user_errors

conventional_help()
app = typer.Typer(help="Turn the Multi-Token-Prediction modules of open checkpoints into speculative-decoding drafters.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown", cls=JsonErrors)


@app.callback(invoke_without_command=True)
def main(version: Annotated[bool, f.opt("--version", help="Print the version and exit.")] = False) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


@app.command()
@user_errors
def inspect(
    ckpt: f.CkptArg,
    json_out: f.Json = False,
    stats: f.Stats = False,
    show_all: f.ShowAll = False,
    strict: f.Strict = False,
) -> None:
    """Audit the MTP weights of a checkpoint: family, layout, shapes, dtypes, FP8 scales, health.

    Reads safetensors headers (and a 64-row sample of stored embedding/head copies) unless --stats is given;
    never writes. Stale copies (the trunk moved after its MTP modules were trained) and declared-but-missing
    modules are findings.

    Example: `recycle inspect fixtures/deepseek_v3_mtp --stats`; a GGUF file (`recycle inspect model.gguf`): its
    architecture, declared and stored MTP blocks and their tensor types (--stats does not apply).
    """
    from recycle.preflight import checkpoint_dir

    if str(ckpt).endswith(".gguf") and not Path(ckpt).is_dir():  # llama.cpp's files: their header, no weights
        from recycle.gguf_file import inspect_gguf
        from recycle.report import render_gguf

        data = inspect_gguf(ckpt)
        print_json(data) if json_out else render_gguf(data)
        if strict and data["worst"] == "error":
            raise typer.Exit(EXIT_FINDINGS)
        return
    checkpoint_dir(ckpt)
    from recycle.audit import inspect_checkpoint
    from recycle.report import Reporter, render_inspect

    with Reporter("reading MTP tensors", quiet=json_out or not stats) as bar:
        data = inspect_checkpoint(ckpt, stats=stats, progress=bar.update).to_json()
    print_json(data) if json_out else render_inspect(data, show_all)
    if strict and data["worst"] == "error":
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
@user_errors
def convert(
    ckpt: f.CkptArg,
    to: f.To,
    output: f.Output = None,
    heads: f.Heads = None,
    draft_vocab: f.DraftVocab = None,
    vocab_corpus: f.VocabCorpus = None,
    eagle3_attention: f.Eagle3Attention = None,
    eagle3_mlp: f.Eagle3Mlp = None,
    dtype: f.StorageDtype = "bf16",
    layouts: f.Layouts = None,
    calibrate: f.Calibrate = None,
    calibrate_steps: f.CalibrateSteps = None,
    target: f.CalibrationTarget = None,
    data: f.CalibrationData = None,
    module: f.Module = None,
    eagle3_names: f.Eagle3Names = None,
    max_shard_size: f.MaxShardSize = DEFAULT_SHARD_SIZE,
    overwrite: f.Overwrite = False,
    json_out: f.Json = False,
) -> None:
    """Turn a checkpoint's MTP modules into a speculative-decoding drafter directory.

    Reads only the MTP tensors (and the trunk's embedding/head when a module stores none), writes atomically
    (nothing appears unless everything was written), never touches the source.

    Example: `recycle convert fixtures/deepseek_v3_mtp --to eagle -o /tmp/ds-eagle`
    llama.cpp: `recycle convert fixtures/glm4_moe_mtp --to gguf -o /tmp/glm-mtp` writes mtp.gguf for `-md`.
    """
    from recycle.options import ConvertOptions
    from recycle.preflight import parse_tokens

    opts = ConvertOptions(source=str(ckpt), to=to, out=f.output_path(output, ckpt, to), heads=heads,
                          draft_vocab=draft_vocab, vocab_corpus=str(vocab_corpus) if vocab_corpus else None,
                          dtype=dtype, overwrite=overwrite, layouts=layouts, eagle3_attention=eagle3_attention,
                          eagle3_mlp=eagle3_mlp,
                          calibrate=parse_tokens(calibrate, "--calibrate") if calibrate else None,
                          calibrate_steps=calibrate_steps,
                          target=str(target) if target else None, data=data, module=module, eagle3_names=eagle3_names,
                          max_shard_size=max_shard_size)
    opts.validate()
    from recycle.converters.api import convert as run
    from recycle.report import Reporter, render_convert

    with Reporter("writing tensors", quiet=json_out) as bar:
        data_out = run(opts, bar.update)
    print_json(data_out) if json_out else render_convert(data_out)


@app.command()
@user_errors
def stitch(
    overlay: f.OverlayArg,
    target: f.Target = None,
    target_pos: f.OldTargetArg = None,
    output: f.Output = None,
    mtp_dtype: f.MtpDtype = "auto",
    max_shard_size: f.MaxShardSize = DEFAULT_SHARD_SIZE,
    overwrite: f.Overwrite = False,
    json_out: f.Json = False,
) -> None:
    """Write a copy of the target whose MTP tensors are the overlay's (for vLLM's method "mtp").

    Untouched shards are hard-linked (same filesystem; copied otherwise), shards holding MTP tensors are
    rewritten, the modules' embedding/head copies are the target's own; the target is never modified. An
    overlay whose hidden size, vocabulary or tokenizer differs from the target's is refused.

    Example: `recycle stitch /tmp/ds-eagle/mtp_overlay --target fixtures/deepseek_v3_mtp -o /tmp/ds-stitched`
    """
    from recycle.options import StitchOptions

    target = f.renamed(target, target_pos, "--target TARGET_DIR", "TARGET_DIR as a second argument")
    if target is None:
        raise RecycleError("--target TARGET_DIR: the checkpoint to stitch the modules into")
    opts = StitchOptions(overlay=str(overlay), target=str(target), out=f.output_path(output, target, "stitched"),
                         overwrite=overwrite, mtp_dtype=mtp_dtype, max_shard_size=max_shard_size)
    opts.validate()
    from recycle.converters.overlay import stitch as run
    from recycle.report import Reporter, render_stitch

    with Reporter("stitching", quiet=json_out) as bar:
        data = run(opts.overlay, opts.target, opts.out, overwrite=overwrite, progress=bar.update,
                   mtp_dtype=opts.mtp_dtype, max_shard_size=opts.max_shard_size)
    print_json(data) if json_out else render_stitch(data)


def _bench_options(drafter, target, prompts, quick, max_new_tokens, precision, dtype, **kw):
    from recycle.options import BenchOptions
    from recycle.preflight import model_dir
    from recycle.prompts import default_prompts, prompt_set

    if target is None:
        raise RecycleError("--target TARGET_DIR: the model to decode")
    model_dir(target)
    limit = 4 if quick else None
    chosen = prompt_set(prompts, limit) if prompts is not None else (default_prompts()[:limit] if quick else None)
    opts = BenchOptions(drafter=str(drafter) if drafter is not None else None, target=str(target), prompts=chosen,
                        max_new_tokens=max_new_tokens, precision=f.renamed(precision, dtype, "--precision", "--dtype")
                        or "fp32", **kw)
    opts.validate()
    return opts


@app.command()
@user_errors
def bench(
    drafter: f.DrafterArg = None,
    target: f.Target = None,
    prompts: f.Prompts = None,
    chat_template: f.ChatTemplate = None,
    max_new_tokens: f.MaxNew = None,
    quick: f.Quick = False,
    temperature: f.Temperature = 0.0,
    tree: f.Tree = None,
    device: f.Device = None,
    precision: f.Precision = None,
    dtype: f.OldDtype = None,
    native_mtp: f.NativeMtp = False,
    compare_hf: f.CompareHf = False,
    seed: f.Seed = 0,
    repeats: f.Repeats = 1,
    threads: f.Threads = None,
    json_out: f.Json = False,
    save: f.Save = False,
) -> None:
    """Measure speculative decoding with a drafter against plain autoregressive decoding of the target.

    Greedy output is checked token for token against AR decoding; τ, acceptance by depth, target forwards,
    draft/verify time, tokens/s, measured and cost-model speedup are reported, with their spread over prompts.

    Example: `recycle bench /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --quick`
    Chat: `--prompts chats.jsonl` (messages / conversations rows) renders each through the assistant's turn prompt.
    """
    new = max_new_tokens if max_new_tokens is not None else (64 if quick else 128)
    opts = _bench_options(drafter, target, prompts, quick, new, precision, dtype,
                          temperature=temperature, tree=tree, device=device, native=native_mtp, compare_hf=compare_hf,
                          seed=seed, repeats=repeats, save=save, chat_template=chat_template)
    from recycle.bench import run_bench, set_threads
    from recycle.report import Reporter, render_bench

    set_threads(threads)
    with Reporter("loading") as bar:
        data = run_bench(opts, progress=lambda i, n, label: bar.update(i, n, description=label, force=True,
                                                                      line=f"{label}: prompt {i}/{n}"))
    print_json(data) if json_out else render_bench(data)


@app.command()
@user_errors
def plan(
    drafter: f.DrafterArg = None,
    target: f.Target = None,
    prompts: f.Prompts = None,
    chat_template: f.ChatTemplate = None,
    gpus: f.Gpus = "H100,H200,A100,L40S,RTX4090",
    batch_sizes: f.BatchSizes = None,
    old_batch: f.OldBatchSizes = None,
    context: f.Context = 2048,
    model_config: f.ModelConfig = None,
    max_chain: f.MaxChain = 8,
    max_new_tokens: f.MaxNew = 64,
    device: f.Device = None,
    precision: f.Precision = None,
    dtype: f.OldDtype = None,
    native_mtp: f.NativeMtp = False,
    plot_out: f.Plot = None,
    threads: f.Threads = None,
    json_out: f.Json = False,
) -> None:
    """Choose the number of speculative tokens and the tree from measured acceptance, and predict the speedup
    across batch sizes and GPUs (roofline of the target's config).

    Measures per prompt set the drafter's per-depth acceptance along its longest chain and a few trees, the
    draft cost per step and the verification cost of 1 … 32 tokens; predicts τ and speedup for chain:1 … 8 and
    the trees, recommends one per set with the reason, and tables (and plots) the speedup per GPU and batch size.

    Example: `recycle plan /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --gpu H100,L40S --plot plan.png`
    """
    from recycle.options import PlanOptions, parse_batch_sizes

    bench_opts = _bench_options(drafter, target, prompts, False, max_new_tokens, precision, dtype, device=device,
                                native=native_mtp, chat_template=chat_template)
    sizes = f.renamed(batch_sizes, old_batch, "--batch-sizes", "--batch (plan)")
    opts = PlanOptions(bench=bench_opts, gpus=[g for g in gpus.split(",") if g.strip()],
                       batches=parse_batch_sizes("1,8,32,128" if sizes is None else sizes), context=context,
                       max_chain=max_chain,
                       model_config=model_config, plot=str(plot_out) if plot_out is not None else None)
    opts.validate()
    from recycle.bench import set_threads
    from recycle.plan import run_plan
    from recycle.report import Reporter, render_plan

    set_threads(threads)
    with Reporter("measuring") as bar:
        data = run_plan(opts, progress=lambda i, n, label: bar.update(i, n, description=label, force=True,
                                                                     line=f"plan: {label} ({i}/{n})"))
    print_json(data) if json_out else render_plan(data)


@app.command()
@user_errors
def push(
    drafter: f.PushDrafterArg,
    repo: f.Repo,
    private: f.Private = False,
    revision: f.Revision = None,
    commit_message: f.CommitMessage = None,
    base_model: f.BaseModel = None,
    license: f.License = None,
    dry_run: f.DryRun = False,
    card_out: f.CardOut = None,
    json_out: f.Json = False,
) -> None:
    """Validate a drafter directory, write its model card and upload both to the Hub in one commit.

    The layout must match the format recycle.json declares and every weight must be finite, or nothing is sent.
    The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT picks the Hub. The drafter directory is never
    modified.

    Example: `recycle push /tmp/ds-eagle --repo me/ds-eagle --dry-run --card-out /tmp/README.md`
    """
    from recycle.options import PushOptions

    opts = PushOptions(drafter=str(drafter), repo=repo, private=private, revision=revision,
                       commit_message=commit_message, base_model=base_model, license=license, dry_run=dry_run,
                       card_out=str(card_out) if card_out is not None else None)
    opts.validate()
    from recycle.hub import push_drafter
    from recycle.report import Reporter, render_push

    if json_out:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    with Reporter("checking tensors", quiet=json_out) as bar:
        data = push_drafter(opts, bar.update)
    print_json(data) if json_out else render_push(data)


@app.command()
@user_errors
def distill(
    drafter: f.DistillDrafterArg,
    target: f.Target = None,
    tokens: f.Tokens = None,
    data: f.Data = None,
    self_distill: f.SelfDistill = False,
    prompt_len: f.PromptLen = 64,
    sd_temperature: f.SdTemperature = 0.0,
    chat_template: f.ChatTemplate = None,
    save_regenerated: f.SaveRegenerated = None,
    output: f.Output = None,
    old_output: f.OldOutput = None,
    resume: f.Resume = False,
    cache_hidden: f.CacheHidden = None,
    online: f.Online = None,
    seq_len: f.SeqLen = 256,
    batch: f.Batch = 8,
    lr: f.Lr = 5e-4,
    draft_steps: f.DraftSteps = None,
    ce_weight: f.CeWeight = 0.1,
    kl_weight: f.KlWeight = 1.0,
    feature_weight: f.FeatureWeight = 0.0,
    step_decay: f.StepDecay = 0.8,
    init: f.Init = "recycled",
    freeze: f.Freeze = None,
    micro_batch: f.MicroBatch = None,
    activation_checkpointing: f.ActivationCheckpointing = False,
    checkpoint_every: f.CheckpointEvery = 50,
    eval_every: f.EvalEvery = 25,
    device: f.Device = None,
    precision: f.TrainPrecision = None,
    seed: f.Seed = 0,
    threads: f.Threads = None,
    overwrite: f.DistillOverwrite = False,
    memory_plan: f.MemoryPlan = False,
    world_size: f.WorldSize = None,
    gpu: f.TrainGpu = None,
    json_out: f.Json = False,
) -> None:
    """Distill a drafter against its frozen target to an exact token budget; writes the same format.

    A drafter converted from a base checkpoint re-aligns to a post-trained or fine-tuned build of it: it takes
    that target's embedding and LM head, learns on --data, is judged on held-out text of the same data, and the
    best held-out snapshot is written (never one worse than the input).

    Example: `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 64k -o /tmp/ds-eagle-64k`
    Chat: `--data chats.jsonl` (OpenAI messages or ShareGPT rows) renders with the target's chat template and
    trains on the assistant tokens only; add --self-distill to let the target write each assistant turn.
    Memory first: `recycle distill SOURCE_OR_DRAFTER --target T --plan --gpu H100 --world-size 8 --freeze experts`
    """
    from recycle.options import DistillOptions, LossConfig
    from recycle.preflight import parse_tokens

    if target is None:
        raise RecycleError("--target TARGET_DIR: the model to distill against")
    if tokens is None and not memory_plan:
        raise RecycleError("--tokens N: the budget in target tokens is required (e.g. --tokens 1M)")
    opts = DistillOptions(
        drafter=str(drafter), target=str(target), tokens=parse_tokens(tokens or "1"),
        out=f.output_path(f.renamed(output, old_output, "-o/--output", "--out"), drafter, "distilled"), data=data,
        self_distill=self_distill, prompt_len=prompt_len, sd_temperature=sd_temperature, seq_len=seq_len, batch=batch,
        lr=lr, draft_steps=draft_steps, loss=LossConfig(ce_weight, kl_weight, feature_weight, step_decay), init=init,
        freeze=tuple((freeze or "").split(",")), micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing, checkpoint_every=checkpoint_every, eval_every=eval_every,
        resume=resume,
        cache_hidden=str(cache_hidden) if cache_hidden else None, device=device, precision=precision, seed=seed,
        threads=threads, overwrite=overwrite, online=online, chat_template=chat_template,
        save_regenerated=save_regenerated)
    if memory_plan:
        from recycle.distill.memory import check, for_options
        from recycle.report import render_memory

        p = for_options(opts, world_size or int(os.environ.get("WORLD_SIZE", "1")), gpu)
        print_json(p.as_dict()) if json_out else render_memory(p.as_dict())
        return check(p)  # a plan that does not fit: its advice, exit 2
    opts.validate()
    from recycle.distill.train import distill as run
    from recycle.report import DISTILL_COLUMNS, Reporter, distill_progress, render_distill

    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports and writes
        run(opts, log=note)
        return
    with Reporter("distilling", DISTILL_COLUMNS, total=opts.tokens, tps="-", loss="-", agree="-") as bar:
        data_out = run(opts, progress=distill_progress(bar, opts.tokens)[0], log=note)
    print_json(data_out) if json_out else render_distill(data_out)


@app.command()
@user_errors
def harvest(
    target: f.Target = None,
    target_pos: f.OldTargetArg = None,
    tokens: f.Tokens = ...,
    output: f.Output = None,
    drafter: f.HarvestDrafter = None,
    data: f.Data = None,
    seq_len: f.SeqLen = 256,
    batch: f.Batch = 8,
    seed: f.Seed = 0,
    self_distill: f.SelfDistill = False,
    prompt_len: f.PromptLen = 64,
    sd_temperature: f.SdTemperature = 0.0,
    chat_template: f.ChatTemplate = None,
    tensor_parallel_size: f.TensorParallel = 1,
    pipeline_parallel_size: f.PipelineParallel = 1,
    data_parallel_size: f.DataParallel = 1,
    gpu_memory_utilization: f.GpuMemoryUtilization = None,
    overwrite: f.Overwrite = False,
    json_out: f.Json = False,
) -> None:
    """Compute the target's features for a distillation in vLLM, ahead of it, for targets no training process
    holds: vLLM's parallelism spreads the target; distill then reads the cache.

    The windows are exactly those `recycle distill` with the same --tokens/--data/--seq-len/--batch/--seed reads;
    vLLM runs in the environment recycle manages (built on first use): its CUDA build in bf16 where torch sees a GPU,
    its CPU build in fp32 elsewhere.

    Example: `recycle harvest --target fixtures/deepseek_v3_mtp --tokens 64k -o /tmp/ds-cache`, then
    `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 64k --cache-hidden /tmp/ds-cache`
    """
    from recycle.options import HarvestOptions
    from recycle.preflight import drafter_dir, output_dir, parse_tokens

    target = f.renamed(target, target_pos, "--target TARGET_DIR", "TARGET_DIR as an argument")
    if target is None:
        raise RecycleError("--target TARGET_DIR: the model vLLM runs")
    parallel = {k: v for k, v in (("tensor_parallel_size", tensor_parallel_size),
                                  ("pipeline_parallel_size", pipeline_parallel_size),
                                  ("data_parallel_size", data_parallel_size)) if v != 1}
    opts = HarvestOptions(target=str(target), out=f.output_path(output, target, "cache"), tokens=parse_tokens(tokens), data=data, seq_len=seq_len,
                          batch=batch, seed=seed, overwrite=overwrite, parallel=parallel, self_distill=self_distill,
                          prompt_len=prompt_len, sd_temperature=sd_temperature, chat_template=chat_template,
                          gpu_memory_utilization=gpu_memory_utilization)
    if drafter is not None:  # an input too: -o is not the drafter, inside it or around it
        output_dir(opts.out, opts.overwrite, (*opts.inputs(), drafter))
    opts.validate()
    if drafter is not None:
        drafter_dir(drafter)
        from recycle.formats import aux_layers_of

        opts.aux_layers = aux_layers_of(drafter, target)
    from recycle.distill.harvest import harvest as run
    from recycle.report import Reporter, render_harvest

    if not json_out:
        note("harvest: running the target in vLLM (engine start: about a minute on a CPU)")
    with Reporter("writing cache", quiet=json_out) as bar:
        data_out = run(opts, progress=bar.counter("harvest: {n} cache files written"))
    print_json(data_out) if json_out else render_harvest(data_out)


if __name__ == "__main__":
    app()
