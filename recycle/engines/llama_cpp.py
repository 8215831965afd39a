"""llama.cpp built once per machine from PyPI's `llama-cpp-python` sdist, and the calls recycle's checks make of it.

No prebuilt llama.cpp with MTP drafting installs from the registries this project may use, and the
`llama-cpp-python` wheel builds only the library, not `llama-server`. Its sdist vendors a llama.cpp source tree
(0.3.36: commit 0c1e570, with `--spec-type draft-mtp`), so `llama_cpp()` downloads that sdist, unpacks it and
builds the CPU binaries with CMake into a cache directory outside the repository (15-26 minutes on two cores),
as `vllm_env` builds vLLM's venv. `RECYCLE_LLAMA_CPP` points at an existing llama.cpp source tree with its build
under `build/` instead. The default test run never builds it; the slow suite and the benchmarks do.

Also here: `convert_trunk`, llama.cpp's own HF → GGUF converter (the tree's `convert_hf_to_gguf.py`) run on a
checkpoint, which is how the users' trunk GGUFs are made; and `LlamaServer`, `llama-server` on 127.0.0.1 with
greedy completions over token ids and the server's per-request draft counts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from recycle.engines.vllm_env import CACHE, run_logged
from recycle.errors import RecycleError

PACKAGE = os.environ.get("RECYCLE_LLAMA_CPP_PACKAGE", "llama-cpp-python==0.3.36")
TARGETS = ("llama-server", "llama-speculative-simple", "llama-tokenize")
# CPU build, no network at build time (the web UI flags), static binaries.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF")


def _check_toolchain() -> None:
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise RecycleError(f"building llama.cpp needs {' and '.join(missing)}; install it, or point RECYCLE_LLAMA_CPP "
                           "at an existing llama.cpp tree built under build/")


def llama_cpp() -> Path:
    """The llama.cpp source tree whose `build/bin` holds the binaries; built on first call (see the docstring)."""
    given = os.environ.get("RECYCLE_LLAMA_CPP")
    if given:
        tree = Path(given)
        if not (tree / "build" / "bin" / "llama-server").is_file():
            raise RecycleError(f"RECYCLE_LLAMA_CPP={given}: no build/bin/llama-server under it")
        return tree
    root = CACHE / PACKAGE.replace("==", "-")
    done = root / ".recycle-ready"
    if done.is_file():
        return Path(done.read_text().strip())
    _check_toolchain()
    root.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"{root.name}.log"
    log.write_text("", encoding="utf-8")
    dl = root / "sdist"
    if not run_logged([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", PACKAGE,
                       "-d", str(dl)], log):
        raise RecycleError(f"downloading the {PACKAGE} sdist failed (log: {log})")
    archive = next(dl.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    tree = next(root.glob("*/vendor/llama.cpp"))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (run_logged(["cmake", "-S", str(tree), "-B", str(tree / "build"), *generator, *CMAKE_FLAGS], log)
            and run_logged(["cmake", "--build", str(tree / "build"), "-j", str(os.cpu_count() or 2), "--target",
                            *TARGETS], log)):
        raise RecycleError(f"building llama.cpp from {PACKAGE} failed (log: {log})")
    done.write_text(str(tree) + "\n", encoding="utf-8")
    return tree


def binary(name: str) -> Path:
    return llama_cpp() / "build" / "bin" / name


# llama.cpp's converter knows tokenizers by a hash of a probe string's tokens and refuses others; recycle's fixtures
# use a byte-level BPE with GPT-2's regex, which its generic GPT-2 routine converts exactly (tests/engines). Only an
# unknown hash is mapped, so a released model's tokenizer converts as llama.cpp's converter alone converts it.
_BOOT = """
import runpy, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
if sys.argv.count("--raw-config"):
    sys.argv.remove("--raw-config")
    import json
    def hparams(dir_model, is_mistral_format):
        return json.loads((dir_model / "config.json").read_text(encoding="utf-8"))
    base.ModelBase.load_hparams = staticmethod(hparams)
if sys.argv.count("--gpt2-vocab"):
    sys.argv.remove("--gpt2-vocab")
    base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# Model types transformers 5.23 knows and the transformers llama.cpp's converter pins (4.57.6,
