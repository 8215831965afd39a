"""What an output may replace, whose files a checkpoint may name, one run per output, and what a stopped run left.

Issue 45, items 0, 1 and 12: `--overwrite` replaces only an empty directory or one recycle wrote, never $HOME, the
working directory (or an ancestor) or an input; a shard index cannot lead a reader (or stitch's writer) outside the
checkpoint; a second run into an OUT that a run is writing refuses; temporary siblings a killed run left are removed
(and an output it had moved aside is put back) by the next run, which says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.errors import RecycleError
from recycle.io.writer import OutputDir
from recycle.preflight import OLD_INFIX, TMP_INFIX, OutputLock, output_dir, sibling

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

SENTINEL = "SENTINEL"
FAST = ["--tokens", "16", "--seq-len", "8", "--batch", "2", "--threads", "1"]  # one step (add --data: seconds)


@pytest.fixture(scope="module")
def drafter(converted) -> Path:
    """An EAGLE drafter of the fixture: distill's input, and its mtp_overlay/ stitch's."""
    return converted("eagle")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """distill's options for a one-step run on a small text file (the stdlib corpus takes longer to read)."""
    text = tmp_path_factory.mktemp("text") / "code.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    return [*FAST, "--data", str(text)]


def _precious(d: Path) -> Path:
    """A directory recycle did not write: a file and a folder of someone's."""
    (d / "sub").mkdir(parents=True)
    (d / SENTINEL).write_text("mine")
    (d / "sub" / "x").write_text("x")
    return d


def _intact(d: Path) -> None:
    assert (d / SENTINEL).read_text() == "mine" and (d / "sub" / "x").is_file()


# Each command that takes --overwrite, with its inputs: (argv before -o, the inputs it reads).
def _commands(drafter: Path, data: Path) -> dict[str, list[str]]:
    return {
        "convert": ["convert", str(FIXTURE), "--to", "eagle"],
        "distill": ["distill", str(drafter), "--target", str(FIXTURE), "--data", str(data), *FAST],
        "stitch": ["stitch", str(drafter / "mtp_overlay"), "--target", str(FIXTURE)],
        "harvest": ["harvest", "--target", str(FIXTURE), "--tokens", "1k", "--data", str(data)],  # refused before vLLM
    }


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data" / "corpus.txt"
    data.parent.mkdir()
    data.write_text("def f(x):\n    return x + 1\n" * 400)
    return data


