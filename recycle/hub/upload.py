"""Publishing: one `create_commit` after `create_repo`/`create_branch`. Files are pre-uploaded first and the
commit call is the only step that changes the repository, so a failure at any earlier point leaves nothing.
(`upload_folder` in huggingface_hub ≥ 1.x with hf_xet splits a large folder into several "(part N)" commits, and
it cannot add the generated README.md without writing into the input directory, so it is not used.)
The token is resolved by huggingface_hub (HF_TOKEN, then the saved login) and only ever handed to HfApi; nothing
here prints, logs or writes it. The endpoint follows HF_ENDPOINT at call time."""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from recycle import __version__
from recycle.errors import RecycleError
from recycle.hub.card import LIBRARY, build_card, license_name, source_name
from recycle.hub.validate import CARD, Progress, validate_drafter
from recycle.options import PushOptions

DEFAULT_ENDPOINT = "https://huggingface.co"
ATTEMPTS_ENV, BACKOFF_ENV = "RECYCLE_HUB_ATTEMPTS", "RECYCLE_HUB_BACKOFF"
DEFAULT_ATTEMPTS, DEFAULT_BACKOFF = 3, 2.0
TRANSIENT_STATUS = (500, 502, 503, 504)


def hub_endpoint() -> str:
    """HF_ENDPOINT read at call time (huggingface_hub freezes it at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _env_number(name: str, default: float, cast: type) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise RecycleError(f"{name}={raw!r}: not a number") from None
    if value < 0 or (cast is int and value < 1):
        raise RecycleError(f"{name}={raw!r}: out of range")
    return value


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of whichever HTTP client this huggingface_hub uses (httpx2 in 2.x,
    httpx in 1.x, requests before)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                       ("requests", ("ConnectionError", "Timeout"))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        errors += [getattr(m, n) for n in names if isinstance(getattr(m, n, None), type)]
    return tuple(errors)


def _server_message(e: BaseException, secret: str | None) -> str:
    """First line of the Hub's message, the token masked should a server ever echo it."""
    msg = getattr(e, "server_message", None) or (str(e).splitlines() or [type(e).__name__])[0]
    msg = " ".join(str(msg).split())[:200]
    return msg.replace(secret, "***") if secret else msg


def _with_retries(call: Callable[[], dict], endpoint: str, attempts: int, backoff: float,
                  secret: str | None) -> dict:
    """Run the whole create → branch → commit sequence, retrying connection failures and 5xx with
    exponential backoff. Safe to repeat: create_repo/create_branch are idempotent with exist_ok, and the
    commit is one POST after the pre-upload, so a failed attempt has committed nothing."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    transport = _transport_errors()
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except OfflineModeIsEnabled:
            raise RecycleError("HF_HUB_OFFLINE is set: unset it to push") from None
        except HfHubHTTPError as e:
            status = e.response.status_code if getattr(e, "response", None) is not None else None
            if status in (401, 403):
                raise RecycleError(f"the Hub rejected the token (HTTP {status}): run `hf auth login` or set HF_TOKEN"
                                   ) from None
            if status in TRANSIENT_STATUS and attempt < attempts:
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            msg = _server_message(e, secret)
            tail = f" after {attempts} attempts" if status in TRANSIENT_STATUS else ""
            raise RecycleError(f"the Hub answered HTTP {status}{tail}: {msg}") from None
        except ValueError as e:  # huggingface_hub's own check of the card metadata (validate-yaml)
            raise RecycleError(f"the Hub refused the upload: {_server_message(e, secret)}") from None
        except transport as e:
            if attempt < attempts:
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            raise RecycleError(f"could not reach {endpoint} after {attempts} attempts ({type(e).__name__})") from None
    raise AssertionError("unreachable")


def push_drafter(opts: PushOptions, progress: Progress | None = None) -> dict:
    """Validate a drafter directory, write its model card and (unless dry_run) upload it in one commit.

    The input directory is never modified: the card goes up as README.md from memory, and locally
    only to `card_out` (which must lie outside the directory). Returns a summary dict.
    """
    opts.validate()
    repo, revision, private, base_model, license = opts.repo, opts.revision, opts.private, opts.base_model, opts.license
    endpoint = hub_endpoint()
    attempts = max(1, int(opts.attempts if opts.attempts is not None else _env_number(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, int)))
    backoff = float(opts.backoff if opts.backoff is not None else _env_number(BACKOFF_ENV, DEFAULT_BACKOFF, float))
    token = None
    if not opts.dry_run:  # before the slow checks: a missing login is the commonest failure
        from huggingface_hub import get_token

        token = get_token()
        if not token:
            raise RecycleError("no Hugging Face token: run `hf auth login` or set HF_TOKEN")
    src = Path(opts.drafter).expanduser()
    card_out = Path(opts.card_out).expanduser().resolve() if opts.card_out is not None else None
    drafter = validate_drafter(src, progress=progress)
    card = build_card(drafter, repo, base_model, license)
    card_text = card.content
    card_bytes = card_text.encode("utf-8")
    uploads = {**drafter.files, CARD: len(card_bytes)}
    source = source_name(drafter)
    notes = list(drafter.notes)
    if base_model is None:
        notes.append(f"the card has no base_model field (recycle does not guess one from {source}): pass "
                     "--base-model OWNER/NAME, the Hub id of the model it drafts for, to link it")
    lic, why = license_name(drafter, license)
    if lic is None:
        notes.append(f"the card has no license field: {why}")
    if card_out is not None:
        card_out.parent.mkdir(parents=True, exist_ok=True)
        card_out.write_bytes(card_bytes)
    message = opts.commit_message or f"Upload {drafter.format} drafter recycled from {source} (recycle {__version__})"
    result = {
        "repo": repo, "endpoint": endpoint, "revision": revision or "main", "private": private, "dry_run": opts.dry_run,
        "drafter": str(drafter.path), "format": drafter.format, "base_model": base_model, "source": source,
        "license": lic,
        "files": dict(sorted(uploads.items())), "bytes": sum(uploads.values()), "tensors_checked": drafter.tensors,
        "bench": drafter.bench is not None, "card_path": str(card_out) if card_out is not None else None,
        "card_metadata": card.data.to_dict(), "commit_message": message, "commit": None, "notes": notes,
    }
    if opts.dry_run:
        if card_out is None:
            result["card"] = card_text
        return result

    from huggingface_hub import CommitOperationAdd, HfApi

    def attempt() -> dict:
        api = HfApi(endpoint=endpoint, token=token, library_name=LIBRARY, library_version=__version__)
        url = api.create_repo(repo, private=True if private else None, repo_type="model", exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(drafter.path / rel)) for rel in drafter.files]
        ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card_bytes))
        info = api.create_commit(repo, ops, commit_message=message, revision=revision, repo_type="model")
        return {"url": str(url), "commit_url": info.commit_url, "oid": info.oid}

    result["commit"] = _with_retries(attempt, endpoint, attempts, backoff, token)
    return result
