"""Checks of paths and arguments that need nothing heavy: no torch, no transformers, no safetensors.

The CLI runs them before it imports the libraries that take seconds to load, so bad input fails in a
fraction of a second; the library runs the same functions, so the messages are one and the same.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from recycle.errors import RecycleError

SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def max_positions(config: dict) -> int | None:
    """A model config's max_position_embeddings (a multimodal config's text_config holds it), None where it names
    none."""
    for cfg in (config, config.get("text_config") or {}):
        n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def target_context(target: str | Path) -> int | None:
    """`max_positions` of the target directory's config.json; None where it is unreadable (its own check says so)."""
    try:
        config = json.loads((Path(target).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return max_positions(config) if isinstance(config, dict) else None


def load_json(path: Path, what: str) -> dict:
    """A JSON object from a file, or a one-line RecycleError saying what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RecycleError(f"{path}: no {what} found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecycleError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise RecycleError(f"{path}: {what} is not a JSON object")
    return data


def checkpoint_dir(path: str | os.PathLike) -> dict:
    """A checkpoint directory's config.json (it must exist, be a directory and hold a config)."""
    p = Path(path)
    if not p.exists():
        raise RecycleError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise RecycleError(f"{p}: not a directory (pass the checkpoint directory)")
    return load_json(p / "config.json", "config.json")


def model_dir(path: str | os.PathLike, what: str = "--target") -> None:
    """A directory transformers can be pointed at: it exists and holds a config.json."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise RecycleError(f"{what} {p}: not a model directory (no config.json)")


def drafter_dir(path: str | os.PathLike) -> None:
    p = Path(path)
    if not p.is_dir():
        raise RecycleError(f"{p}: no such drafter directory")


def drafter_record(path: str | os.PathLike) -> dict:
    """The recycle.json of a drafter directory that recycle wrote (push publishes only those)."""
    d = Path(path).expanduser()
    drafter_dir(d)
    record = d.resolve() / "recycle.json"
    if not record.is_file():
        raise RecycleError(f"{record}: missing; push publishes directories written by recycle "
                           "(convert/distill), whose recycle.json records how the drafter was made")
    return load_json(record, "recycle.json")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def note(text: str) -> None:
    """A one-line note on stderr, as the CLI prints its own (`recycle.report.note`), for checks below the CLI."""
    print(f"recycle: note: {text}", file=sys.stderr, flush=True)


def data_path(data: str | os.PathLike | None) -> str | None:
    """`--data` as a path to protect from -o: None for a built-in corpus name or a cached dataset (`hf:NAME`)."""
    from recycle.corpus import is_corpus_name

    if data is None or str(data).startswith("hf:") or is_corpus_name(str(data)):
        return None
    return str(data)


CACHE_MANIFEST = "manifest.json"
CACHE_FORMAT = "recycle-hidden-cache/"  # the manifest's "format", before its version
# The records recycle writes into its outputs, which mark a directory --overwrite may replace: a drafter's
# provenance (convert, distill), a harvest cache's manifest, a stitched checkpoint's record.
DRAFTER_RECORD, STITCH_RECORD = "recycle.json", "recycle-stitch.json"
RECORDS = (DRAFTER_RECORD, CACHE_MANIFEST, STITCH_RECORD)


def recycle_output(path: str | os.PathLike, records: tuple[str, ...] | None = None) -> bool:
    """Whether --overwrite may replace directory `path`: it is empty, or recycle wrote it (it holds one of `RECORDS`,
    a cache manifest only with recycle's format; `records`: another writer's record files instead)."""
    p = Path(path)
    try:
        if not any(p.iterdir()):
            return True
    except OSError:
        return False
    for name in records or RECORDS:
        if not (p / name).is_file():
            continue
        if name != CACHE_MANIFEST or records:
            return True
        try:
            manifest = load_json(p / name, "cache manifest")
        except RecycleError:
            continue
        if str(manifest.get("format", "")).startswith(CACHE_FORMAT):
            return True
    return False


def output_dir(out: str | os.PathLike, overwrite: bool = False, protect: Iterable[str | os.PathLike | None] = (),
               records: tuple[str, ...] | None = None) -> Path:
    """Where an output may go: not an input (`protect`: every path the command reads) or inside one, not around
    one, never `/`, $HOME, the working directory or an ancestor of them, and not an existing directory unless
    `overwrite` and it is empty or recycle wrote it (`recycle_output`; `records`: the record files
    that mark another writer's outputs). Returns the resolved path."""
    o = Path(out).expanduser().resolve()
    for p in protect:
        if p is None:
            continue
        src = Path(p).expanduser().resolve()
        if _inside(o, src):
            raise RecycleError(f"{o}: the output must not be an input ({src}) or inside one; choose another -o")
        if _inside(src, o):
            raise RecycleError(f"{o}: the output contains the input {src}; choose another -o")
    try:
        cwd = os.getcwd()
    except OSError:  # removed under us: nothing there to protect
        cwd = None
    for what, place in (("your home directory", os.environ.get("HOME")), ("the working directory", cwd)):
        if place and _inside(Path(place).expanduser().resolve(), o):
            which = "is" if Path(place).expanduser().resolve() == o else "contains"
            raise RecycleError(f"{o}: the output {which} {what}; choose a new directory for -o")
    if o.exists() or o.is_symlink():
        if not o.is_dir():
            raise RecycleError(f"{o}: exists and is not a directory")
        if not overwrite:
            raise RecycleError(f"{o}: already exists (pass --overwrite to replace it)")
        if not recycle_output(o, records):
            raise RecycleError(f"{o}: not empty and not written by recycle (no {', '.join(records or RECORDS)}): "
                               "--overwrite replaces only recycle's own outputs; remove it yourself or choose "
                               "another -o")
    return o


# -- one writer per output: the lock, and what a stopped run left -------------------------------------------------

LOCK_SUFFIX = ".recycle-lock"  # `.OUT.recycle-lock` beside OUT, held (flock) while a run writes OUT
TMP_INFIX = ".recycle-tmp-"  # `.OUT.recycle-tmp-*`: an output being written
OLD_INFIX = ".recycle-old-"  # `.OUT.recycle-old-*`: the output it replaces, between the two renames of a swap
NO_LOCKS = frozenset({errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS})  # flock unsupported there
PID_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")  # `.FILE.tmp-PID`: one process's atomic write of FILE (distill's state)


def sibling(out: Path, infix: str, tag: str = "") -> Path:
    """`.OUT{infix}{tag}` beside OUT."""
    return out.parent / f".{out.name}{infix}{tag}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


class OutputLock:
    """An exclusive lock on an output directory for one run: `flock` on `.OUT.recycle-lock` beside it, taken before
    the run looks at OUT and held until it has written it, so a second run into the same OUT refuses in one line
    instead of replacing the first one's output (or mixing into its state). The kernel drops the lock when the
    process dies, however it dies; the file is removed on release (under the lock, and a taker checks that the file
    it locked is still the one at the path, so a release racing a take cannot leave two holders).

    Whoever holds it may clean what a stopped run left beside OUT (`sweep`): every writer of OUT holds the lock, so
    a temporary sibling nobody holds is an orphan."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = sibling(out, LOCK_SUFFIX)
        self.fd: int | None = None
        self.made: list[Path] = []  # parent directories this lock created (removed again if left empty)
        self.exclusive = False  # False on a filesystem without flock: nothing is swept then

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self, wait: str | None = None) -> OutputLock:
        """Take the lock; held by another run, refuse in one line, or with `wait` (what the holder is doing) say so
        and wait for it."""
        if self.fd is not None:
            return self
        missing = [d for d in (self.out.parent, *self.out.parent.parents) if not d.exists()]
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.made = missing
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno in NO_LOCKS:  # a filesystem without flock: write unlocked, as before locks
                        self.exclusive = False
                        break
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        os.close(fd)
                        raise
                    if wait is None:
                        os.close(fd)
                        self._unmake()
                        raise RecycleError(f"{self.out}: another recycle run{f' (pid {holder})' if holder else ''} "
                                           "is writing it now; wait for it to finish or choose another -o") from None
                    note(f"another recycle run{f' (pid {holder})' if holder else ''} is {wait}; waiting for it to "
                         "finish")
                    fcntl.flock(fd, fcntl.LOCK_EX)
                self.exclusive = True
                try:  # its last holder may have removed the file between our open and flock: lock the one there now
                    st, own = os.stat(self.path), os.fstat(fd)
                    same = (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            self._unmake()
            raise RecycleError(f"{self.out}: cannot write here ({e.strerror or e})") from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        self._unmake()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter exit; the kernel drops the lock with the process
            pass

    def _unmake(self) -> None:
        for d in self.made:  # deepest first
            try:
                d.rmdir()
            except OSError:
                break
        self.made = []

    def sweep(self) -> list[str]:
        """Under the lock: put back an output a stopped run had moved aside and not replaced (OUT missing,
        `.OUT.recycle-old-*` there), and remove every other temporary sibling of OUT; returns one note per action."""
        assert self.fd is not None, "sweep holds the lock"
        notes: list[str] = []
        if not self.exclusive:  # another run may be writing beside OUT: leave its files alone
            return notes
        pattern = lambda infix: glob.escape(str(sibling(self.out, infix))) + "*"
        olds = sorted((Path(p) for p in glob.glob(pattern(OLD_INFIX))), key=lambda p: p.lstat().st_mtime)
        if olds and not (self.out.exists() or self.out.is_symlink()):
            back = olds.pop()
            os.rename(back, self.out)
            notes.append(f"{self.out}: restored the output a stopped run had moved aside ({back.name})")
        stale = olds + [Path(p) for p in glob.glob(pattern(TMP_INFIX))]
        for p in stale:
            _remove(p)
        if stale:
            notes.append(f"removed {len(stale)} temporary cop{'y' if len(stale) == 1 else 'ies'} of {self.out} left "
                         f"by a stopped run ({', '.join(sorted(p.name for p in stale))})")
        return notes


def sweep_dead_writes(directory: Path) -> list[str]:
    """`.FILE.tmp-PID` files (or folders) in `directory` whose process is gone: atomic writes a killed run never
    renamed (distill's `.checkpoint.pt.tmp-PID`, `.best-*.tmp-PID`); removed, with one note."""
    gone = []
    try:
        entries = list(directory.iterdir()) if directory.is_dir() else []
    except OSError:
        return []
    for p in entries:
        m = PID_TEMP.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _remove(p)
            gone.append(p.name)
    return [f"{directory}: removed {len(gone)} partial file(s) a stopped run left ({', '.join(sorted(gone))})"] \
        if gone else []


def parse_tokens(value: str | int, option: str = "--tokens") -> int:
    """'2M' → 2_000_000; accepts k/M/B (case-insensitive), decimals ('1.5M'), underscores, plain ints."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([kKmMbBgGtT]?)\s*", str(value).replace("_", "").replace(",", ""))
        if not m:
            raise RecycleError(f"{option} {value!r}: expected a count like 300k, 2M, 1.5B or 500000")
        n = int(round(float(m.group(1)) * SUFFIXES[m.group(2).lower()]))
    if n < 1:
        raise RecycleError(f"{option} {value!r}: the budget must be at least 1 token")
    return n


def duration(seconds: float) -> str:
    """A length of time as a person reads it: 40 s, 12 min, 3.5 h, 6.9 days."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


DEFAULT_SHARD_SIZE = "5GB"  # huggingface_hub's and transformers' default: what the Hub and every loader expect
SMALL_SHARD = 10**6  # under 1 MB a shard holds a tensor or two: the writer says how many files that makes


def parse_size(value: str | int | None, option: str = "--max-shard-size") -> int | None:
    """'5GB' → 5_000_000_000 (huggingface_hub's units and parser: KB, MB, GB, TB, powers of 1000, as the Hub and
    transformers count a shard); None or 'none': no limit."""
    if value is None or isinstance(value, int):
        return value
    if str(value).strip().lower() in ("none", "0"):
        return None
    from huggingface_hub.serialization._base import parse_size_to_int  # the parser save_pretrained's sizes go through

    try:
        n = parse_size_to_int(str(value))
    except ValueError:
        raise RecycleError(f"{option} {value!r}: expected a size like 5GB, 500MB or 100KB (or none)") from None
    if n < 1:
        raise RecycleError(f"{option} {value!r}: a shard holds at least one byte")
    return n


def data_name(data: str | os.PathLike | None) -> None:
    """`--data`: a corpus name or a path that exists."""
    from recycle.corpus import corpus_root, is_corpus_name

    if data is None or str(data).startswith("hf:"):  # a cached dataset by name: found (or not) when read
        return
    if is_corpus_name(str(data)):
        corpus_root(str(data))
    elif not Path(data).expanduser().exists():
        raise RecycleError(f"--data {Path(data).expanduser()}: no such file or directory")