# requirements/requirements-convert_legacy_llama.txt) does not: under 4.57.6 `AutoConfig` fails on them and the
# converter reads config.json as released (conversion/base.py `load_hparams`). Here it would get transformers 5.23's
# Step3p5Config.to_dict(), which holds no `partial_rotary_factors` and cuts `layer_types` to the trunk's layers, and
# fail; so the converter is made to read config.json, as under its own pin.
RAW_CONFIG = ("step3p5", "step3p7", "mimo_v2_flash")


def convert_trunk(source: str | os.PathLike, out: str | os.PathLike, *, mtp: str = "no", outtype: str = "f32",
                  gpt2_vocab: bool = True) -> Path:
    """llama.cpp's converter on `source`: `mtp` "no" (trunk only, `--no-mtp`), "only" (its own side file, `--mtp`)
    or "keep" (both in one file; DeepSeek-V3's converter drops MTP whatever is asked). `gpt2_vocab`: GLM's
    vocabulary routine (which hard-codes GLM's special tokens) replaced by the generic GPT-2 one, for tokenizers
    that are not GLM's (the fixtures')."""
    tree = llama_cpp()
    args = [str(source), "--outfile", str(out), "--outtype", outtype]
    args += {"no": ["--no-mtp"], "only": ["--mtp"], "keep": []}[mtp]
    if gpt2_vocab:
        args.append("--gpt2-vocab")
    if json.loads((Path(source) / "config.json").read_text(encoding="utf-8")).get("model_type") in RAW_CONFIG:
        args.append("--raw-config")
    res = subprocess.run([sys.executable, "-c", _BOOT, str(tree), *args], capture_output=True, text=True)
    if mtp == "no" and res.returncode != 0 and "are not supported for" in res.stderr + res.stdout:
        # a converter without MTP export (DeepSeek-V3's): it drops the MTP layers on its own
        args.remove("--no-mtp")
        res = subprocess.run([sys.executable, "-c", _BOOT, str(tree), *args], capture_output=True, text=True)
    if res.returncode != 0 or not Path(out).is_file():
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        raise RecycleError(f"llama.cpp's converter failed on {source}: {tail[-400:]}")
    return Path(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """`llama-server` on 127.0.0.1 for one trunk GGUF (plus an MTP side file and `--spec-draft-n-max` when drafting);
    `complete(ids, n)` → the greedy continuation's token ids and the request's draft counts."""

    def __init__(self, trunk: str | os.PathLike, side: str | os.PathLike | None = None, n_max: int = 1,
                 threads: int = 1, ctx: int = 2048, timeout: float = 120.0, embedded: bool = False) -> None:
        """`embedded`: draft with the MTP block inside `trunk` itself (a GGUF converted with its module), no -md."""
        self.port = _free_port()
        cmd = [str(binary("llama-server")), "-m", str(trunk), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-c", str(ctx), "-np", "1", "--temp", "0", "--metrics"]
        if side is not None:
            cmd += ["-md", str(side)]
        if side is not None or embedded:
            cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
        self.cmd, self.timeout = cmd, timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                out = self.log.read().strip().splitlines()
                raise RecycleError(f"llama-server exited ({self.proc.returncode}): {' | '.join(out[-3:])[-400:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RecycleError(f"llama-server did not come up within {self.timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (`--metrics`), by name without the `llamacpp:` prefix: among them
        spec_decode_num_draft_tokens_total, spec_decode_num_accepted_tokens_total and spec_decode_num_drafts_total
        (verification steps)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=self.timeout) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name.split("llamacpp:", 1)[-1]] = float(value)
        return out

    def complete(self, ids: list[int], n_predict: int) -> dict:
        """Greedy, EOS ignored (rows run to n_predict, as recycle bench's checks do): tokens, drafted, accepted."""
        body = json.dumps({"prompt": ids, "n_predict": n_predict, "temperature": 0, "return_tokens": True,
                           "cache_prompt": False, "ignore_eos": True, "seed": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            out = json.loads(r.read())
        t = out.get("timings") or {}
        return {"tokens": list(out.get("tokens") or []), "drafted": int(t.get("draft_n", 0)),
                "accepted": int(t.get("draft_n_accepted", 0)), "predicted_per_second": t.get("predicted_per_second")}
