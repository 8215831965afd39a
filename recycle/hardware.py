"""Accelerators as data: peak memory bandwidth, dense bf16 tensor FLOPs and memory, with sources.

One table serves `recycle bench` (achieved bandwidth against the device's peak) and `recycle plan`
(the roofline across GPUs). Figures are the vendors' datasheet numbers for dense (not 2:4-sparse)
bf16 tensor math; a device is matched on the name torch reports. `resolve_device` (`--device`) and `sync` are the
one of each that bench, plan, the decode loop and distill use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from recycle.errors import RecycleError, did_you_mean


@dataclass(frozen=True)
class GPU:
    key: str  # the name `--gpu` takes
    title: str
    bandwidth_gbs: float  # peak HBM/GDDR bandwidth, GB/s
    bf16_tflops: float  # peak dense bf16 tensor throughput, TFLOP/s
    memory_gb: float
    names: tuple[str, ...]  # substrings of torch.cuda.get_device_name() that identify it (first match wins)
    source: str


GPUS: tuple[GPU, ...] = (
    GPU("H200", "NVIDIA H200 SXM 141GB", 4800.0, 989.0, 141.0, ("H200",),
        "NVIDIA H200 Tensor Core GPU datasheet (2024): 4.8 TB/s, BF16 1,979 TFLOPS with sparsity"),
    GPU("H100-PCIe", "NVIDIA H100 PCIe 80GB", 2000.0, 756.0, 80.0, ("H100 PCIe",),
        "NVIDIA H100 Tensor Core GPU datasheet (2023): 2 TB/s, BF16 1,513 TFLOPS with sparsity"),
    GPU("H100", "NVIDIA H100 SXM 80GB", 3350.0, 989.0, 80.0, ("H100",),
        "NVIDIA H100 Tensor Core GPU datasheet (2023): 3.35 TB/s, BF16 1,979 TFLOPS with sparsity"),
    GPU("A100-40GB", "NVIDIA A100 SXM 40GB", 1555.0, 312.0, 40.0, ("A100-SXM4-40GB", "A100-PCIE-40GB"),
        "NVIDIA A100 Tensor Core GPU datasheet (2021): 1,555 GB/s, BF16 312 TFLOPS"),
    GPU("A100", "NVIDIA A100 SXM 80GB", 2039.0, 312.0, 80.0, ("A100",),
        "NVIDIA A100 Tensor Core GPU datasheet (2021): 2,039 GB/s, BF16 312 TFLOPS"),
    GPU("L40S", "NVIDIA L40S 48GB", 864.0, 362.0, 48.0, ("L40S",),
        "NVIDIA L40S datasheet (2023): 864 GB/s, BF16 362.05 TFLOPS (733 with sparsity)"),
    GPU("L4", "NVIDIA L4 24GB", 300.0, 121.0, 24.0, ("L4",),
        "NVIDIA L4 datasheet (2023): 300 GB/s, BF16 242 TFLOPS with sparsity"),
    GPU("RTX4090", "NVIDIA GeForce RTX 4090 24GB", 1008.0, 165.2, 24.0, ("RTX 4090",),
        "NVIDIA Ada Lovelace architecture whitepaper v2.1, Appendix A: 1,008 GB/s, "
        "BF16 tensor 165.2 TFLOPS with FP32 accumulate"),
)  # fmt: skip


def gpu(key: str) -> GPU:
    """A table entry by `--gpu` name (case-insensitive); unknown names list the known ones."""
    for g in GPUS:
        if g.key.lower() == key.strip().lower():
            return g
    keys = [g.key for g in GPUS]
    raise RecycleError(f"--gpu {key!r}: unknown GPU; known: {', '.join(keys)}{did_you_mean(key, keys)}")


def resolve_device(name: str | None, rank: int | None = None) -> torch.device:
    """`--device`: cpu, cuda or cuda:N (None: cuda where torch sees one, else cpu). `rank`, given only to a process
    of a distributed run, puts it on its own GPU: cuda:LOCAL_RANK (torchrun's), else the rank modulo the GPUs here.
    The one mapping of ranks to GPUs (distill's `join` binds each rank to it); refused in one line: a LOCAL_RANK past
    the GPUs this node shows, and a cuda:N that is not the rank's. Asks torch only for the GPUs' count, which does not
    initialise CUDA."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise RecycleError(f"--device {name!r}: choose cpu or cuda")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RecycleError(f"--device {name}: no CUDA device is available to torch here")
    asked = _index(name[len("cuda:"):], f"--device {name}") if name.startswith("cuda:") else None
    count = torch.cuda.device_count()
    if rank is None:
        if asked is not None and asked >= count:
            raise RecycleError(f"--device {name}: this machine shows {_gpus(count)}")
        return torch.device(name)
    local = os.environ.get("LOCAL_RANK")
    index = _index(local, f"LOCAL_RANK {local!r}") if local is not None else rank % count
    if index >= count:
        raise RecycleError(f"LOCAL_RANK {index}: this node shows {_gpus(count)}; start at most {count} ranks per "
                           "node (torchrun --nproc_per_node), or check CUDA_VISIBLE_DEVICES")
    if asked is not None and asked != index:
        raise RecycleError(f"--device {name}: under torchrun each rank runs on cuda:LOCAL_RANK (this rank's is "
                           f"cuda:{index}); pass --device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def _index(n: str, what: str) -> int:
    """A GPU's index (N of cuda:N, or LOCAL_RANK)."""
    if not n.isdigit():
        raise RecycleError(f"{what}: expected a GPU index (cuda:0, cuda:1 ...)")
    return int(n)


def _gpus(count: int) -> str:
    return f"{count} CUDA device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})" if count else "no CUDA device"


# The variables CUDA's caching allocator reads its settings from, in the order torch 2.13 reads them: the first one
# set is parsed whole and the other ignored (c10/cuda/CUDAAllocatorConfig.h:136-146 in torch 2.13's include/; measured
# on torch 2.13 here: with both set, torch._C._accelerator_getAllocatorSettings() returns PYTORCH_CUDA_ALLOC_CONF's).
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(environ=os.environ) -> str | None:
    """`expandable_segments:True` for CUDA's caching allocator (segments grow in place instead of new blocks being cut:
    less fragmentation at the same peak), put in the environment while CUDA is uninitialised: the allocator parses its
    variable once, at its first use, and never again (c10/cuda/CUDAAllocatorConfig.h:132-153, a static instance;
    measured here: a value set after that first read is not seen). Appended to the variable torch reads, so the user's
    other settings stay; a user's own expandable_segments (true or false) is left as it is. Returns the variable it
    set (None: nothing set)."""
    if torch.cuda.is_initialized() or any("expandable_segments" in environ.get(v, "") for v in ALLOC_CONF):
        return None
    var = next((v for v in ALLOC_CONF if v in environ), ALLOC_CONF[0])
    have = environ.get(var, "").strip().rstrip(",")
    environ[var] = f"{have},expandable_segments:True" if have else "expandable_segments:True"
    return var


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timing's edge); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def detect(device: torch.device) -> GPU | None:
    """The table entry for a CUDA device, by the name torch reports (None on CPU or an unlisted card)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((g for g in GPUS if any(n in name for n in g.names)), None)


__all__ = ["ALLOC_CONF", "GPU", "GPUS", "gpu", "detect", "expandable_segments", "resolve_device", "sync"]


def cpu_capabilities() -> dict:
    """The CPU's instruction-set flags as torch reports them (torch ≥ 2.7: torch.cpu.get_capabilities), else read
    from /proc/cpuinfo, so a torch as old as 2.6 answers the same question."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return dict(caps())
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {f: True for f in flags}


def cpu_has_bf16() -> bool:
    """Native bf16 (AVX512-BF16 or AMX): where bf16 autocast is fast; elsewhere it is emulated, 12× slower."""
    caps = cpu_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def default_precision(device: torch.device) -> str:
    """bf16 autocast where the hardware has it (CUDA, AVX512-BF16, AMX); fp32 where bf16 is emulated: the compute
    dtype of every process that runs the target or trains (distill, harvest's transformers engine)."""
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_has_bf16() else "fp32"


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
