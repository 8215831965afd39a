"""`recycle harvest` at scale: every vLLM job carries the parallel options, sharded (`--shard i/N`), streamed in
chunks, resumable after a kill (the cache equal byte for byte), the connector as a vLLM plugin.

vLLM is stood in for (its job runner `run_job` monkeypatched, as tests/test_distill.py does): by a cheap engine
whose states are a function of the token ids (job specs, shards), and by transformers (kill and resume); the slow
tests run vLLM's CPU build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.distill import harvest as hv
from recycle.errors import RecycleError
from recycle.options import HarvestOptions

from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

HIDDEN = json.loads((FIXTURE / "config.json").read_text())["hidden_size"]
COMMON = dict(target=str(FIXTURE), tokens=500, seq_len=48, batch=2, seed=0, eval_rows=2)
OPTS = dict(aux_layers=(1, 2), eval_prompt_len=16, **COMMON)  # EAGLE-3's aux layers; held-out rows continued


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A small --data text file (distill's windows are cut from it; its tail is held out)."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    words = "the draft model reads a window of tokens and predicts the next ones while the target checks them".split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12 + i % 9)) + f" ({i})." for i in range(300)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class Killed(Exception):
    pass


def _serve(job: dict, states, sizes: list[int] | None = None, die_at: int | None = None) -> dict:
    """The feed protocol of vllm_job.py's harvest job: chunk NNNNNN.json answered by NNNNNN.done.json, in order
    (`sizes`: each chunk's window count; `die_at`: the engine dies on that chunk)."""
    raw, feed, n = Path(job["out_dir"]), Path(job["feed_dir"]), 0
    while True:
        chunk = feed / f"{n:06d}.json"
        while not chunk.exists() and not (feed / "end").exists():
            time.sleep(0.002)
        if not chunk.exists():
            return {"files": [], "seconds": 1.0}
        if n == die_at:
            raise Killed
        files = []
        windows = json.loads(chunk.read_text())["windows"]
        if sizes is not None:
            sizes.append(len(windows))
        for i, w in enumerate(windows):
            files.append(str(raw / f"{n}-{i}.safetensors"))
            save_file({"hidden_states": states(w, job["layers"]).contiguous(), "token_ids": torch.tensor(w)}, files[-1])
        tmp = feed / f".{n:06d}.done.tmp"
        tmp.write_text(json.dumps({"files": files}))
        tmp.rename(feed / f"{n:06d}.done.json")
        n += 1


def _cheap_states(w: list[int], layers: list[int]) -> torch.Tensor:
    ids = torch.tensor(w, dtype=torch.float32)
    return torch.stack([torch.sin(ids[:, None] * (k + 1) + torch.arange(HIDDEN) * 0.1) for k in layers], dim=1)


class CheapEngine:
    """vLLM's jobs without a model: greedy 'continuations' (each row repeats its last prompt token + 1) and
    states that are a function of the ids; every job spec is recorded."""

    def __init__(self) -> None:
        self.jobs: list[dict] = []
        self.chunks: list[int] = []

    def __call__(self, job: dict, env=None, **kw) -> dict:
        self.jobs.append(job)
        if "runs" in job:
            each = job.get("max_new_tokens_each") or [job["max_new_tokens"]] * len(job["prompt_ids"])
            return {job["runs"][0]["name"]: {"tokens": [[(p[-1] + 1) % 1000] * n
                                                        for p, n in zip(job["prompt_ids"], each)]}}
        return _serve(job, _cheap_states, self.chunks)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_every_vllm_job_carries_the_parallel_dtype_and_memory_options(monkeypatch, tmp_path, text) -> None:
    """Main (feed) job, held-out continuations and self-distill windows: all with TP 8, expert parallel and 0.8."""
    from typer.testing import CliRunner

    from recycle.cli import app

    engine = CheapEngine()
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", engine)
    res = CliRunner().invoke(app, ["harvest", "--target", str(FIXTURE), "--tokens", "300", "--seq-len", "48",
                                   "--batch", "2", "--data", text, "--self-distill", "--prompt-len", "16",
                                   "--tensor-parallel-size", "8", "--enable-expert-parallel",
                                   "--gpu-memory-utilization", "0.8", "-o", str(tmp_path / "c"), "--json"])
    assert res.exit_code == 0, res.output
    kinds = sorted(j.get("mode") or j["runs"][0]["name"] for j in engine.jobs)
    assert kinds == ["eval", "harvest", "windows"]
    for job in engine.jobs:
        assert job["parallel"] == {"tensor_parallel_size": 8, "enable_expert_parallel": True}, job.get("runs")
        assert (job["gpu_memory_utilization"], job["dtype"]) == (0.8, "float32")
    assert (tmp_path / "c" / "manifest.json").is_file() and not (tmp_path / "c" / ".harvest").exists()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> Path:
    """An uninterrupted one-job harvest (the cheap engine): what shards and a resumed run must write."""
    out = tmp_path_factory.mktemp("ref") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("recycle.engines.vllm_env.run_job", CheapEngine())
        rec = hv.harvest(HarvestOptions(out=str(out), data=text, **OPTS))
    assert rec["complete"] and rec["keys_resumed"] == 0
    return out


def test_shards_write_the_one_job_cache(monkeypatch, tmp_path, text, reference) -> None:
    """Two shards into one directory give the one-job harvest's files byte for byte; until the last shard is done
    there is no manifest, so distill refuses the directory, and a finished shard run again runs nothing. Small chunks: the engine is fed at most
    CHUNK_WINDOWS windows per call, one engine per shard."""
    engine = CheapEngine()
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", engine)
    monkeypatch.setattr(hv, "CHUNK_WINDOWS", 3)
    keys = json.loads((reference / "manifest.json").read_text())["keys"]
    first = len(keys) % 2  # the shard holding the held-out rows (the last key), first and twice
    a = hv.harvest(HarvestOptions(out=str(tmp_path / "two"), data=text, shard=f"{first}/2", **OPTS))
    assert not a["complete"] and not (tmp_path / "two" / "manifest.json").exists()
    with pytest.raises(RecycleError, match="manifest"):
        hv.check_manifest(tmp_path / "two", HarvestOptions(out="x", data=text, **OPTS), [1, 2], 1)
    again = hv.harvest(HarvestOptions(out=str(tmp_path / "two"), data=text, shard=f"{first}/2", **OPTS))
    assert again["keys_resumed"] == again["keys"] == a["keys"] and not again["complete"]  # nothing run again
    b = hv.harvest(HarvestOptions(out=str(tmp_path / "two"), data=text, shard=f"{1 - first}/2", **OPTS))
    assert b["complete"] and a["keys"] + b["keys"] == len(keys) + 1 and abs(a["keys"] - b["keys"]) <= 1
    assert [j.get("mode") for j in engine.jobs].count("harvest") == 2  # one engine per shard that had work
    rows = sum(load_file(str(f))["input_ids"].shape[0] for f in reference.glob("*.safetensors"))
    assert max(engine.chunks) <= 3 and sum(engine.chunks) == rows  # every window once, in chunks of at most 3
    assert _files(tmp_path / "two") == _files(reference)


def test_shard_and_data_parallel_refused_before_anything_loads(tmp_path) -> None:
    args = ["harvest", "--target", str(FIXTURE), "--tokens", "1k", "-o", str(tmp_path / "c")]
    assert_bad_input(run_cli(*args, "--shard", "2/2"), "--shard 2/2: i must be in [0, 1]")
    assert_bad_input(run_cli(*args, "--shard", "a/b"), "--shard a/b: i/N with whole numbers")
    assert_bad_input(run_cli(*args, "--data-parallel-size", "4"), "--shard i/4 for i in 0..3")
    assert_bad_input(run_cli(*args, "--shard", "0/2", "--overwrite"), "--overwrite with --shard")
    assert not (tmp_path / "c").exists()


_MODEL: dict = {}


def _transformers_engine(job: dict, env=None, die_at: int | None = None, **kw) -> dict:
    """vLLM's harvest job computed by transformers (fp32, the model loaded once): states as vLLM's layer ids give
    them (k < L: the stream entering layer k; L: the last layer's output before the final norm)."""
    from recycle.decoding.target import load_target

    if "runs" in job:  # continuations: transformers' generate takes a minute here, and they are not under test
        return CheapEngine()(job)
    model = _MODEL.get("m") or _MODEL.setdefault("m", load_target(job["target"]))

    def states(w: list[int], layers: list[int]) -> torch.Tensor:
        grabbed = {}
        hook = model.model.norm.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("pre", a[0]))
        with torch.no_grad():
            hs = model.model(input_ids=torch.tensor([w]), output_hidden_states=True).hidden_states
        hook.remove()
        top = len(hs) - 1
        return torch.stack([hs[k][0] if k < top else grabbed["pre"][0] for k in layers], dim=1)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread beside the conversion threads, on 2 cores
    try:
        return _serve(job, states, die_at=die_at)
    finally:
        torch.set_num_threads(threads)


