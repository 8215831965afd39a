"""What the test files share: the subprocesses they start, and small helpers more than one file uses.

The drafters the tests convert are one session fixture, `converted(fmt, source=..., **options)` in tests/conftest.py.
The distill tests' small run (`TINY`) and their metrics reader, and the exact next-token laws and the χ² tail the
lossless-sampling tests compare against, are at the end of this file.

Subprocesses the tests start run each in a process group of its own that dies with the test:
`run(cmd, timeout=...)` is `subprocess.run` and `popen(cmd)` a context manager around `subprocess.Popen`; both start
the child with `start_new_session=True` (its own process group, which everything it starts inherits) and, when the
command times out, the test fails or ends, or the `with` block is left, stop the whole group: SIGTERM, `grace`
seconds, then SIGKILL. Descendants that left the group (torchrun starts its workers in sessions of their own) are
found through the process tree and stopped with it. `tests/conftest.py` stops every live group when pytest itself
gets SIGTERM (and at exit), so a killed test run leaves nothing behind.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil  # a dependency of accelerate, which recycle requires

GRACE_S = 5.0
_live: dict[int, subprocess.Popen] = {}  # leader pid (= its process group id) -> process, while its test holds it
_lock = threading.RLock()  # re-entrant: the SIGTERM handler may run while the main thread holds it


def alive(pid: int) -> bool:
    """Whether a process runs (an exited one waiting to be reaped, a zombie, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree(pgid: int, leader: bool) -> list[psutil.Process]:
    """The group's members and, while the leader is not reaped (its pid still names it), its descendants, wherever
    their session is."""
    found: dict[int, psutil.Process] = {}
    if leader:
        try:
            p = psutil.Process(pgid)
            found[pgid] = p
            found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter():
        try:
            if p.pid not in found and os.getpgid(p.pid) == pgid:
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return list(found.values())


def _signal(pgid: int, procs: list[psutil.Process], sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the pid still names the same process
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    left = [p for p in procs if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _running(p)]
    return left


def stop_group(pgid: int, grace: float = GRACE_S, leader: bool = True) -> None:
    """SIGTERM to the group and the leader's descendants, up to `grace` s for them to exit, then SIGKILL to what is left.
    `leader`: the leader (pid `pgid`) is not reaped yet.

    Reaps nothing (safe inside a signal handler while the test waits on the same process)."""
    procs = _tree(pgid, leader)  # taken before any signal: once the leader dies its children are re-parented
    _signal(pgid, procs, signal.SIGTERM)
    left = _wait_gone(procs, grace)
    _signal(pgid, left, signal.SIGKILL)  # the group too: a member that ignored SIGTERM and was not seen
    _wait_gone(left, GRACE_S)


def stop(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """Stop `proc`'s group and descendants (see `stop_group`), then reap `proc`."""
    stop_group(proc.pid, grace, leader=proc.returncode is None)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to `proc`, its group and its descendants at once (a crash, not a shutdown), then reap `proc`."""
    procs = _tree(proc.pid, leader=proc.returncode is None)
    _signal(proc.pid, procs, signal.SIGKILL)
    _wait_gone(procs, GRACE_S)
    proc.wait()


def stop_all(grace: float = GRACE_S) -> None:
    """Stop every group a test still holds (conftest's SIGTERM handler, and at exit)."""
    with _lock:
        procs = list(_live.values())
    for proc in procs:
        stop_group(proc.pid, grace, leader=proc.returncode is None)


atexit.register(stop_all, 2.0)


@contextmanager
def popen(cmd: Sequence[str] | str, *, grace: float = GRACE_S, **kw) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(cmd, **kw)` in a process group of its own, stopped with all it started when the block ends."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    with _lock:
        _live[proc.pid] = proc
    try:
        yield proc
    finally:
        try:
            stop(proc, grace)
        finally:
            with _lock:
                _live.pop(proc.pid, None)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()


def run(cmd: Sequence[str] | str, *, timeout: float, input: str | bytes | None = None, check: bool = False,
        capture_output: bool = False, grace: float = GRACE_S, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run` with a required timeout, in a process group of its own: on timeout, or once the command
    returns, nothing it started is left running. A timeout raises `subprocess.TimeoutExpired` with what it printed."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with popen(cmd, grace=grace, **kw) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc, grace)
            try:
                out, err = proc.communicate(timeout=grace)
            except (subprocess.TimeoutExpired, ValueError):
                out = err = None
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        res.check_returncode()
    return res


def install_sigterm_handler() -> None:
    """On SIGTERM: stop every live group and this process's own children (pytest-xdist's workers, which do the same
    for theirs), then die of SIGTERM as before. Only the main thread can set a handler; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once
        stop_all(2.0)
        children = psutil.Process().children()
        for c in children:
            try:
                c.terminate()
            except psutil.NoSuchProcess:
                pass
        for c in _wait_gone(children, 10.0):
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        if previous == signal.SIG_IGN:
            return
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# -- shared by several test files -----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# The distill tests' small run: 48-token rows, 2 a batch, 2 held-out rows, one thread.
TINY = dict(seq_len=48, batch=2, eval_rows=2, threads=1)


def metrics(state_dir: Path) -> list[dict]:
    """The rows of a distill run's `metrics.jsonl`."""
    return [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]


def chi2_sf(x: float, k: int) -> float:
    """P(χ²_k ≥ x), via the regularised lower incomplete gamma series (no scipy here)."""
    s, z = k / 2.0, x / 2.0
    term = total = 1.0 / s
    n = 1
    while term > 1e-15 * total and n < 10_000:
        term *= z / (s + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(s * math.log(z) - z - math.lgamma(s)) * total) if z > 0 else 1.0


def exact_marginals(model, prompt: list[int], temperature: float) -> list:
    """Exact laws of generated tokens 1, 2, 3 under sampling at `temperature`, enumerating every continuation of
    a tiny vocabulary (the model's logits' width)."""
    import torch

    with torch.no_grad():
        def law(seqs: torch.Tensor) -> torch.Tensor:
            return torch.softmax(model(seqs).logits[:, -1].double() / temperature, -1)

        base = torch.tensor([prompt])
        p1 = law(base)[0]
        v = p1.shape[0]
        two = torch.cat([base.expand(v, -1), torch.arange(v)[:, None]], 1)
        p2c = law(two)  # [a, b] = p(b | a)
        three = torch.cat([two.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], 1)
        p3c = law(three).view(v, v, v)  # [a, b, c]
        p2 = p1 @ p2c
        p3 = torch.einsum("a,ab,abc->c", p1, p2c, p3c)
    return [p1, p2, p3]


def sampled_counts(target, engine, prompt: list[int], runs: int, vocab: int, masks, temperature: float = 1.0):
    """(counts [3, vocab]: how often each token came at generated positions 1-3, drafts accepted in all) over `runs`
    speculative generations seeded 0 … runs-1 (recycle.decoding.generate), for `assert_target_law`."""
    import torch

    from recycle.decoding import generate

    counts = torch.zeros(3, vocab, dtype=torch.float64)
    accepted = 0
    for seed in range(runs):
        g = generate(target, engine, prompt, 3, temperature=temperature, seed=seed, masks=masks)
        for i, t in enumerate(g.tokens[:3]):
            counts[i, t] += 1
        accepted += sum(g.stats.accepted)
    return counts, accepted


def assert_target_law(counts, exact: list, runs: int) -> None:
    """χ² of the tokens sampled at each generated position (`counts[i]`: per token, over `runs` generations) against
    the exact law `exact[i]` (`exact_marginals`), cells expected ≥ 5 times; fails below p = 1e-3."""
    for i in range(len(exact)):
        expected = exact[i] * runs
        keep = expected >= 5
        stat = float((((counts[i] - expected) ** 2) / expected.clamp(min=1e-12))[keep].sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (i, counts[i].tolist(), expected.tolist())


def tiny_mtp_pair(vocab: int = 8):
    """A random-init tiny DeepSeek-V3 target (vocabulary `vocab`, a law far from uniform) and two random MTP modules
    as its drafter (depth 1 nearly uniform: accepts often, rejects often; depth 2 the target's head), for the
    sampling-law tests, whose exact laws enumerate the vocabulary."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from recycle.families import BY_NAME
    from recycle.mtp import MTP, block_config

    cfg = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
               q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
               num_nextn_predict_layers=2)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    mtp = MTP(block_config(dict(cfg, model_type="deepseek_v3")), BY_NAME["deepseek_v3"], 2).eval()
    with torch.no_grad():  # bare decoder layers are not initialised by transformers (post_init is the model's)
        for name, t in list(mtp.named_parameters()) + list(mtp.named_buffers()):
            if t.is_floating_point():
                t.normal_(0, 0.1) if t.dim() > 1 else t.fill_(1.0 if "norm" in name else 0.0)
        mtp.layers[0].head.weight.mul_(0.01)
        mtp.layers[1].head.weight.copy_(model.lm_head.weight)
        mtp.layers[0].embed.weight.copy_(model.model.embed_tokens.weight)
        mtp.layers[1].embed.weight.copy_(model.model.embed_tokens.weight)
    return model, mtp


def drafter_tensors(out: Path) -> dict:
    """Every weights layout of a drafter directory: layout (its folder) -> name -> tensor, shards merged."""
    from safetensors import safe_open

    layouts: dict = {}
    for f in sorted(out.rglob("*.safetensors")):
        rel = f.relative_to(out)
        with safe_open(str(f), "pt") as h:
            part = layouts.setdefault(str(rel.parent), {})
            for k in h.keys():
                assert k not in part, k
                part[k] = h.get_tensor(k)
    return layouts


def same_drafter_output(one: Path, two: Path, exact: bool) -> None:
    """Two drafter directories hold the same files. `exact`: byte for byte, every file (the same weights written).
    Otherwise: every layout's tensors with the same names, shapes and dtypes and values within one bf16 step (2 ranks
    and one process train to within 1e-7, which can round either way), the other files byte for byte
    (recycle.json aside: its records hold times and its digests the weights')."""
    import torch

    files = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file())
    a, b = drafter_tensors(one), drafter_tensors(two)
    assert a.keys() == b.keys()
    for layout in a:
        assert list(a[layout]) == list(b[layout]), layout  # the same names in the same order
        for k, t in a[layout].items():
            u = b[layout][k]
            assert t.dtype == u.dtype and t.shape == u.shape, (layout, k)
            torch.testing.assert_close(u.float(), t.float(), rtol=0 if exact else 2 ** -7, atol=0 if exact else 1e-5,
                                       msg=f"{layout} {k}")
    for f in files:
        if exact or not (f.endswith(".safetensors") or f == "recycle.json"):
            assert (one / f).read_bytes() == (two / f).read_bytes(), f


def moe_block(impl: str | None = None):
    """A small DeepSeek-V3 MoE block (8 routed experts, top 3, a shared expert) with N(0, 0.2) weights, seeded: the
    expert-parallel tests' reference. `impl`: transformers' experts implementation (None: its default)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                           n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True)
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def kill_at_first_checkpoint(cmd: Sequence[str], state_dir: Path, cwd: Path, env: dict, timeout: float = 120) -> None:
    """Run a one-process distill command and SIGKILL it (a crash) once its first checkpoint is on disk."""
    with popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        deadline = time.time() + timeout
        while not (state_dir / "checkpoint.pt").is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's rendezvous or a local server."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distill_rank(rank: int, world: int, port: int, run: dict, queue) -> None:
    """One gloo rank of a distill started by `torch.multiprocessing.spawn`: torchrun's environment set, rank 0's record
    put on `queue` ((rank, record or None)), the process group ended whatever happens."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))

    from recycle.distill.train import DistillOptions, distill

    try:
        rec = distill(DistillOptions(**run))
        queue.put((rank, rec if rank == 0 else None))
    finally:
        end_ranks()


def end_ranks() -> None:
    """A gloo rank's teardown, in a worker's `finally`: a barrier (unless an exception is on its way out), destroy
    the group, then let gloo's threads drop their last works before the interpreter finalizes.

    Without this, torch 2.13 aborts the rank as it exits about 1 run in 3 of test_experts ("terminate called without
    an active exception", SIGABRT). In gdb: a `pt_gloo_runloop` thread destroys the work it just completed
    (~AsyncAllreduceWork -> decref_pyobject), needs the GIL to free the Python tensors it held, and is killed
    taking it while Py_FinalizeEx runs. A functional collective (the experts' all-to-all) keeps the group's C++
    object and its threads alive past destroy_process_group (their names stay in /proc/self/task after a
    gc.collect; with plain collectives they go), so nothing joins them: the sleep releases the GIL to them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None:
        dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.25)


@contextmanager
def stable_topk():
    """torch.topk with equal values returned lowest index first. A sparse-attention indexer (DeepSeek-V3.2's and
    GLM-5's DSA, DeepSeek-V4's compressed sparse attention) with few heads leaves many keys tied at a ReLU'd score
    of 0, and `torch.topk` orders ties by the row's length and layout: a chain's verification then picks other keys
    than one-token decoding, both the target's computation, not bit-equal. With this tie-break greedy decoding is a
    function of the prompt alone (tests/test_glm5_trained.py's docstring)."""
    import pytest
    import torch

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, idx = self.sort(dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), idx.narrow(dim, 0, k)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", topk)
        yield


def oracle(truth: list[int], length: int, wrong: int, vocab: int):
    """A drafter proposing `length` tokens of a known continuation (`truth`: plain decoding's tokens), the last `wrong`
    of them corrupted: chains rejected in the middle (accepted, accepted, rejected) at every step, as no trained
    drafter does so reliably. For targets whose state is rolled back on rejection (hybrids, DeepSeek-V4)."""
    from recycle.decoding.drafting import Drafter
    from recycle.decoding.tree import Tree

    class Oracle(Drafter):
        kind = "oracle"
        shape = length

        def start(self, ids, feats) -> None:
            self.at = 1  # truth[0] is the prefill's token: the first root

        def propose(self, root, temperature=0.0, gen=None) -> Tree:
            tree = Tree.root(root)
            for d in range(length):
                tok = truth[min(self.at + d, len(truth) - 1)]
                if d >= length - wrong:
                    tok = (tok + 1) % vocab
                tree.add(tok, d)
            return tree

        def commit(self, tokens, feats) -> None:
            self.at += len(tokens)

    return Oracle()


def native_chain_past_the_window(target_dir: Path, modules: int, new: int = 12) -> None:
    """A sliding-window target (issue 47: MiMo-V2, Step-3.7; the generators' window is 4) decodes `new` tokens past
    its window with its own MTP modules chained (`chain:MODULES`) and gives plain decoding's tokens, each step
    verifying every module's draft; with one mask for every layer type (the control) the sliding layers see past
    their window and the outputs part."""
    import torch

    from recycle.decoding import MaskCache, Target, generate, load_target
    from recycle.decoding.drafting import Drafter, load_engine

    target = Target(load_target(target_dir))
    assert target.window == 4
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (12,), generator=gen).tolist() for _ in range(3)]
    masks = MaskCache(torch.float32, "cpu")
    plain = [generate(target, Drafter(), ids, new, masks=masks).tokens for ids in prompts]
    engine = load_engine(None, target, masks, tree=f"chain:{modules}", native=True, target_dir=str(target_dir))
    target.set_taps(engine.taps)
    runs = [generate(target, engine, ids, new, masks=masks) for ids in prompts]
    assert [r.tokens for r in runs] == plain
    assert all(r.stats.tree_nodes == modules * r.stats.steps for r in runs)  # every module drafts, every step
    target.window = None
    assert [generate(target, engine, ids, new, masks=masks).tokens for ids in prompts] != plain
