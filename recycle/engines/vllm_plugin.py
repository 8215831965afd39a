"""recycle's vLLM plugin: registers recycle's hidden-states connector with vLLM by name.

An entry point in the group `vllm.general_plugins` (pyproject.toml), which vLLM 0.32 loads in every process it
starts (the front end, the engine core and each worker: vllm/plugins/__init__.py:16-18 and :77-91, called from
vllm/v1/engine/core.py:129 and vllm/v1/worker/worker_base.py:276). So a worker on another node with recycle
installed finds `RecycleHiddenStatesConnector` by name, without recycle's directory on its path.
`KVConnectorFactory.register_connector` takes a module path and a class name and imports them only when a
connector of that name is built (vllm/distributed/kv_transfer/kv_connector/factory.py:31-40), so loading this
plugin imports nothing of recycle but this module (no torch of recycle's, no connector) at vLLM's start.
"""

from __future__ import annotations

import contextlib

NAME = "RecycleHiddenStatesConnector"
MODULE = "recycle.engines.vllm_cpu_connector"


def register() -> None:
    """Register the connector (lazily: by module path and class name). vLLM loads plugins once per process, but a
    second registration of a name raises ValueError (factory.py:33-34): then it is registered already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