def _cheap_engine(job: dict, die_at: int | None = None, **kw) -> dict:
    return CheapEngine()(job) if "runs" in job else _serve(job, _cheap_states, die_at=die_at)


# transformers' states (~0.15 s a window at one thread when this machine is idle, several times that under load)
@pytest.mark.parametrize("engine", [_cheap_engine, pytest.param(_transformers_engine, marks=pytest.mark.slow)],
                         ids=["cheap", "transformers"])
def test_a_killed_harvest_resumes_to_the_uninterrupted_cache(monkeypatch, tmp_path, text, reference, engine) -> None:
    """The engine dies on its third chunk: the finished keys stay (written whole), the partial files go; the same
    command again feeds only the rest, and the cache equals an uninterrupted harvest's, every file byte for byte
    (aux layers included, held-out continuations written by the engine before its states)."""
    monkeypatch.setattr(hv, "CHUNK_WINDOWS", 2)  # one key (--batch 2) a chunk
    opts = dict(data=text, **OPTS)
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", lambda job, **kw: engine(job, die_at=2))
    out = tmp_path / "killed"
    with pytest.raises(Killed):
        hv.harvest(HarvestOptions(out=str(out), **opts))
    kept = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(kept) == 2 and not (out / "manifest.json").exists()
    assert not list((out / ".harvest").glob("feed-*")) and not list(out.glob(".*.tmp-*"))
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", engine)
    rec = hv.harvest(HarvestOptions(out=str(out), **opts))
    assert rec["complete"] and rec["keys_resumed"] == 2 and rec["keys"] > 4
    if engine is _cheap_engine:
        ref = reference
    else:
        ref = tmp_path / "ref"
        assert hv.harvest(HarvestOptions(out=str(ref), **opts))["keys_resumed"] == 0
    assert _files(out) == _files(ref)
    assert load_file(str(out / kept[0]))["aux"].shape[-1] == 2 * HIDDEN


