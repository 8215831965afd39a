"""The `recycle` command line: parse flags into the command's options object (`recycle.options`), call the
library, render (`recycle.report`, or --json); `report.user_errors` turns bad input into one line and exit 2.

Every flag is declared once, on the options field it sets (`recycle.options`; `f.options` makes a command's
parameters from those fields) or in `recycle.flags`; the heavy libraries are imported only after the checks that
need none of them, so bad input fails in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from recycle import __version__
from recycle import flags as f
from recycle.errors import RecycleError
from recycle.options import (
    BenchOptions,
    ConvertOptions,
    DistillOptions,
    HarvestOptions,
    PlanOptions,
    PushOptions,
    StitchOptions,
    TeacherServeOptions,
)
from recycle.preflight import parse_tokens
from recycle.report import EXIT_FINDINGS, JsonErrors, conventional_help, note, print_json, user_errors

conventional_help()
app = typer.Typer(help="Turn the Multi-Token-Prediction modules of open checkpoints into speculative-decoding drafters.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown", cls=JsonErrors)


@app.callback(invoke_without_command=True)
def main(version: f.Version = False) -> None:
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
    family: f.Family = None,
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
        data = inspect_checkpoint(ckpt, stats=stats, progress=bar.update, family=family).to_json()
    print_json(data) if json_out else render_inspect(data, show_all)
    if strict and data["worst"] == "error":
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
@user_errors
@f.options(ConvertOptions, "source to out heads draft_vocab vocab_corpus eagle3_attention eagle3_mlp dtype layouts "
           "calibrate calibrate_steps target data module eagle3_names family max_shard_size overwrite json_out")
def convert(opts: ConvertOptions, json_out: f.Json = False) -> None:
    """Turn a checkpoint's MTP modules into a speculative-decoding drafter directory.

    Reads only the MTP tensors (and the trunk's embedding/head when a module stores none), writes atomically
    (nothing appears unless everything was written), never touches the source.

    Example: `recycle convert fixtures/deepseek_v3_mtp --to eagle -o /tmp/ds-eagle`
    llama.cpp: `recycle convert fixtures/glm4_moe_mtp --to gguf -o /tmp/glm-mtp` writes mtp.gguf for `-md`.
    """
    opts.out = f.output_path(opts.out, opts.source, opts.to)
    opts.validate()
    from recycle.converters.api import convert as run
    from recycle.distill.calibrate import calibrate as calibrator
    from recycle.report import Reporter, render_convert

    with Reporter("writing tensors", quiet=json_out) as bar:
        data_out = run(opts, bar.update, calibrator)
    print_json(data_out) if json_out else render_convert(data_out)


@app.command()
@user_errors
@f.options(StitchOptions, "overlay target out mtp_dtype max_shard_size overwrite json_out")
def stitch(opts: StitchOptions, json_out: f.Json = False) -> None:
    """Write a copy of the target whose MTP tensors are the overlay's (for vLLM's method "mtp").

    Untouched shards are hard-linked (same filesystem; copied otherwise), shards holding MTP tensors are
    rewritten, the modules' embedding/head copies are the target's own; the target is never modified. An
    overlay whose hidden size, vocabulary or tokenizer differs from the target's is refused.

    Example: `recycle stitch /tmp/ds-eagle/mtp_overlay --target fixtures/deepseek_v3_mtp -o /tmp/ds-stitched`
    """
    if opts.target is None:
        raise RecycleError("--target TARGET_DIR: the checkpoint to stitch the modules into")
    opts.out = f.output_path(opts.out, opts.target, "stitched")
    opts.validate()
    from recycle.converters.overlay import stitch as run
    from recycle.report import Reporter, render_stitch

    with Reporter("stitching", quiet=json_out) as bar:
        data = run(opts.overlay, opts.target, opts.out, overwrite=opts.overwrite, progress=bar.update,
                   mtp_dtype=opts.mtp_dtype, max_shard_size=opts.max_shard_size)
    print_json(data) if json_out else render_stitch(data)


def _ready(opts: BenchOptions, quick: bool = False) -> None:
    """bench's and plan's checks before any loading: the target, the prompts (--quick: the first 4), the rest."""
    from recycle.preflight import model_dir
    from recycle.prompts import default_prompts, prompt_set

    if opts.target is None:
        raise RecycleError("--target TARGET_DIR: the model to decode")
    model_dir(opts.target)
    limit = 4 if quick else None
    opts.prompts = (prompt_set(opts.prompts, limit) if opts.prompts is not None
                    else default_prompts()[:limit] if quick else None)
    opts.precision = opts.precision or "fp32"
    opts.validate()


@app.command()
@user_errors
@f.options(BenchOptions, "drafter target prompts chat_template max_new_tokens quick temperatures tree device precision "
           "draft_samples native compare_hf seed repeats threads json_out save context_buckets context_prompts data")
def bench(opts: BenchOptions, quick: f.Quick = False, threads: f.Threads = None, json_out: f.Json = False) -> None:
    """Measure speculative decoding with a drafter against plain autoregressive decoding of the target.

    Greedy output is checked token for token against AR decoding; τ, acceptance by depth, target forwards,
    draft/verify time, tokens/s, measured and cost-model speedup are reported, with their spread over prompts.

    Example: `recycle bench /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --quick`
    Chat: `--prompts chats.jsonl` (messages / conversations rows) renders each through the assistant's turn prompt.
    """
    if opts.max_new_tokens is None:
        opts.max_new_tokens = 64 if quick else 128
    _ready(opts, quick)
    from recycle.bench import run_bench, set_threads
    from recycle.report import Reporter, render_bench

    set_threads(threads)
    with Reporter("loading") as bar:
        data = run_bench(opts, progress=lambda i, n, label: bar.update(i, n, description=label, force=True,
                                                                      line=f"{label}: prompt {i}/{n}"))
    print_json(data.to_json()) if json_out else render_bench(data)


@app.command()
@user_errors
@f.options(PlanOptions, "drafter target prompts chat_template gpus batches context model_config max_chain "
           "max_new_tokens temperatures device precision native plot threads json_out", max_new_tokens=64)
def plan(opts: PlanOptions, threads: f.Threads = None, json_out: f.Json = False) -> None:
    """Choose the number of speculative tokens and the tree from measured acceptance, and predict the speedup
    across batch sizes and GPUs (roofline of the target's config).

    Measures per prompt set the drafter's per-depth acceptance along its longest chain and a few trees, the
    draft cost per step and the verification cost of 1 … 32 tokens; predicts τ and speedup for chain:1 … 8 and
    the trees, recommends one per set with the reason, and tables (and plots) the speedup per GPU and batch size.

    Example: `recycle plan /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --gpu H100,L40S --plot plan.png`
    """
    _ready(opts.bench)
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
@f.options(PushOptions, "drafter repo private revision commit_message base_model license dry_run card_out json_out")
def push(opts: PushOptions, json_out: f.Json = False) -> None:
    """Validate a drafter directory, write its model card and upload both to the Hub in one commit.

    The layout must match the format recycle.json declares and every weight must be finite, or nothing is sent.
    The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT picks the Hub. The drafter directory is never
    modified.

    Example: `recycle push /tmp/ds-eagle --repo me/ds-eagle --dry-run --card-out /tmp/README.md`
    """
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
@f.options(DistillOptions, "drafter target tokens data self_distill prompt_len sd_temperature chat_template "
           "save_regenerated out resume cache_hidden follow online seq_len packing curriculum batch lr draft_steps ce_weight "
           "kl_weight "
           "feature_weight decay loss temperature init freeze micro_batch activation_checkpointing checkpoint_every eval_every teacher "
           "teacher_ahead device "
           "nccl_timeout precision seed threads overwrite memory_plan world_size gpu host_ram gpus_per_node json_out")
def distill(opts: DistillOptions, memory_plan: f.MemoryPlan = False, world_size: f.WorldSize = None,
            gpu: f.TrainGpu = None, json_out: f.Json = False) -> None:
    """Distill a drafter against its frozen target to an exact token budget; writes the same format.

    A drafter converted from a base checkpoint re-aligns to a post-trained or fine-tuned build of it: it takes
    that target's embedding and LM head, learns on --data, is judged on held-out text of the same data, and the
    best held-out snapshot is written (never one worse than the input).

    Example: `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 64k -o /tmp/ds-eagle-64k`
    Chat: `--data chats.jsonl` (OpenAI messages or ShareGPT rows) renders with the target's chat template and
    trains on the assistant tokens only; add --self-distill to let the target write each assistant turn.
    Memory first: `recycle distill SOURCE_OR_DRAFTER --target T --plan --gpu H100 --world-size 8 --freeze experts`
    """
    if opts.target is None:
        raise RecycleError("--target TARGET_DIR: the model to distill against")
    if opts.tokens is None and not memory_plan:
        raise RecycleError("--tokens N: the budget in target tokens is required (e.g. --tokens 1M)")
    tokens_given = opts.tokens is not None  # --plan: the time and storage lines follow it
    opts.tokens = parse_tokens(opts.tokens or "1")
    opts.out = f.output_path(opts.out, opts.drafter, "distilled")
    if memory_plan:  # the whole job: memory per rank, host RAM per node, storage, FLOPs and hours, the teacher
        from recycle.distill.jobplan import check_host, lines, plan_job
        from recycle.distill.memory import check
        from recycle.report import render_memory

        job = plan_job(opts, world_size or int(os.environ.get("WORLD_SIZE", "1")), gpu,
                       opts.tokens if tokens_given else None, opts.gpus_per_node, opts.host_ram)
        data = job.as_dict()
        if json_out:
            print_json(data)
        else:
            render_memory(data)
            for line in lines(data):
                typer.echo(line)
        check(job.memory)  # a plan that does not fit: its advice, exit 2
        return check_host(job)  # nor one over the node's RAM
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
@f.options(HarvestOptions, "target tokens out drafter data seq_len packing batch seed self_distill prompt_len "
           "sd_temperature "
           "chat_template engine tensor_parallel_size pipeline_parallel_size enable_expert_parallel data_parallel_size "
           "gpu_memory_utilization device gpus keep_quantized precision ahead shard convert_workers plan gpu overwrite json_out",
           tokens=f.REQUIRED)
def harvest(opts: HarvestOptions, drafter: f.HarvestDrafter = None, tensor_parallel_size: f.TensorParallel = 1,
            pipeline_parallel_size: f.PipelineParallel = 1, enable_expert_parallel: f.ExpertParallel = False,
            data_parallel_size: f.DataParallel = 1, json_out: f.Json = False) -> None:
    """Compute the target's features for a distillation in vLLM, ahead of it, for targets no training process
    holds: vLLM's parallelism spreads the target; distill then reads the cache.

    The windows are exactly those `recycle distill` with the same --tokens/--data/--seq-len/--batch/--seed reads;
    vLLM runs in the environment recycle manages (built on first use): its CUDA build in bf16 where torch sees a GPU,
    its CPU build in fp32 elsewhere. `--engine transformers` runs the target in this process as distill's teacher
    does: the engine for DeepSeek-V4, whose hyper-connection streams vLLM does not capture.

    Example: `recycle harvest --target fixtures/deepseek_v3_mtp --tokens 64k -o /tmp/ds-cache`, then
    `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 64k --cache-hidden /tmp/ds-cache`.
    DeepSeek-V4: `recycle harvest --target fixtures/deepseek_v4_mtp --engine transformers --tokens 64k -o /tmp/v4`.
    Data parallel: N shards (`--shard i/N`, one engine each, any nodes, one shared -o); a killed harvest resumes
    when run again with the same options.
    """
    from recycle.preflight import drafter_dir

    if opts.target is None:
        raise RecycleError("--target TARGET_DIR: the model vLLM runs")
    if data_parallel_size != 1:  # vLLM's LLM() refuses it (vllm/entrypoints/llm.py:281-294)
        raise RecycleError(f"--data-parallel-size {data_parallel_size}: vLLM's offline engine takes none; run "
                           f"{data_parallel_size} shards instead: recycle harvest ... --shard i/{data_parallel_size} "
                           f"for i in 0..{data_parallel_size - 1}, same -o (docs/harvest.md)")
    opts.parallel = {k: v for k, v in (("tensor_parallel_size", tensor_parallel_size),
                                       ("pipeline_parallel_size", pipeline_parallel_size)) if v != 1}
    if enable_expert_parallel:
        opts.parallel["enable_expert_parallel"] = True
    opts.out, opts.tokens = f.output_path(opts.out, opts.target, "cache"), parse_tokens(opts.tokens)
    if opts.plan:  # storage, the teacher's FLOPs and hours, its GPUs: from the configs, nothing run or written
        from recycle.distill.jobplan import harvest_lines, harvest_plan
        from recycle.formats import aux_layers_of

        aux = len(aux_layers_of(drafter, opts.target)) if drafter is not None else 0
        engines = opts.shards()[1] * tensor_parallel_size * pipeline_parallel_size
        data = harvest_plan(opts.target, opts.tokens, opts.seq_len, opts.batch, opts.gpu, engines, aux, opts.engine,
                            keep_quantized=opts.keep_quantized)
        if json_out:
            return print_json(data)
        for line in harvest_lines(data):
            typer.echo(line)
        return
    if drafter is not None:  # an input too: -o is not the drafter, inside it or around it
        opts.out_checked(drafter)
    opts.validate()
    if drafter is not None:
        drafter_dir(drafter)
        from recycle.formats import aux_layers_of

        opts.aux_layers = aux_layers_of(drafter, opts.target)
    from recycle.distill.harvest import check_engine
    from recycle.distill.harvest import harvest as run
    from recycle.report import Reporter, render_harvest

    check_engine(opts)  # a DeepSeek-V4 target in vLLM, more --gpus than here: refused before the note

    if not json_out:
        note("harvest: running the target in vLLM (engine start: about a minute on a CPU)" if opts.engine == "vllm"
             else "harvest: loading the target in this process (transformers)")
    with Reporter("writing cache", quiet=json_out) as bar:
        data_out = run(opts, progress=bar.counter("harvest: {n} cache files written"))
    print_json(data_out) if json_out else render_harvest(data_out)


teacher_app = typer.Typer(help="A teacher that runs anywhere: the target in vLLM's own server, for distill --teacher.",
                          no_args_is_help=True, cls=JsonErrors)
app.add_typer(teacher_app, name="teacher")


@teacher_app.command("serve")
@user_errors
@f.options(TeacherServeOptions, "target shared_dir aux_layers port host max_model_len gpu_memory_utilization "
           "tensor_parallel_size pipeline_parallel_size data_parallel_size data_parallel_size_local "
           "data_parallel_start_rank data_parallel_address data_parallel_rpc_port enable_expert_parallel nnodes "
           "node_rank master_addr master_port headless print_only")
def teacher_serve(opts: TeacherServeOptions) -> None:
    """Run the target in vLLM's own OpenAI server with its extract_hidden_states method: each request's hidden states
    go to --shared-dir, for `recycle distill ... --teacher http://HOST:PORT` on other devices or nodes.

    Every parallel option is vLLM's own (tensor, pipeline, data, expert parallel; several nodes through vLLM's own
    launcher: --nnodes/--node-rank/--master-addr, --headless on the other nodes). The served name carries the target's
    fingerprint and the captured layers, which distill checks before it trains.

    Example: `recycle teacher serve fixtures/deepseek_v3_mtp --shared-dir /shared/hs --port 8000 --print`
    """
    opts.validate()
    from recycle.distill.harvest import fingerprint
    from recycle.distill.remote import needed_layers, served_name
    from recycle.distill.teacher import HARVEST_STREAMS, STREAMS_FROM_VLLM
    from recycle.engines import teacher_serve as ts
    from recycle.engines.vllm_env import engine_args, platform, vllm_python
    from recycle.mtp import chained_streams
    from recycle.preflight import load_json

    if chained_streams(load_json(Path(opts.target) / "config.json", "config.json")):
        raise RecycleError(STREAMS_FROM_VLLM.format(what="a vLLM teacher server", instead=HARVEST_STREAMS))
    n = fingerprint(opts.target)["num_hidden_layers"]
    bad = [i for i in opts.aux_layers if i > n]
    if bad:
        raise RecycleError(f"--aux-layers {bad[0]}: the target has {n} layers")
    layers = needed_layers(n, list(opts.aux_layers))
    python = vllm_python()
    cpu = platform()["dtype"] == "float32"  # vLLM's CPU build (vllm_env.PLATFORMS)
    cmd, env = ts.command(python, opts.target, name=served_name(opts.target, layers), layers=layers,
                          shared_dir=opts.shared_dir, engine=engine_args(opts.parallel(), opts.gpu_memory_utilization),
                          port=opts.port, host=opts.host, max_model_len=opts.max_model_len, cpu=cpu,
                          plugin=ts.plugin_installed(python))
    if opts.print_only:
        print(ts.shell_line(cmd, env))
        return
    Path(opts.shared_dir).expanduser().mkdir(parents=True, exist_ok=True)
    note(f"teacher: vllm serve on port {opts.port} (engine start: about a minute and a half on a CPU); "
         f"distill with --teacher http://HOST:{opts.port}")
    os.execve(cmd[0], cmd, {**os.environ, **env})  # vLLM's own server in its own venv, in this process's place


if __name__ == "__main__":
    app()
