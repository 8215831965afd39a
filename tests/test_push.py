"""`recycle push`: validation before any network call, the model card, one commit against a local fake Hub
(tests/fake_hub.py), a rejected token, dropped connections, and the token never leaving huggingface_hub.

Drafters are made by `recycle convert` (bf16) from the trained fixture, one by `recycle distill`
(skipped while that command is absent); a hand-written `distillation` list covers several runs and a
layout a run dropped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from recycle.cli import app
from recycle.hub import base_model_name, validate_drafter

from tests.fake_hub import FakeHubServer
from tests.trained import FIXTURE

TOKEN = "hf_recycleFAKEtoken0123456789abcdefXYZ"  # must never appear in any output or written file
REJECTED = "recycle: error: the Hub rejected the token (HTTP 401): run `hf auth login` or set HF_TOKEN"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def listing(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def digest(d: Path) -> str:
    h = hashlib.sha256()
    for rel, data in listing(d).items():
        h.update(rel.encode() + data)
    return h.hexdigest()


def assert_token_nowhere(*texts: str, roots: tuple[Path, ...]) -> None:
    for t in texts:
        assert TOKEN not in t
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                assert TOKEN.encode() not in p.read_bytes(), p


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One drafter per format, converted by the CLI; the eagle one also holds a real `bench --json` report."""
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for fmt in ("eagle", "eagle3", "medusa"):
        res = invoke("convert", FIXTURE, "--to", fmt, "-o", root / fmt, "--dtype", "bf16", "--json")
        assert res.exit_code == 0, res.output
        out[fmt] = root / fmt
    prompts = root / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n')
    res = invoke("bench", out["eagle"], "--target", FIXTURE, "--prompts", prompts, "--max-new-tokens", "8",
                 "--tree", "chain:2", "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    (out["eagle"] / "bench.json").write_text(res.stdout)
    return out


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Point huggingface_hub at nothing real: a fake token, no saved login, online, fast retries."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("RECYCLE_HUB_ATTEMPTS", "3")
    monkeypatch.setenv("RECYCLE_HUB_BACKOFF", "0.01")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)

    monkeypatch.setattr(hf_constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf_home" / "agents.json"))

    def serve(mode: str = "ok") -> FakeHubServer:
        server = FakeHubServer(mode)
        monkeypatch.setenv("HF_ENDPOINT", server.hub.url)  # what recycle.hub reads
        # huggingface_hub froze HF_ENDPOINT at import; its agent-registry fetch uses that copy
        monkeypatch.setattr(hf_constants, "ENDPOINT", server.hub.url)
        return server

    return serve


def test_push_is_one_commit_with_every_file_and_the_card(drafters, hub_env, tmp_path):
    d = drafters["eagle"]
    before = digest(d)
    bench = json.loads((d / "bench.json").read_text())
    record = json.loads((d / "recycle.json").read_text())
    with hub_env() as hub:
        res = invoke("push", d, "--repo", "me/ds-eagle", "--private", "--revision", "dev",
                     "--base-model", "deepseek-ai/DeepSeek-V3", "--commit-message", "first drafter", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    # the calls, in order, and nothing the fake Hub does not implement
    kinds = [k for k in ("create", "branch", "validate", "preupload", "commit") if hub.hits(k)]
    assert kinds == ["create", "branch", "validate", "preupload", "commit"] and hub.unexpected == []
    assert hub.hits("commit") == 1 and len(hub.commits) == 1
    assert hub.repos["me/ds-eagle"] == {"name": "ds-eagle", "organization": "me", "visibility": "private",
                                        "type": "model"}
    assert hub.branches["me/ds-eagle"] == {"main", "dev"}
    commit = hub.commits[0]
    assert (commit.repo, commit.revision, commit.summary) == ("me/ds-eagle", "dev", "first drafter")
    # every file of the directory, byte for byte, plus the generated card
    local = listing(d)
    assert set(commit.files) == set(local) | {"README.md"}
    assert all(commit.files[rel] == data_ for rel, data_ in local.items())
    assert data["files"] == {**{rel: len(b) for rel, b in local.items()}, "README.md": len(commit.files["README.md"])}
    assert data["commit"]["commit_url"].startswith(hub.url + "/me/ds-eagle/commit/")
    # the card: metadata and body
    text = commit.files["README.md"].decode()
    assert hub.validated == [text]
    card = ModelCard(text)
    assert card.data.base_model == "deepseek-ai/DeepSeek-V3"
    assert card.data.library_name == "recycle" and card.data.pipeline_tag is None  # a drafter generates nothing alone
    assert set(card.data.tags) >= {"speculative-decoding", "eagle", "mtp", "recycled-mtp"}
    s = record["summary"]
    assert f"mapped {s['tensors']} tensors: **{s['exact']} exact**" in card.text
    assert "| `nextn/nextn_layer_parameters.safetensors` |" in card.text  # per-file mapping summary
    assert "`layers.N.block.mlp.experts.N.down_proj.weight` | exact | 16 |" in card.text
    sp = bench["overall"]["spec"]
    assert f"| {sp['tau']:.2f} | {bench['overall']['speedup']:.2f}× |" in card.text
    assert "| " + " | ".join(f"pos {i + 1}" for i in range(len(sp["acceptance"]))) + " |" in card.text
    assert "--speculative-algorithm EAGLE " in card.text and "--speculative-draft-model-path ds-eagle/nextn" in card.text
    # stitch takes the target as --target (issue 27) and needs it on disk: a local copy of the Hub model
    assert "recycle stitch ds-eagle/mtp_overlay --target /models/DeepSeek-V3" in card.text
    assert '"method": "mtp"' in card.text
    # the token went to the server only, in the Authorization header of every API call
    # (huggingface_hub's once-a-day agent-registry GET goes without one)
    assert {a for (_, path), a in zip(hub.requests, hub.auth) if "agent-harnesses" not in path} == {f"Bearer {TOKEN}"}
    assert_token_nowhere(res.stdout, res.stderr, text, roots=(d.parent, tmp_path))
    assert digest(d) == before  # the input directory is untouched


@pytest.mark.parametrize("fmt", ["eagle3", "medusa"])
def test_push_other_formats_to_main(drafters, hub_env, fmt):
    with hub_env() as hub:
        res = invoke("push", drafters[fmt], "--repo", f"me/ds-{fmt}")
    assert res.exit_code == 0, res.output
    assert hub.hits("branch") == 0 and hub.unexpected == []  # main needs no branch
    assert len(hub.commits) == 1 and hub.commits[0].revision == "main"
    assert hub.repos[f"me/ds-{fmt}"].get("visibility") is None  # not --private: the account's default
    card = ModelCard(hub.commits[0].files["README.md"].decode())
    assert card.data.base_model is None  # a local source without a Hub id: no base_model field
    assert "deepseek_v3_mtp" in card.text  # named in the body
    assert fmt in card.data.tags and "mtp" not in card.data.tags
    assert f'"model": "me/ds-{fmt}", "method": "{fmt}"' in card.text
    assert "## Benchmark" not in card.text  # no bench.json in this directory
    if fmt == "medusa":
        assert "SGLang and llama.cpp have no Medusa support." in card.text
        assert set(hub.commits[0].files) >= {"model.safetensors", "medusa_lm_head.safetensors"}
    else:
        # no llama.cpp line: recycle writes no GGUF, and llama.cpp's reading of this output is unchecked
        assert "--speculative-algorithm EAGLE3" in card.text and "--spec-type draft-eagle3" not in card.text
        assert "not distilled after conversion" in card.text  # approx/fresh tensors and no distillation record
    assert "rendered" not in res.stdout and f"me/ds-{fmt}" in res.stdout


def test_dry_run_writes_card_lists_files_and_sends_nothing(drafters, hub_env, tmp_path, monkeypatch):
    d = drafters["eagle"]
    before = digest(d)
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs no login
    card_path = tmp_path / "cards" / "README.md"
    with hub_env() as hub:
        res = invoke("push", d, "--repo", "me/ds-eagle", "--dry-run", "--card-out", card_path, "--json")
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        shown = invoke("push", d, "--repo", "me/ds-eagle", "--dry-run")  # rich: table + the card printed
        assert shown.exit_code == 0, shown.output
        inside = invoke("push", d, "--repo", "me/ds-eagle", "--dry-run", "--card-out", d / "README.md")
    assert hub.requests == []
    card = card_path.read_text()
    assert data["dry_run"] and data["commit"] is None and data["card_path"] == str(card_path)
    assert data["files"] == {**{rel: len(b) for rel, b in listing(d).items()}, "README.md": len(card.encode())}
    assert ModelCard(card).data.tags[0] == "speculative-decoding"
    assert "mtp_overlay/mtp.safetensors" in shown.stdout and "base_model:" not in card
    assert any("no base_model field" in n for n in data["notes"]) and any("no license" in n for n in data["notes"])
    assert "inside the drafter directory" in one_error_line(inside)
    assert digest(d) == before and not (d / "README.md").exists()


def test_rejected_token_is_one_clear_line_and_no_retry(drafters, hub_env, tmp_path):
    with hub_env("reject") as hub:
        res = invoke("push", drafters["medusa"], "--repo", "me/ds-medusa")
    assert one_error_line(res) == REJECTED
    assert hub.hits("create") == 1 and hub.commits == []  # create_repo (then repo_info) only: no retries
    assert_token_nowhere(res.stdout, res.stderr, roots=(tmp_path,))


@pytest.mark.parametrize("mode, endpoint", [("drop_commit", "commit"), ("drop", "create")])
def test_dropped_connection_is_retried_then_reported(drafters, hub_env, mode, endpoint):
    with hub_env(mode) as hub:
        res = invoke("push", drafters["eagle3"], "--repo", "me/ds-eagle3")
    line = one_error_line(res)
    assert line.startswith(f"recycle: error: could not reach {hub.url} after 3 attempts")
    assert hub.hits(endpoint) == 3  # RECYCLE_HUB_ATTEMPTS
    assert hub.commits == []  # nothing was committed
    assert TOKEN not in res.output


def test_a_dropped_commit_is_retried_into_exactly_one_commit(drafters, hub_env):
    server = hub_env()
    server.hub.commit_failures = 1
    with server as hub:
        res = invoke("push", drafters["medusa"], "--repo", "me/ds-medusa", "--json")
    assert res.exit_code == 0, res.output
    assert hub.hits("commit") == 2 and len(hub.commits) == 1
    assert hub.hits("create") == 2 and len(hub.repos) == 1  # the second create_repo answered 409: exist_ok


def test_server_errors_are_retried_then_reported(drafters, hub_env):
    server = hub_env()
    server.hub.commit_failures, server.hub.commit_failure = 99, 503
    with server as hub:
        res = invoke("push", drafters["medusa"], "--repo", "me/ds-medusa")
    assert one_error_line(res).startswith("recycle: error: the Hub answered HTTP 503 after 3 attempts")
    assert hub.hits("commit") == 3 and hub.commits == []


def test_no_token_is_refused_before_any_request(drafters, hub_env, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with hub_env() as hub:
        res = invoke("push", drafters["eagle3"], "--repo", "me/ds-eagle3")
    assert "no Hugging Face token" in one_error_line(res)
    assert hub.requests == []


def _drop_tensor(f: Path, name: str) -> None:
    state = load_file(str(f))
    del state[name]
    save_file(state, str(f), metadata={"format": "pt"})


def _set(f: Path, name: str, fn) -> None:
    state = load_file(str(f))
    state[name] = fn(state[name])
    save_file(state, str(f), metadata={"format": "pt"})


def _edit_json(f: Path, fn) -> None:
    obj = json.loads(f.read_text())
    fn(obj)
    f.write_text(json.dumps(obj))


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _zero_all(f: Path, record_digest: bool) -> None:
    """Every tensor of `f` zeroed (a broken conversion or training run); `record_digest`: recycle.json's sha256 says
    it is the file recycle wrote (as if recycle itself had written the zeros)."""
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    if record_digest:
        d = f.parent
        _edit_json(d / "recycle.json", lambda o: o["sha256"].update({f.name: hashlib.sha256(f.read_bytes()).hexdigest()}))


CORRUPTIONS = {
    "no recycle.json": ("eagle3", lambda d: (d / "recycle.json").unlink(), "recycle.json: missing"),
    "format disagrees": ("medusa", lambda d: _edit_json(d / "recycle.json", lambda o: o["target"].update(format="eagle3")),
                         "describes medusa, but recycle.json declares eagle3"),
    "config disagrees": ("eagle", lambda d: _edit_json(d / "config.json", lambda o: o["recycle"].update(depth=3)),
                         "weights do not fit the eagle drafter"),
    "missing tensor": ("eagle3", lambda d: _drop_tensor(d / "model.safetensors", "midlayer.mlp.up_proj.weight"),
                       "weights do not fit the eagle3 drafter"),
    "wrong shape (second layout)": ("medusa", lambda d: _set(d / "medusa_lm_head.safetensors", "0.1.weight",
                                                             lambda t: t[:-1].clone()), "recycle.json says BF16"),
    "NaN (nextn layout)": ("eagle", lambda d: _set(d / "nextn" / "nextn_layer_parameters.safetensors",
                                                   "model.layers.0.eh_proj.weight", _nan), "holds NaN or Inf"),
    "unmapped file": ("eagle3", lambda d: save_file({"stray": torch.zeros(2)}, str(d / "extra.safetensors")),
                      "extra.safetensors: not in recycle.json's mapping"),
    "missing layout": ("eagle", lambda d: shutil.rmtree(d / "nextn"), "missing, but recycle.json maps"),
    "bad bench.json": ("medusa", lambda d: (d / "bench.json").write_text('{"overall": {}}'),
                       "not a `recycle bench --json` report"),
    "all-zero weights": ("eagle", lambda d: _zero_all(d / "model.safetensors", True),
                         "is all zeros; refusing to publish degenerate weights"),
    "all-zero weights, digest stale": ("medusa", lambda d: _zero_all(d / "medusa_lm_head.safetensors", False),
                                       "is all zeros; refusing to publish degenerate weights"),
    "constant weights (overlay)": ("eagle", lambda d: _set(d / "mtp_overlay" / "mtp.safetensors",
                                                           "model.layers.10.eh_proj.weight",
                                                           lambda t: torch.full_like(t, 0.5)),
                                   "is the one value 0.5 in every entry"),
    "replaced weight file": ("eagle3", lambda d: _set(d / "model.safetensors", "midlayer.mlp.up_proj.weight",
                                                      lambda t: t * 1.5),
                             "model.safetensors: not the file recycle wrote (its sha256 differs from recycle.json's)"),
    "digest missing": ("eagle", lambda d: _edit_json(d / "recycle.json", lambda o: o["sha256"].pop("model.safetensors")),
                       "model.safetensors: recycle.json records no sha256 for it"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_invalid_drafters_are_refused_before_any_request(drafters, hub_env, tmp_path, case):
    fmt, corrupt, needle = CORRUPTIONS[case]
    d = tmp_path / fmt
    shutil.copytree(drafters[fmt], d)
    corrupt(d)
    with hub_env() as hub:
        res = invoke("push", d, "--repo", "me/broken")
    assert needle in one_error_line(res)
    assert hub.requests == []


def test_the_record_holds_each_weight_files_sha256_and_a_sound_drafter_pushes(drafters, hub_env, tmp_path):
    """convert records the sha256 of every weight file it writes (distill too: test_push_a_drafter_made_by_distill);
    push checks them and publishes a sound drafter (Medusa's zero-initialised residual blocks are fresh, not degenerate); an older record without digests
    still pushes, with a note."""
    for fmt, d in drafters.items():
        rec = json.loads((d / "recycle.json").read_text())
        files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*.safetensors"))
        assert sorted(rec["sha256"]) == files, fmt
        assert all(rec["sha256"][f] == hashlib.sha256((d / f).read_bytes()).hexdigest() for f in files), fmt
    with hub_env() as hub:
        res = invoke("push", drafters["medusa"], "--repo", "me/ok", "--dry-run", "--json")
        assert res.exit_code == 0, res.output
        assert not any("sha256" in n for n in json.loads(res.stdout)["notes"])
        old = tmp_path / "old"
        shutil.copytree(drafters["eagle"], old)
        _edit_json(old / "recycle.json", lambda o: o.pop("sha256"))
        res = invoke("push", old, "--repo", "me/ok", "--dry-run", "--json")
        assert res.exit_code == 0, res.output
        assert any("records no sha256" in n for n in json.loads(res.stdout)["notes"])
    assert hub.requests == []


def test_validate_reports_what_goes_up(drafters):
    v = validate_drafter(drafters["medusa"])
    assert v.format == "medusa" and v.bench is None
    assert set(v.files) == set(listing(drafters["medusa"]))
    assert v.tensors == 2 * 3 * 3  # two layouts of 3 heads × (weight, bias, head)


def test_base_model_name(drafters, tmp_path):
    v = validate_drafter(drafters["eagle3"])
    src = tmp_path / "my-target"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"_name_or_path": "org/Target-7B"}))
    v.record["source"]["path"] = str(src)
    assert base_model_name(v) == "org/Target-7B"  # a local source: its config's _name_or_path
    assert base_model_name(v, "other/Model") == "other/Model"  # --base-model wins
    v.record["source"]["path"] = "org/hub-model"
    assert base_model_name(v) == "org/hub-model"  # already a Hub id
    (src / "config.json").write_text("{}")
    v.record["source"]["path"] = str(src)
    assert base_model_name(v) == "my-target"  # nothing better: the directory's name


def test_card_shows_distillation_records_and_tolerates_a_dropped_layout(drafters, tmp_path):
    d = tmp_path / "distilled"
    shutil.copytree(drafters["eagle"], d)
    shutil.rmtree(d / "nextn")  # distill drops a layout it cannot rebuild exactly
    run = {"tokens": 4096, "budget_tokens": 4096, "steps": 8, "init": "recycled", "device": "cpu",
           "precision": "bf16", "train_s": 3.0, "tokens_per_s": 1365.0,
           "data": {"source": "org/chat-data", "seq_len": 64, "batch_per_rank": 2, "world_size": 1, "seed": 0},
           "final": {"loss": 1.25, "heldout_agreement_before": [0.5, 0.25], "heldout_agreement_after": [0.75, 0.5]},
           "notes": ["nextn/ dropped: its tensors cannot be rebuilt exactly from the trained weights"]}
    _edit_json(d / "recycle.json", lambda o: o.update(distillation=[run, dict(run, steps=16)]))
    res = invoke("push", d, "--repo", "me/x", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert any("nextn/ is not here" in n for n in data["notes"])
    card = ModelCard(data["card"])
    assert "distilled" in card.data.tags and card.data.datasets == ["org/chat-data"]
    assert "## Distillation" in card.text and "Run 2:" in card.text and "| optimizer steps | 16 |" in card.text
    assert "| target tokens read (budget) | 4,096 (4,096) |" in card.text
    assert "0.500 → 0.750, 0.250 → 0.500" in card.text
    assert "| hardware | cpu, bf16, 3.0 s of training at 1365 tokens/s |" in card.text  # was "0.0 s": no wall_s
    assert "nextn" not in card.text.split("## Serving")[1]  # no command for the dropped layout
    (d / "nextn").mkdir()  # present but incomplete is still refused
    assert "missing, but recycle.json maps" in one_error_line(invoke("push", d, "--repo", "me/x", "--dry-run"))


def test_push_a_drafter_made_by_distill(drafters, hub_env, tmp_path):
    if "distill" not in {c.name or c.callback.__name__ for c in app.registered_commands}:
        pytest.skip("`recycle distill` has not landed")
    out = tmp_path / "eagle3-distilled"
    res = invoke("distill", drafters["eagle3"], "--target", FIXTURE, "--tokens", "512", "--seq-len", "64",
                 "--batch", "2", "--threads", "1", "--eval-every", "100", "--checkpoint-every", "100", "-o", out,
                 "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "recycle.json").read_text())  # the digests of the files distill wrote, not its input's
    assert rec["sha256"] == {"model.safetensors": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}
    assert rec["sha256"] != json.loads((drafters["eagle3"] / "recycle.json").read_text())["sha256"]
    with hub_env() as hub:
        res = invoke("push", out, "--repo", "me/ds-eagle3-distilled")
    assert res.exit_code == 0, res.output
    commit = hub.commits[0]
    assert commit.files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    card = ModelCard(commit.files["README.md"].decode())
    assert "distilled" in card.data.tags and "## Distillation" in card.text
    assert "| target tokens read (budget) | 512 (512) |" in card.text
    assert "held-out top-1 agreement with the target by draft step" in card.text and "not distilled" not in card.text


def test_card_takes_the_license_and_publishes_no_local_path(drafters, hub_env, tmp_path, monkeypatch):
    """--license wins; otherwise the source's README front matter; the card never shows a local path."""
    d = drafters["eagle"]
    monkeypatch.delenv("HF_TOKEN")
    with hub_env():
        given = json.loads(invoke("push", d, "--repo", "me/x", "--dry-run", "--license", "mit", "--json").stdout)
    assert ModelCard(given["card"]).data.license == "mit" and given["license"] == "mit"
    src = tmp_path / "src"
    src.mkdir()
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a model\n")
    copy = tmp_path / "drafter"
    shutil.copytree(d, copy)
    rec = json.loads((copy / "recycle.json").read_text())
    rec["source"]["path"] = str(src)
    rec.setdefault("distillation", []).append({"target": "/home/someone/models/secret-target", "tokens": 10,
                                               "data": {"source": "/home/someone/data/chats.jsonl"},
                                               "losses": {"objective": "KL(P_target ‖ P_draft)"}})
    (copy / "recycle.json").write_text(json.dumps(rec))
    with hub_env():
        data = json.loads(invoke("push", copy, "--repo", "me/x", "--dry-run", "--json").stdout)
    card = ModelCard(data["card"])
    assert card.data.license == "apache-2.0"
    assert "/home/someone" not in data["card"] and str(tmp_path) not in data["card"]
    assert "secret-target" in data["card"] and "chats.jsonl" in data["card"]
    assert "KL(P_target ‖ P_draft)" in data["card"] and "pypi.org" not in data["card"]


# -- the card's content: what it claims, and only that -----------------------------------------------------------


def _card(d: Path, *extra: str) -> str:
    res = invoke("push", d, "--repo", "me/x", "--dry-run", "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["card"]


@pytest.mark.parametrize("fmt", ["eagle", "eagle3", "medusa"])
def test_card_serves_only_with_engines_that_load_the_output(drafters, fmt):
    card = _card(drafters[fmt])
    assert "llama-server" not in card and "convert_hf_to_gguf" not in card and "gguf" not in card.lower()
    assert "## Getting it" in card and "hf download me/x --local-dir x" in card
    assert "pip install recycle" not in card and "not on PyPI" in card
    serving = card.split("## Serving")[1]
    if fmt == "eagle":
        assert "recycle stitch x/mtp_overlay --target /models/deepseek_v3_mtp -o x-stitched" in serving
        assert "model_type` is `recycle_eagle`" in card
    else:  # the engines' configs stay as they are, and the card says why
        assert "not a standalone model" in card


def test_card_drops_sglang_for_the_mla_variant(tmp_path):
    d = tmp_path / "mla"
    res = invoke("convert", FIXTURE, "--to", "eagle3", "--eagle3-attention", "mla", "-o", d, "--json")
    assert res.exit_code == 0, res.output
    serving = _card(d).split("## Serving")[1]
    assert '"method": "eagle3"' in serving and "sglang" not in serving.lower()  # only vLLM loads that variant


def test_card_folds_the_mapping_and_shows_no_raw_fields(drafters, tmp_path):
    d = tmp_path / "distilled"
    shutil.copytree(drafters["eagle"], d)
    run = {"tokens": 4096, "budget_tokens": 4096, "steps": 8, "init": "recycled", "trunk_loaded": True, "online": None,
           "cache_hits": 3, "resumed": False, "timing": {"teacher_s": 1.0}, "new_field_nobody_knows": [1, 2]}
    _edit_json(d / "recycle.json", lambda o: o.update(distillation=[run]))
    card = _card(d)
    details = card[card.index("<details>"):card.index("</details>")]
    assert "<summary>" in details and "| `nextn/nextn_layer_parameters.safetensors` |" in details
    assert "`layers.N.block.mlp.experts.N.down_proj.weight` | exact | 16 |" in details
    for raw in ("trunk_loaded", "online", "cache_hits", "resumed", "teacher_s", "new_field_nobody_knows", "null",
                "| true", "| false"):
        assert raw not in card.split("## Distillation")[1].split("## Serving")[0], raw
    assert "| optimizer steps | 8 |" in card
    _edit_json(d / "recycle.json", lambda o: o["distillation"][0].update(trunk_loaded=False))
    assert "read from a `recycle harvest` cache" in _card(d)


def test_base_model_only_as_given_and_the_source_by_its_name(drafters, tmp_path):
    """A source whose config names a Hub id gets no base_model metadata unless --base-model says so; with it, the
    card says the drafter drafts for that model and was made from the source, not from the Hub model."""
    src = tmp_path / "my-target"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"_name_or_path": "org/Target-7B"}))
    d = tmp_path / "eagle3"
    shutil.copytree(drafters["eagle3"], d)
    _edit_json(d / "recycle.json", lambda o: o["source"].update(path=str(src)))
    res = invoke("push", d, "--repo", "me/x", "--dry-run", "--json")
    data = json.loads(res.stdout)
    card = ModelCard(data["card"])
    assert card.data.base_model is None and data["base_model"] is None and data["source"] == "my-target"
    assert "| source | `my-target`, family `deepseek_v3`" in card.text
    shown = invoke("push", d, "--repo", "me/x", "--dry-run")
    panel = shown.stdout.split("files that would go up")[0]
    assert "my-target" in panel and "none in the card" in panel and "org/Target-7B" not in panel
    given = ModelCard(_card(d, "--base-model", "org/Chat-7B"))
    assert given.data.base_model == "org/Chat-7B"
    assert "A speculative-decoding drafter for [org/Chat-7B]" in given.text and "drafts tokens that model verifies" \
        in given.text
    assert "| drafts for | [org/Chat-7B]" in given.text and "| source | `my-target`" in given.text
    assert "modules of `my-target`" in given.text and "modules of [org/Chat-7B]" not in given.text
    assert "recycled from my-target" in json.loads(invoke("push", d, "--repo", "me/x", "--dry-run", "--json",
                                                          "--base-model", "org/Chat-7B").stdout)["commit_message"]


def test_base_model_must_be_a_hub_id(drafters):
    assert "--base-model 'deepseek_v3_mtp': expected the Hub id" in one_error_line(
        invoke("push", drafters["eagle"], "--repo", "me/x", "--dry-run", "--base-model", "deepseek_v3_mtp"))


def test_card_benchmark_from_bench_save_shows_the_spread(drafters, tmp_path):
    d = tmp_path / "eagle"
    shutil.copytree(drafters["eagle"], d)
    (d / "bench.json").unlink()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n{"prompt": "import os\\nimport sys\\n"}\n')
    res = invoke("bench", d, "--target", FIXTURE, "--prompts", prompts, "--max-new-tokens", "6", "--tree", "chain:2",
                 "--threads", "1", "--save", "--json")
    assert res.exit_code == 0, res.output
    iqr = json.loads(res.stdout)["overall"]["spread"]["prompts"]["speedup"]
    card = _card(d)
    assert "## Benchmark" in card and "speedup per prompt (IQR)" in card
    assert f"| {iqr['q1']:.2f}–{iqr['q3']:.2f}× |" in card


def test_a_bench_report_of_another_format_is_refused(drafters, tmp_path):
    d = tmp_path / "medusa"
    shutil.copytree(drafters["medusa"], d)
    shutil.copy(drafters["eagle"] / "bench.json", d / "bench.json")
    assert "measures a eagle drafter, but this directory holds medusa" in one_error_line(
        invoke("push", d, "--repo", "me/x", "--dry-run"))


def test_an_eagle_drafter_is_not_a_plain_model(drafters, tmp_path):
    """transformers refuses recycle's EAGLE layout instead of building a random source model from it, while recycle
    still loads it, and a directory written before the model type moved (the source's at the top) loads the same."""
    from transformers import AutoModelForCausalLM

    from recycle.drafters import load_drafter

    d = drafters["eagle"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "recycle_eagle" and cfg["recycle"]["model_type"] == "deepseek_v3"
    with pytest.raises(ValueError, match="recycle_eagle"):
        AutoModelForCausalLM.from_pretrained(d)
    old = tmp_path / "old"
    shutil.copytree(d, old)
    _edit_json(old / "config.json", lambda o: (o.update(model_type="deepseek_v3"), o["recycle"].pop("model_type")))
    new_state, old_state = load_drafter(d).state_dict(), load_drafter(old).state_dict()
    assert new_state.keys() == old_state.keys() and all(torch.equal(new_state[k], old_state[k]) for k in new_state)
    assert validate_drafter(old).format == "eagle"


def test_distill_does_not_carry_the_inputs_bench_report(drafters, tmp_path):
    """bench.json measured the input's weights: a distilled copy that kept it would publish them as its own."""
    d = tmp_path / "eagle3"
    shutil.copytree(drafters["eagle3"], d)
    (d / "bench.json").write_text((drafters["eagle"] / "bench.json").read_text())
    out = tmp_path / "out"
    res = invoke("distill", d, "--target", FIXTURE, "--tokens", "200", "--seq-len", "48", "--batch", "2", "--threads",
                 "1", "--eval-every", "100", "--checkpoint-every", "100", "-o", out, "--json")
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").is_file() and not (out / "bench.json").exists()
