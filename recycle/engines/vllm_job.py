"""Run one decoding job in vLLM and print nothing but a JSON result file: the engine half of recycle's checks.

This file runs inside vLLM's own virtual environment (vLLM pins an older transformers than recycle), so it
imports only the standard library and vLLM. `recycle.engines.vllm_env` writes the job and reads the result:

    job    {"target": DIR, "prompt_ids": [[int]], "max_new_tokens": N (or "max_new_tokens_each": [N]),
            "temperature": T (0: greedy), "seed": S (row i samples with S + i, or "seed_each": [int]),
            "stop_token_ids": [int] (optional: a row ends at the first of them, which it keeps; without them rows
            run to their length, EOS ignored),
            "runs": [{"name": str, "speculative_config": {...} | null}], "max_model_len": int (optional: `model_len`),
            "tokenizer": bool (optional: vLLM loads the target's tokenizer, which a multimodal renderer needs even for
            token-id prompts; without it, none),
            "dtype": str, "gpu_memory_utilization": float, "parallel": {vLLM's own names: tensor_parallel_size,
            pipeline_parallel_size, enable_expert_parallel, ...}} (`vllm_env.job_engine`: every job carries them)
    result {name: {"tokens": [[int]], "seconds": float, "accepted_per_pos": [int], "drafts": int,
                   "draft_tokens": int, "accepted": int}} or {name: {"error": "..."}}

  or, with "mode": "harvest" (hidden-state extraction, `recycle harvest`):
    job    {"mode": "harvest", "target": DIR, "windows": [[int]], "layers": [int], "out_dir": DIR}
    result {"files": [path per window], "seconds": float, "connector": "plugin" | "module path" (how vLLM found
           it)}: safetensors with `hidden_states` [T, len(layers), H] (vLLM's layer id k < L: the residual stream
           entering layer k; id L: the last layer's output before the final norm) and `token_ids` [T]
  and, with "feed_dir": DIR instead of "windows" (`recycle harvest` in chunks, `distill --online`): the engine stays up
  and serves chunks as they come: DIR/NNNNNN.json {"windows": [[int]]} is answered by DIR/NNNNNN.done.json
  {"files": [...]}, in order, until DIR/end appears (or the process that started the job is gone).

Workarounds for vLLM 0.32's CPU build: its rotary-embedding custom op is wrong for multi-head inputs
(MLA's rope part), so custom ops run with `-rotary_embedding`; the CPU backend reserves
`gpu_memory_utilization` of the node's RAM, so it is 0.5 rather than 0.92; on a CPU with AMX tiles it picks
the AMX MLA backend, which takes only bf16/fp16/int8 weights, so fp32 MLA targets ask for CPU_MLA (`cpu_mla`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

CONNECTOR = "RecycleHiddenStatesConnector"  # the class in vllm_cpu_connector.py, and its name in vLLM's registry
METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens": "accepted"}


def cpu_mla(target: str, dtype: str) -> dict:
    """LLM kwargs that keep an fp32 MLA target off vLLM's AMX MLA backend (which refuses fp32 weights)."""
    from vllm.platforms import current_platform

    config = json.loads((Path(target) / "config.json").read_text())
    if current_platform.is_cpu() and dtype == "float32" and config.get("kv_lora_rank"):
        return {"attention_config": {"backend": "CPU_MLA"}}
    return {}


SLACK = 8  # positions max_model_len keeps past the last one a job computes


def model_len(job: dict, computed: int) -> int:
    """max_model_len for a job whose rows compute at most `computed` positions (a prompt, every generated token but the
    last, which is never fed back, and a speculative run's drafts): the job's own if larger, else computed + SLACK.

    vLLM refuses a max_model_len past the target's context without VLLM_ALLOW_LONG_MAX_MODEL_LEN, which it warns
    lets RoPE positions past the context compute NaN (vllm/config/model.py:2639-2664); and a prompt needs
    max_model_len above its length (vllm/v1/engine/input_processor.py:593). So a window as long as the context, which
    computes no position past it, needs the override for the slack alone: it is set here, for this process and the
    engine processes it starts, exactly when every row stays within the context. A row past it is left to vLLM's
    refusal."""
    want = max(int(job.get("max_model_len") or 0), computed + SLACK)
    config = json.loads((Path(job["target"]) / "config.json").read_text())
    context = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if context and want > int(context) >= computed:
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return want