def test_a_resume_with_other_options_is_refused(monkeypatch, tmp_path, text) -> None:
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", CheapEngine())
    out = tmp_path / "c"
    (out / ".harvest").mkdir(parents=True)
    plan = {"manifest": {"seq_len": 64}, "shards": 1}
    (out / ".harvest" / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(RecycleError, match="an unfinished harvest for other options .*seq_len"):
        hv.harvest(HarvestOptions(out=str(out), data=text, **COMMON))
    assert json.loads((out / ".harvest" / "plan.json").read_text()) == plan


def test_the_vllm_plugin_registers_the_connector_lazily() -> None:
    """The entry point names a function that registers recycle's connector class by name and module path (imported
    only when vLLM builds it); importing the plugin imports no torch and none of recycle's heavy modules."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"recycle_hidden_states": "recycle.engines.vllm_plugin:register"}
    code = ("import sys, types; calls = []\n"
            "f = types.SimpleNamespace(register_connector=lambda *a: calls.append(a))\n"
            "sys.modules['vllm.distributed.kv_transfer.kv_connector.factory'] = "
            "types.SimpleNamespace(KVConnectorFactory=f)\n"
            "from recycle.engines import vllm_plugin; vllm_plugin.register()\n"
            "print(calls, sorted(m for m in sys.modules if m == 'torch' or m.startswith('recycle.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("[('RecycleHiddenStatesConnector', 'recycle.engines.vllm_cpu_connector', "
                                  "'RecycleHiddenStatesConnector')] ['recycle.engines', 'recycle.engines.vllm_plugin']")
    src = (root / "recycle" / "engines" / "vllm_cpu_connector.py").read_text()
    assert "class RecycleHiddenStatesConnector(" in src


def _plugin_site(tmp: Path) -> Path:
    """A site directory that installs recycle's vLLM plugin as pip would (the entry point in a dist-info, recycle's
    package beside it): vLLM's venv here has no recycle in it, and installing it there would change a shared venv."""
    root = Path(__file__).resolve().parents[1]
    site = tmp / "site"
    info = site / "recycle_plugin_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: recycle-plugin-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                           "recycle_hidden_states = recycle.engines.vllm_plugin:register\n")
    (site / "recycle").symlink_to(root / "recycle")
    return site