@pytest.mark.parametrize("command", ["convert", "distill", "stitch", "harvest"])
def test_overwrite_refuses_what_recycle_did_not_write(command: str, drafter: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data(tmp_path)
    argv = _commands(drafter, data)[command]
    # a directory of someone's files: refused, even with --overwrite, and nothing in it touched
    mine = _precious(tmp_path / "mine")
    assert_bad_input(run_cli(*argv, "-o", str(mine), "--overwrite"), "not written by recycle")
    _intact(mine)
    # $HOME (a fake one holding .ssh), and an ancestor of it
    home = _precious(tmp_path / "home" / "me")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("key")
    monkeypatch.setenv("HOME", str(home))
    assert_bad_input(run_cli(*argv, "-o", "~", "--overwrite"), "home directory")
    assert_bad_input(run_cli(*argv, "-o", str(home.parent), "--overwrite"), "home directory")
    _intact(home)
    assert (home / ".ssh" / "id_ed25519").is_file()
    # the working directory, an ancestor of it, and /
    work = _precious(tmp_path / "work")
    monkeypatch.chdir(work / "sub")
    assert_bad_input(run_cli(*argv, "-o", ".", "--overwrite"), "working directory")
    assert_bad_input(run_cli(*argv, "-o", "..", "--overwrite"), "working directory")
    assert_bad_input(run_cli(*argv, "-o", "/", "--overwrite"), "/")
    _intact(work)
    # the directory of --data (its ancestor) and the data file itself; the target's and the inputs' own folders
    if command in ("distill", "harvest"):
        assert_bad_input(run_cli(*argv, "-o", str(data.parent), "--overwrite"), "contains the input")
        assert_bad_input(run_cli(*argv, "-o", str(data), "--overwrite"), "must not be an input")
        assert data.is_file()
    assert_bad_input(run_cli(*argv, "-o", str(FIXTURE.parent), "--overwrite"), "contains the input")
    if command in ("distill", "stitch"):
        assert_bad_input(run_cli(*argv, "-o", str(drafter), "--overwrite"), "input")
        assert (drafter / "recycle.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_harvest_drafter_is_protected(drafter: Path, tmp_path: Path) -> None:
    """harvest's --drafter (whose aux layers it reads) is an input too."""
    assert_bad_input(run_cli("harvest", "--target", str(FIXTURE), "--tokens", "1k", "--drafter", str(drafter),
                             "-o", str(drafter.parent), "--overwrite"), "contains the input")


def test_earlier_outputs_are_replaced(drafter: Path, tmp_path: Path) -> None:
    """What recycle wrote (and an empty directory) is still replaced with --overwrite: a drafter (convert, distill),
    a stitched checkpoint, a harvest cache (checked where harvest checks it, before vLLM)."""
    out = tmp_path / "drafter"
    out.mkdir()  # empty: fine
    assert run_cli("convert", str(FIXTURE), "--to", "medusa", "-o", str(out), "--overwrite").exit_code == 0
    (out / "notes.txt").write_text("old")
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(out), "--overwrite")
    assert res.exit_code == 0, res.output
    assert not (out / "notes.txt").exists() and json.loads((out / "recycle.json").read_text())["target"]["format"] \
        == "eagle"
    st = tmp_path / "stitched"
    for _ in range(2):
        res = run_cli("stitch", str(drafter / "mtp_overlay"), "--target", str(FIXTURE), "-o", str(st), "--overwrite")
        assert res.exit_code == 0, res.output
    assert (st / "recycle-stitch.json").is_file()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": "recycle-hidden-cache/1"}))
    assert output_dir(cache, True, (FIXTURE,)) == cache.resolve()
    (cache / "manifest.json").write_text(json.dumps({"format": "someone-elses/2"}))  # a manifest.json, not recycle's
    with pytest.raises(RecycleError, match="not written by recycle"):
        output_dir(cache, True, (FIXTURE,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "drafter", "stitched"]


def test_distill_replaces_its_earlier_output(drafter: Path, quick: list[str], tmp_path: Path) -> None:
    out = tmp_path / "d"
    args = ["distill", str(drafter), "--target", str(FIXTURE), *quick, "-o", str(out)]
    assert run_cli(*args).exit_code == 0
    res = run_cli(*args, "--overwrite")
    assert res.exit_code == 0, res.output
    assert (out / "recycle.json").is_file()


# -- the shard index ------------------------------------------------------------------------------------------------


def _escaping(tmp_path: Path, how: str) -> Path:
    """A two-shard copy of the fixture whose second shard lies outside its directory: named `../outside.safetensors`
    by the index, named by its absolute path, or a symlink in the directory pointing out."""
    ck = tmp_path / "deep" / "ck"
    ck.mkdir(parents=True)
    for f in FIXTURE.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, ck / f.name)
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(ck / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    outside = tmp_path / "deep" / "outside.safetensors"
    save_file({n: tensors[n] for n in names[half:]}, str(outside), metadata={"format": "pt"})
    second = {"dotdot": "../outside.safetensors", "absolute": str(outside),
              "symlink": "model-00002-of-00002.safetensors"}[how]
    if how == "symlink":
        (ck / second).symlink_to(outside)
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" if i < half else second
                                            for i, n in enumerate(names)}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    return ck


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_shard_index_cannot_leave_the_checkpoint(how: str, drafter: Path, tmp_path: Path) -> None:
    ck = _escaping(tmp_path, how)
    needle = "a link to" if how == "symlink" else "outside the checkpoint directory"
    assert_bad_input(run_cli("inspect", str(ck)), needle)
    assert_bad_input(run_cli("convert", str(ck), "--to", "eagle", "-o", str(tmp_path / "c")), needle)
    st = tmp_path / "deep" / "sub" / "st"
    assert_bad_input(run_cli("stitch", str(drafter / "mtp_overlay"), "--target", str(ck), "-o", str(st)), needle)
    assert_bad_input(run_cli("bench", str(drafter), "--target", str(ck), "--quick"), needle)
    assert_bad_input(run_cli("distill", str(drafter), "--target", str(ck), *FAST, "-o", str(tmp_path / "d")), needle)
    assert not (tmp_path / "deep" / "sub").exists() and not (tmp_path / "c").exists()
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["ck", "outside.safetensors"]


def test_a_link_outside_without_an_index_is_refused_too(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(FIXTURE / "config.json", ck / "config.json")
    (ck / "model.safetensors").symlink_to(FIXTURE / "model.safetensors")
    assert_bad_input(run_cli("inspect", str(ck)), "outside the checkpoint directory")


def test_huggingface_cache_links_are_read(tmp_path: Path) -> None:
    """huggingface_hub's cache: snapshots/REV/FILE links to ../../blobs/HASH, outside the snapshot but its own."""
    repo = tmp_path / "models--me--tiny"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(FIXTURE.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    res = run_cli("inspect", str(snap), "--json")
    assert res.exit_code == 0, res.output


def test_stitch_writes_only_under_its_output(drafter: Path, tmp_path: Path) -> None:
    st = tmp_path / "deep" / "sub" / "st"
    res = run_cli("stitch", str(drafter / "mtp_overlay"), "--target", str(FIXTURE), "-o", str(st), "--json")
    assert res.exit_code == 0, res.output
    every = [p for p in tmp_path.rglob("*")]
    assert all(p == st or st in p.parents or p in st.parents for p in every), every
    index = json.loads((st / "model.safetensors.index.json").read_text())
    for f in set(index["weight_map"].values()):
        assert (st / f).resolve().parent == st.resolve(), f
    assert sorted(p.name for p in st.parent.iterdir()) == ["st"]


def test_the_writer_refuses_a_name_leaving_its_output(tmp_path: Path) -> None:
    with pytest.raises(RecycleError, match="outside the output"):
        with OutputDir(tmp_path / "o") as d:
            d.copy_file(FIXTURE / "config.json", "../escaped.json", link=True)
    assert list(tmp_path.iterdir()) == []


# -- one run per output ---------------------------------------------------------------------------------------------


@contextmanager
def _hold(out: Path) -> Iterator[subprocess.Popen]:
    """Another process holding OUT's lock (a run in progress), until its stdin closes (or the block ends)."""
    code = ("import sys; from pathlib import Path; from recycle.preflight import OutputLock; "
            f"lock = OutputLock(Path({str(out.resolve())!r})).acquire(); print('held', flush=True); sys.stdin.read()")
    with helpers.popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout.readline().strip() == "held"
        yield p


def test_a_second_run_into_the_same_output_refuses(drafter: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    with _hold(out) as holder:
        for argv in (["distill", str(drafter), "--target", str(FIXTURE), *FAST],
                     ["convert", str(FIXTURE), "--to", "eagle"],
                     ["stitch", str(drafter / "mtp_overlay"), "--target", str(FIXTURE)]):
            assert_bad_input(run_cli(*argv, "-o", str(out), "--overwrite"), f"another recycle run (pid {holder.pid})")
        assert not out.exists() and not (tmp_path / "o.distill").exists()
        holder.stdin.close()
        holder.wait(timeout=30)
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(out))  # the holder is gone: the lock is free
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_distill_holds_its_output_from_start_to_finish(drafter: Path, quick: list[str], tmp_path: Path) -> None:
    """While distill trains (long before it writes OUT), OUT is locked; the lock goes with the run."""
    out = tmp_path / "d"
    seen = []

    def progress(row: dict) -> None:
        with pytest.raises(RecycleError, match="another recycle run"):
            OutputLock(out).acquire()
        seen.append(row["step"])

    opts = DistillOptions(drafter=str(drafter), target=str(FIXTURE), tokens=32, seq_len=8, batch=2, eval_rows=2,
                          threads=1, data=quick[-1], out=str(out))
    distill(opts, progress=progress)
    assert seen == [1, 2]
    OutputLock(out).acquire().release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d.distill"]


# -- what a stopped run left ------------------------------------------------------------------------------------------


def _dead_pid() -> int:
    with helpers.popen([sys.executable, "-c", "pass"]) as p:
        p.wait(timeout=60)
    return p.pid


def test_the_next_run_removes_a_killed_runs_temporaries(tmp_path: Path) -> None:
    out = tmp_path / "o"
    convert_checkpoint(FIXTURE, "medusa", out)
    for infix, tag in ((TMP_INFIX, "deadbeef"), (OLD_INFIX, "cafe0001")):
        junk = sibling(out, infix, tag)
        junk.mkdir()
        (junk / "model.safetensors").write_bytes(b"\0" * 1000)
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(out), "--overwrite")
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.stderr.splitlines() if "removed 2 temporary copies" in ln]
    assert len(notes) == 1 and notes[0].startswith("recycle: note:"), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert json.loads((out / "recycle.json").read_text())["target"]["format"] == "eagle"


def test_an_output_moved_aside_by_a_killed_run_is_put_back(tmp_path: Path) -> None:
    """Killed between the two renames of a swap (no exchange on that filesystem): OUT is gone, the old output waits
    beside it; the next run into OUT puts it back (and, without --overwrite, refuses to replace it)."""
    out = tmp_path / "o"
    convert_checkpoint(FIXTURE, "medusa", out)
    before = sorted(p.name for p in out.iterdir())
    os.rename(out, sibling(out, OLD_INFIX, "0badc0de"))
    sibling(out, TMP_INFIX, "0badc0df").mkdir()  # the new one, complete or not: removed
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(out))
    assert res.exit_code == 2 and "already exists" in res.stderr.splitlines()[-1], res.output
    assert any("restored the output" in ln for ln in res.stderr.splitlines()), res.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    assert json.loads((out / "recycle.json").read_text())["target"]["format"] == "medusa"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_the_swap_without_an_exchange_still_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import recycle.io.writer as writer

    out = tmp_path / "o"
    convert_checkpoint(FIXTURE, "medusa", out)
    monkeypatch.setattr(writer, "exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    convert_checkpoint(FIXTURE, "eagle", out, overwrite=True)
    assert json.loads((out / "recycle.json").read_text())["target"]["format"] == "eagle"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_distill_removes_a_killed_runs_partial_state_files(drafter: Path, quick: list[str], tmp_path: Path) -> None:
    out, pid = tmp_path / "d", _dead_pid()
    state = tmp_path / "d.distill"
    state.mkdir()
    partial = [state / f".checkpoint.pt.tmp-{pid}", state / f".best-00000003.safetensors.tmp-{pid}"]
    for p in partial:
        p.write_bytes(b"\0" * 100)
    live = state / f".best-00000001.safetensors.tmp-{os.getppid()}"  # a live process's: left alone
    live.write_bytes(b"")
    res = run_cli("distill", str(drafter), "--target", str(FIXTURE), *quick, "-o", str(out))
    assert res.exit_code == 0, res.output
    assert any("removed 2 partial file(s)" in ln for ln in res.stderr.splitlines()), res.stderr
    assert not any(p.exists() for p in partial) and live.exists()


def test_a_release_that_ships_its_own_code_is_never_run_nor_asked_about(family_dir, tmp_path):
    """MiMo-V2.5 ships its own config class (config.json's `auto_map`: transformers has none for `mimo_v2`). Before,
    transformers asked on the terminal whether to run it ("Do you wish to run the custom code? [y/N]", twice per
    bench: the tokenizer's loader), and a "y" ran it. recycle now reads such a release with trust_remote_code=False
    everywhere: here a "y" is typed, and the release's module, which would leave a file behind if imported, is not."""
    from fixtures.families import write_tokenizer

    src = tmp_path / "v25"
    shutil.copytree(family_dir("mimo_v2"), src)
    write_tokenizer(src)
    ran = tmp_path / "ran"
    (src / "configuration_mimo_v2.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                                   "from transformers import PretrainedConfig\n\n\n"
                                                   "class MiMoV2Config(PretrainedConfig):\n    model_type = 'mimo_v2'\n")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_mimo_v2.MiMoV2Config"}
    (src / "config.json").write_text(json.dumps(config))
    from typer.testing import CliRunner

    from recycle.cli import app

    res = CliRunner().invoke(app, ["bench", "--target", str(src), "--native-mtp", "--quick", "--max-new-tokens", "2", "--json"],
                             input="y\ny\ny\ny\n")
    assert res.exit_code == 0, res.output
    assert "custom code" not in res.output + res.stderr
    assert not ran.exists()