def engine(job: dict, computed: int) -> dict:
    """The LLM kwargs every job shares: the job's dtype, memory share and parallel options (vLLM's own names,
    `vllm_env.engine_args`), eager, no tokenizer unless the job asks, `model_len`, this file's CPU workarounds."""
    dtype = job.get("dtype", "float32")
    return dict(model=job["target"], skip_tokenizer_init=not job.get("tokenizer"), enforce_eager=True, dtype=dtype, seed=0,
                max_model_len=model_len(job, computed), gpu_memory_utilization=job.get("gpu_memory_utilization", 0.5),
                compilation_config={"custom_ops": ["all", "-rotary_embedding"]}, **cpu_mla(job["target"], dtype),
                **job.get("parallel", {}))


def connector() -> dict:
    """The hidden-states connector's KVTransferConfig fields: by name where recycle's vLLM plugin registered it
    (`recycle.engines.vllm_plugin`, an entry point of recycle installed in vLLM's environment: every process of
    every node finds it), else by module path from this file's directory (a venv without recycle in it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM loads them again in each engine and worker process (once per process)
    try:
        KVConnectorFactory.get_connector_class_by_name(CONNECTOR)
    except ValueError:  # not registered: no plugin
        return {"kv_connector": CONNECTOR, "kv_connector_module_path": "vllm_cpu_connector"}
    return {"kv_connector": CONNECTOR}


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompt_ids"]]
    t, seed = job.get("temperature", 0.0), job.get("seed", 0)
    seeds = job.get("seed_each") or [seed + i for i in range(len(prompts))]
    each = job.get("max_new_tokens_each") or [job["max_new_tokens"]] * len(prompts)
    stops = job.get("stop_token_ids") or None
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=stops is None, stop_token_ids=stops,
                             seed=s if t > 0 else None)
              for s, n in zip(seeds, each)]
    drafts = max([int((r.get("speculative_config") or {}).get("num_speculative_tokens") or 0) for r in job["runs"]])
    common = engine(job, max(len(ids) + n - 1 for ids, n in zip(job["prompt_ids"], each)) + drafts)
    common["disable_log_stats"] = False
    result: dict = {}
    for spec in job["runs"]:
        extra = {"speculative_config": spec["speculative_config"]} if spec.get("speculative_config") else {}
        if extra and "attention_config" in common:  # a draft picks its own backend unless told (vLLM never inherits it)
            extra["speculative_config"] = {"attention_backend": common["attention_config"]["backend"],
                                           **extra["speculative_config"]}
        t0 = time.perf_counter()
        try:
            llm = LLM(**common, **extra)
            outs = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # the engine's refusal is the result being recorded
            result[spec["name"]] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
            continue
        row: dict = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - t0}
        for m in llm.get_metrics():
            if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                row["accepted_per_pos"] = [int(v) for v in m.values]
            elif m.name in METRICS:
                row[METRICS[m.name]] = int(m.value)
        result[spec["name"]] = row
        del llm
    return result


def harvest(job: dict) -> dict:
    """Prefill every window once through vLLM's `extract_hidden_states` method; one file per window."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )
    from vllm.inputs import TokensPrompt

    longest = job["max_window"] if "feed_dir" in job else max(len(w) for w in job["windows"])
    kv = connector()
    llm = LLM(**engine(job, longest),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": job["layers"]}}},
              kv_transfer_config=KVTransferConfig(
                  **kv, kv_role="kv_producer",
                  kv_connector_extra_config={"shared_storage_path": job["out_dir"]}))
    def extract(windows: list[list[int]]) -> list[str]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                            SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        files = []
        for o in outs:
            path = o.kv_transfer_params["hidden_states_path"]
            load_hidden_states(path)  # waits for the connector's write to finish
            cleanup_hidden_states(path, keep_hidden_states=True)
            files.append(path)
        return files

    how = "module path" if "kv_connector_module_path" in kv else "plugin"
    t0 = time.perf_counter()
    if "feed_dir" not in job:
        return {"files": extract(job["windows"]), "seconds": time.perf_counter() - t0, "connector": how}
    feed, parent, n, busy = Path(job["feed_dir"]), os.getppid(), 0, 0.0
    while True:
        chunk = feed / f"{n:06d}.json"
        while not chunk.exists() and not (feed / "end").exists() and os.getppid() == parent:
            time.sleep(0.01)
        if not chunk.exists():
            return {"files": [], "seconds": busy, "chunks": n, "connector": how}
        t1 = time.perf_counter()
        files = extract(json.loads(chunk.read_text())["windows"])
        busy += time.perf_counter() - t1
        tmp = feed / f".{n:06d}.done.tmp"
        tmp.write_text(json.dumps({"files": files}))
        tmp.rename(feed / f"{n:06d}.done.json")
        n += 1


if __name__ == "__main__":
    job_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    job = json.loads(job_path.read_text())
    out_path.write_text(json.dumps(harvest(job) if job.get("mode") == "harvest" else run(job)))
