#!/usr/bin/env bash
# Issue 49, for a lent GPU (the `device` tool, one GPU): the 1-rank NCCL path with set_device. Sized to stay under
# 3 minutes of GPU time (not yet run on a GPU; the CPU dry run below passed here over gloo in 348 s on 2 busy cores).
#
#   bash benchmarks/nccl_one_rank.sh              # on the GPU machine: NCCL, every check expects cuda:0
#   DEVICE=cpu TOKENS=512 SEQ_LEN=64 BATCH=2 DISTILL_TIMEOUT=600 bash benchmarks/nccl_one_rank.sh  # gloo, a CPU
#
# Needs a python (PYTHON, default python3) with torch (CUDA build) and transformers, as benchmarks/distill_gpu.py
# does; recycle is installed from this checkout (pip --no-deps -e .) when that python cannot import it.
# 1. converts the trained fixture to EAGLE (CPU, seconds);
# 2. a probe under `torchrun --nproc_per_node 1`: distill's own `join` (recycle.distill.sharding), then prints what
#    the rank got: its device, torch.cuda.current_device(), the backend, the group's bound device (device_id), the
#    allocator settings (expandable_segments), and runs a tensor all-reduce and an object all-gather (NCCL stages
#    objects on the current device) - CUDA must be uninitialised before join and the current device cuda:0 after;
# 3. `torchrun --nproc_per_node 1 -m recycle.cli distill ... --nccl-timeout 300 --json` on the fixture (FSDP2 over a
#    mesh of one): the record must say device cuda:0, world size 1, FSDP2, a CUDA peak above zero.
# What a second GPU would have to show (not possible on one): under --nproc_per_node 2, rank 1's probe prints
# current_device 1 and bound device cuda:1, and each rank's record/peak is on its own GPU (nvidia-smi shows two
# processes on two GPUs, not two on GPU 0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-$(mktemp -d /tmp/nccl-one-rank.XXXXXX)}
TOKENS=${TOKENS:-24k}; SEQ_LEN=${SEQ_LEN:-256}; BATCH=${BATCH:-8}  # the GPU run's; a CPU dry run passes smaller
DISTILL_TIMEOUT=${DISTILL_TIMEOUT:-150}
if [ "$DEVICE" = cpu ]; then WANT=cpu; BACKEND=gloo; else WANT=cuda:0; BACKEND=nccl; fi
echo "work: $WORK; device $DEVICE, expecting $WANT over $BACKEND"

"$PY" -c "import recycle.distill.sharding" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"

t0=$(date +%s)
"$PY" -m recycle.cli convert fixtures/deepseek_v3_mtp --to eagle -o "$WORK/eagle" > /dev/null
echo "converted: $(( $(date +%s) - t0 )) s"

cat > "$WORK/probe.py" <<'EOF'
import json, os, sys

import torch
import torch.distributed as dist

from recycle.distill.sharding import join

device, want, backend = sys.argv[1], sys.argv[2], sys.argv[3]
before = torch.cuda.is_initialized()
ranks = join(None if device == "cuda" else device, 300.0)
group = dist.distributed_c10d._get_default_group()
x = torch.full((4,), float(ranks.rank + 1), device=ranks.device)
dist.all_reduce(x)
gathered = [None] * ranks.world
dist.all_gather_object(gathered, {"rank": ranks.rank, "local_rank": os.environ.get("LOCAL_RANK")})
seen = {"local_rank": os.environ.get("LOCAL_RANK"), "rank": ranks.rank, "world": ranks.world,
        "device": str(ranks.device), "cuda_initialised_before_join": before, "backend": dist.get_backend(),
        "bound_device_id": str(getattr(group, "bound_device_id", None)), "all_reduce": x.tolist(),
        "all_gather_object": gathered,
        "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        "allocator_settings": getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: None)()}
if torch.cuda.is_available() and ranks.device.type == "cuda":
    seen["current_device"] = torch.cuda.current_device()
    seen["x_device"] = str(x.device)
print("probe:", json.dumps(seen), flush=True)
assert not before, "CUDA was initialised before join"
assert seen["device"] == want and seen["backend"] == backend, seen
if want.startswith("cuda"):
    assert seen["current_device"] == int(want.split(":")[1]) and seen["x_device"] == want, seen
    assert seen["bound_device_id"] == want, seen
    assert "expandable_segments:True" in (seen["allocator_settings"] or seen["alloc_conf"]["PYTORCH_CUDA_ALLOC_CONF"]
                                          or seen["alloc_conf"]["PYTORCH_ALLOC_CONF"] or ""), seen
dist.destroy_process_group()
EOF
t0=$(date +%s)
timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port 29541 "$WORK/probe.py" \
  "$DEVICE" "$WANT" "$BACKEND"
echo "probe: $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
timeout "$DISTILL_TIMEOUT" "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port 29542 -m recycle.cli distill \
  "$WORK/eagle" --target fixtures/deepseek_v3_mtp_posttrained --tokens "$TOKENS" --seq-len "$SEQ_LEN" --batch "$BATCH" \
  --eval-every 4 --nccl-timeout 300 --device "$DEVICE" -o "$WORK/distilled" --json > "$WORK/record.json"
echo "distill: $(( $(date +%s) - t0 )) s"
"$PY" - "$WORK/record.json" "$WANT" <<'EOF'
import json, sys

text = open(sys.argv[1]).read()
rec = json.loads(text[text.index("{"):])
seen = {"device": rec.get("device"), "world_size": rec["data"]["world_size"], "sharding": rec["data"]["sharding"],
        "peak_memory_bytes": rec.get("peak_memory_bytes"), "tokens": rec["tokens"],
        "tokens_per_s": rec.get("tokens_per_s")}
print("record:", json.dumps(seen))
assert seen["device"] == sys.argv[2] and seen["world_size"] == 1 and (seen["sharding"] or "").startswith("FSDP2"), seen
if sys.argv[2].startswith("cuda"):
    assert (seen["peak_memory_bytes"] or 0) > 0, seen
print("ok: one rank on", sys.argv[2])
EOF