@pytest.mark.slow  # vLLM's import, ~20 s
def test_vllm_loads_the_plugin_and_finds_the_connector_by_name(tmp_path) -> None:
    """In vLLM's own environment: its plugin loader runs recycle's entry point, which imports no recycle module but
    the plugin (nor the connector) until vLLM asks for the class by name."""
    from recycle.engines.vllm_env import vllm_python

    code = ("import sys\nfrom vllm.plugins import load_general_plugins\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
            "load_general_plugins()\nprint(sorted(m for m in sys.modules if m.startswith('recycle')))\n"
            "cls = KVConnectorFactory.get_connector_class_by_name('RecycleHiddenStatesConnector')\n"
            "print(cls.__module__, cls.__name__)")
    env = {**os.environ, "PYTHONPATH": str(_plugin_site(tmp_path))}
    res = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == "['recycle', 'recycle.engines', 'recycle.engines.vllm_plugin']"
    assert lines[-1] == "recycle.engines.vllm_cpu_connector RecycleHiddenStatesConnector"


@pytest.mark.slow  # two vLLM engines (one per shard) on the CPU build, ~2-3 min
def test_two_vllm_shards_write_a_cache_distill_accepts(tmp_path, monkeypatch, text) -> None:
    """vLLM's CPU build, the connector through the plugin: shards 1/2 and 0/2 into one directory; the finished cache
    passes distill's manifest check and each key holds the in-process teacher's features (bf16)."""
    from recycle.distill.teacher import Teacher

    monkeypatch.setenv("PYTHONPATH", str(_plugin_site(tmp_path)))
    opts = dict(data=text, target=str(FIXTURE), tokens=300, seq_len=48, batch=2, seed=0, eval_rows=2, eval_prompt_len=0,
                aux_layers=(1, 2), gpu_memory_utilization=0.1)  # 0.1 of this shared machine's RAM for vLLM's cache
    out = tmp_path / "cache"
    a = hv.harvest(HarvestOptions(out=str(out), shard="1/2", **opts))
    b = hv.harvest(HarvestOptions(out=str(out), shard="0/2", **opts))
    assert (a["complete"], b["complete"]) == (False, True)
    assert a["vllm_connector"] == b["vllm_connector"] == "plugin"
    m = hv.check_manifest(out, HarvestOptions(out="x", **opts), [1, 2], 1)
    teacher = Teacher(str(FIXTURE), torch.device("cpu"), [1, 2], "fp32")
    for key in [*m["keys"], "eval"]:
        f = load_file(str(out / f"{key}.safetensors"))
        last, aux = teacher.features(f["input_ids"])
        torch.testing.assert_close(f["last"].float(), last, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(f["aux"].float(), aux, atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # writes ~0.5 GB of stand-in vLLM files and converts them twice; prints the two times
@pytest.mark.parametrize("hidden", [HIDDEN, 7168], ids=["fixture", "deepseek-v3-width"])
def test_converting_on_threads_writes_the_serial_bytes(tmp_path, hidden) -> None:
    """The norm step (vLLM's per-window files → one cache file per key, `_Job.store`) on `--convert-workers`
    threads, as `_extract` runs it, writes what one thread writes; the times of both are printed (-s)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    keys, rows, length, layers = 16, 2, 256, [1, 2, 3, 4]
    gen = torch.Generator().manual_seed(0)
    raw = tmp_path / "raw"
    raw.mkdir()
    for k in range(keys):
        for r in range(rows):
            save_file({"hidden_states": torch.randn(length, len(layers), hidden, generator=gen),
                       "token_ids": torch.arange(length)}, str(raw / f"{k}-{r}.safetensors"))
    w = torch.rand(hidden, generator=gen) + 0.5
    job = SimpleNamespace(n_layers=4, layers=layers, opts=SimpleNamespace(aux_layers=(1, 2, 4)),
                          norm=lambda x: x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    ids = torch.arange(length).repeat(rows, 1)
    times: dict[int, list[float]] = {1: [], 2: []}
    made = {}
    for run, workers in enumerate((1, 2, 1, 2, 1, 2)):  # the first pair warms up (imports, page cache): not counted
        src, out = tmp_path / f"raw{run}", tmp_path / f"out{run}"
        shutil.copytree(raw, src)
        out.mkdir()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda k, src=src, out=out: hv._Job.store(
                job, out / f"{k}.safetensors", ids, [str(src / f"{k}-{r}.safetensors") for r in range(rows)]),
                range(keys)))
        times[workers] += [time.perf_counter() - t0] if run >= 2 else []
        made[workers] = _files(out)
        shutil.rmtree(out)
    one, two = min(times[1]), min(times[2])
    print(f"convert {keys} keys x {rows} windows x {length} tokens, H={hidden}, {len(layers)} layers, best of 2: "
          f"1 thread {one:.2f} s, 2 threads {two:.2f} s ({one / two:.2f}x)")
    assert made[1] == made[2] and len(made[1]) == keys
