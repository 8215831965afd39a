"""The frozen target as an online teacher: hidden features and logits for a batch, no gradient.

The target runs in the training process (EAGLE-3's "target in-process" mode, anchors §2 table): no
feature dump is needed, because a short distillation reads each token once or a few times, and an
offline cache of every layer's features costs more disk than it saves compute (anchors §3.5).
`--cache-hidden DIR` still stores the features per batch (safetensors, bf16) for repeated runs
over the same data (e.g. recycled vs scratch in the experiment); logits are never stored: they are
one matmul away from the final-normed state (the target's own head), and at real vocabularies
they would be most of the cache.

Features: "last" = the decoder's output after its final norm (what MTP modules, the EAGLE drafter
and Medusa heads read); aux layer i = transformers' `hidden_states[i]`, the input of decoder layer i
(EAGLE-3's `eagle_aux_hidden_state_layer_ids`), the same taps the decoder uses
(`recycle.decoding.target`); for a drafter of DeepSeek-V4's modules, in place of aux layers, the last decoder
layer's output: the trunk's hyper-connection streams (the decoder's "streams" tap), [B, L, C, H], cached under
"streams" in place of the last state (C × H × 2 bytes a token: 32 KiB at V4-Flash's 4 × 4096, 56 KiB at V4-Pro's
4 × 7168; the last state, H × 2 more, is mixed back from them on reading by the trunk's own hc_head and norm,
`recycle.mtp.deepseek_v4.TrunkTail`). vLLM captures no streams (0.32 hands over their mean, on every platform:
`models/deepseek_v4/*/model.py`, `aux_recon.mean(dim=1)`), so a stream cache comes from `recycle harvest --engine
transformers` or from this process's own `--cache-hidden`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from recycle.decoding.target import load_target, softcap
from recycle.distill.schedule import EVAL_KEY, split_key
from recycle.errors import RecycleError
from recycle.mtp.deepseek_v4 import TrunkTail


@dataclass
class TeacherOut:
    last: torch.Tensor  # [B, L, H] final-normed hidden states
    aux: torch.Tensor | None  # [B, L, A·H] concatenated aux layers (EAGLE-3); a drafter of DeepSeek-V4's modules:
    # the last layer's hyper-connection streams [B, L, C, H] (what they chain: `Teacher(streams=True)`); else None
    logits: Callable[..., torch.Tensor]  # (rows [N, H], vocab ids or None) -> the target's logits [N, V] float32:
    # computed a chunk of rows at a time by the loss, never for a whole batch (8.5 GB at 129k words × 16k rows)
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # Gemma 4 assistants: {attention type: (K, V)}


def autocast(device: torch.device, precision: str):
    """bf16 autocast where the device supports it; a no-op context for fp32."""
    if precision == "bf16" and (device.type == "cpu" or torch.cuda.is_bf16_supported()):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_io(target_dir: str | os.PathLike, device: torch.device, dtype: torch.dtype = torch.float32
              ) -> tuple[nn.Embedding, nn.Linear]:
    """The target's input embedding and LM head alone, through the lazy reader (names from the family
    table's trunk roles; a tied head is the embedding): what a drafter needs of a target it never runs."""
    from recycle.checkpoint import Checkpoint
    from recycle.families import LLAMA_TRUNK, match

    ck = Checkpoint(target_dir)
    try:
        trunk = match(ck, strict=False).family.layout.trunk  # trunk names only
    except RecycleError:  # a target without MTP modules (a drafter's target need not carry any)
        trunk = LLAMA_TRUNK
    found = {}
    for role in ("embed", "head"):
        names = trunk.get(role) or LLAMA_TRUNK[role]
        name = next((n for n in names if n in ck.tensors), None)
        if name is None:
            raise RecycleError(f"{target_dir}: no {role} tensor ({', '.join(names)})")
        found[role] = ck.get(name).to(device=device, dtype=dtype)
    embed = nn.Embedding.from_pretrained(found["embed"], freeze=True)
    head = nn.Linear(found["head"].shape[1], found["head"].shape[0], bias=False, device=device)
    head.weight = nn.Parameter(found["head"], requires_grad=False)
    return embed, head


class Teacher:
    """Wraps the frozen target; `teacher(ids, key)` → TeacherOut (from the cache when `key` is stored).

    `trunk=False` (a cache `recycle harvest` filled): the target's layers are never loaded, only its
    config, embedding and LM head (`target_io`); every key must be in the cache. A drafter for a target
    no process holds then trains on one device."""

    def __init__(self, target_dir: str | os.PathLike, device: torch.device, aux_layers: list[int] | None = None,
                 precision: str = "bf16", cache_dir: str | os.PathLike | None = None, trunk: bool = True,
                 producer=None, kv: bool = False, remote=None, streams: bool = False, gpus: int = 1,
                 keep_quantized: bool = False) -> None:
        """`kv`: also return the K/V a Gemma 4 assistant attends (`recycle.formats.gemma4_assistant.kv_source_layers`);
        they are never cached, so it needs the trunk. `remote` (`distill --teacher URL`): a `distill.remote.Remote`
        gives every key's features (it deletes their files once read). `gpus` > 1: the target over that many GPUs
        of this node, whole decoder layers each (`recycle harvest --engine transformers --gpus N`); `device` is then
        where its embedding is. `keep_quantized`: a block-FP8 release kept as stored there (`--keep-quantized`)."""
        self.device, self.precision = device, precision
        self.producer = producer  # distill.harvest.OnlineHarvest/OnlineFollower/Follower: wait for each key (`release`
        # deletes it once read)
        self.remote = remote
        self._vocab_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (draft vocabulary, the head's rows)
        # bf16 weights on a GPU when the run computes in bf16 (autocast ran the matmuls in bf16 already): half the
        # teacher's memory; fp32 on a CPU, where bf16 kernels are emulated on most machines
        dtype = torch.bfloat16 if device.type == "cuda" and precision == "bf16" else torch.float32
        if trunk:
            self.model = load_target(target_dir, device=device, dtype=dtype, gpus=gpus, keep_quantized=keep_quantized)
            if gpus > 1 or keep_quantized:  # the ids go where the embedding is; accelerate's hooks carry them on
                self.device = self.model.get_input_embeddings().weight.device
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.decoder = self.model.get_decoder()
            self.head = self.model.get_output_embeddings()
            self.embed = self.model.get_input_embeddings()
            self.config = self.model.config
            self.num_layers = len(self.decoder.layers)
        else:
            from recycle.decoding.placed import config_of

            self.model = self.decoder = None
            self.config = config_of(target_dir)
            self.embed, self.head = target_io(target_dir, device, dtype)  # the drafter shares them: adopt_target_io
            self.num_layers = int(self.config.num_hidden_layers)
        self.kv_layers: dict[str, int] = {}
        if kv:
            from recycle.formats.gemma4_assistant import kv_source_layers

            if self.decoder is None or cache_dir is not None:
                raise RecycleError("a Gemma 4 assistant trains on the target's own K/V cache, which is not harvested "
                                   "or cached: run it with the target loaded and without --cache-hidden")
            self.kv_layers = kv_source_layers(self.config)
        self.streams = streams  # DeepSeek-V4's modules chain the last layer's output, its hyper-connection streams
        self._tapped: dict[str, torch.Tensor] = {}
        self.tail = None  # DeepSeek-V4: the trunk's hc_head and norm, which mix the last state from cached streams
        if streams:
            if remote is not None or getattr(producer, "engine", None) == "vllm":
                raise RecycleError(STREAMS_FROM_VLLM.format(what="--teacher and --online (a vLLM teacher)",
                                                            instead=HARVEST_STREAMS))
            self.tail = TrunkTail.of(self.decoder) if self.decoder is not None else \
                TrunkTail.from_checkpoint(target_dir, self.config, device, dtype)
            if self.decoder is not None:  # kept by a hook as the last layer leaves them (a cache's file: "streams")
                self.decoder.layers[-1].register_forward_hook(
                    lambda module, args, out: self._tapped.__setitem__("last", out[0] if isinstance(out, tuple) else out))
        self.aux_layers = list(aux_layers or [])
        for i in self.aux_layers:
            if not 0 <= i <= self.num_layers:
                raise RecycleError(f"aux layer {i}: the target has {self.num_layers} layers")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RecycleError(f"--cache-hidden {self.cache_dir}: cannot create it ({e.strerror or e})") from None
        self.cache_hits = 0

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.decoder is None:
            raise RecycleError(f"--cache-hidden {self.cache_dir}: a window is missing from the harvested cache and "
                               "the target is not loaded here; harvest again with distill's options")
        with autocast(self.device, self.precision):
            out = self.decoder(input_ids=ids, use_cache=False, output_hidden_states=bool(self.aux_layers))
        last = out.last_hidden_state
        if self.streams:
            return last, self._tapped.pop("last")
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        return last, aux

    @torch.no_grad()
    def features_and_kv(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The final-normed states and the K/V the target cached in its `kv_layers`, every key of a window (the
        assistant's sliding layers read the ones within their window: `recycle.drafters.gemma4.teacher_forced`)."""
        from recycle.drafters.gemma4 import target_states_and_kv

        with autocast(self.device, self.precision):
            return target_states_and_kv(self.decoder, self.config, ids, self.kv_layers)

    def _head_over(self, vocab: torch.Tensor) -> torch.Tensor:
        """The head's rows for a draft vocabulary, selected once and kept (the loss asks for every chunk of every
        step: at DeepSeek-V3's width a 32k-word selection is a 0.9 GB copy)."""
        kept = self._vocab_head
        if kept is None or kept[0].shape != vocab.shape or not torch.equal(kept[0], vocab):
            self._vocab_head = (vocab, self.head.weight.index_select(0, vocab))
        return self._vocab_head[1]

    @torch.no_grad()
    def logits(self, rows: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits of final-normed `rows`, over `vocab` (a draft vocabulary's target ids) or all."""
        weight = self.head.weight if vocab is None else self._head_over(vocab)
        with autocast(self.device, self.precision):
            return softcap(torch.nn.functional.linear(rows.to(weight.dtype), weight).float(), self.config)

    def _path(self, key: str) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir / f"{split_key(key)[0]}.safetensors"

    def _read(self, key: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The tensors `names` (those present) of `key`'s file, only the rows its span names (each rank of a
        sharded run reads its own rows of a one-process cache, not the whole file)."""
        rows = split_key(key)[1]
        with safe_open(str(self._path(key)), "pt") as f:
            return {n: (f.get_slice(n)[rows] if rows is not None else f.get_tensor(n)) for n in names if n in f.keys()}

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, key: str | None = None) -> TeacherOut:
        ids = ids.to(self.device)
        if self.kv_layers:
            last, kv = self.features_and_kv(ids)
            return TeacherOut(last, None, self.logits, kv)
        if self.remote is not None and key is not None:
            last, aux = self.remote.features(key, ids)
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
            return TeacherOut(last.to(self.device, dtype), aux.to(self.device, dtype) if aux is not None else None,
                              self.logits)
        if self.producer is not None and key is not None:
            self.producer.wait(split_key(key)[0])
        cached = self._load(key, ids) if key is not None and self.cache_dir is not None else None
        if cached is not None:
            last, aux = cached
            self.cache_hits += 1
        else:
            last, aux = self.features(ids)
            if key is not None and self.cache_dir is not None and split_key(key)[1] is None:  # never part of a file
                self._store(key, ids, last, aux)
        return TeacherOut(last, aux, self.logits)

    def release(self, keys: list[str]) -> None:
        """Online mode: delete the step's key files once read (by every rank: the caller's to know), so disk stays
        at the producer's `ahead` keys; a remote teacher deleted its files as it read them)."""
        if self.remote is not None:
            return
        for key in keys:
            if split_key(key)[0] != EVAL_KEY:
                self._path(key).unlink(missing_ok=True)

    def cached_rows(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The token ids stored under `key` (a harvested cache's evaluation rows, or the rows vLLM regenerated),
        and their assistant mask where the rows are conversations (None otherwise)."""
        if self.producer is not None:
            self.producer.wait(split_key(key)[0])
        path = self._path(key)
        try:
            t = self._read(key, ("input_ids", MASK_KEY))
            return t["input_ids"], t.get(MASK_KEY)
        except Exception as e:  # missing or torn: the cache is unusable for this
            raise RecycleError(f"--cache-hidden {self.cache_dir}: no readable {path.name} ({type(e).__name__})") from None

    def _load(self, key: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            t = self._read(key, ("input_ids", "last", STREAMS_KEY if self.streams else "aux"))
        except Exception:  # a torn or foreign file: recompute and overwrite it
            return None
        if not torch.equal(t.get("input_ids", torch.empty(0)), ids.cpu()):
            return None  # other data at this key: the cache belongs to another run's stream
        if (STREAMS_KEY in t) != self.streams or (not self.streams and bool(self.aux_layers) != ("aux" in t)):
            return None
        if "last" not in t and not self.streams:
            return None
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        aux = t.get(STREAMS_KEY if self.streams else "aux")
        aux = aux.to(self.device, dtype) if aux is not None else None
        if "last" in t:  # as stored (a stream cache written before the streams were stored alone holds it too)
            return t["last"].to(self.device, dtype), aux
        with autocast(self.device, self.precision):  # the trunk's own last step, from the streams as stored
            return self.tail(aux).to(dtype), aux

    def _store(self, key: str, ids: torch.Tensor, last: torch.Tensor, aux: torch.Tensor | None) -> None:
        if self.streams:  # the streams alone, under their own name: the reader mixes the last state from them
            store_features(self._path(key), ids, None, None, streams=aux)
        else:
            store_features(self._path(key), ids, last, aux)


MASK_KEY = "assistant_mask"  # conversations: which positions are assistant tokens (bool, as the ids)
STREAMS_KEY = "streams"  # DeepSeek-V4 targets: the last decoder layer's hyper-connection streams [n, T, C, H]
STREAMS_FROM_VLLM = ("a DeepSeek-V4 target's features are its hyper-connection streams (its drafters chain them) and "
                     "their hc_head mix (its last state), and vLLM 0.32 captures neither: its V4 model hands over the "
                     "streams' mean (models/deepseek_v4/*/model.py, aux_recon.mean(dim=1)), so {what} cannot feed "
                     "it: {instead}")
HARVEST_STREAMS = "harvest them with `recycle harvest --engine transformers` and pass --cache-hidden, or run the " \
                  "target in this process"


def store_features(path: Path, ids: torch.Tensor, last: torch.Tensor | None, aux: torch.Tensor | None,
                   mask: torch.Tensor | None = None, streams: torch.Tensor | None = None) -> None:
    """One `--cache-hidden` file (the one format the distiller and `recycle harvest` write): input ids,
    the final-normed last state and the concatenated aux layers, bf16; a DeepSeek-V4 target's streams in their place
    and alone (`last` None: its reader mixes the last state from them, `TrunkTail`); and for conversations the
    assistant mask; written atomically."""
    tensors = {"input_ids": ids.cpu().contiguous()}
    if last is not None:
        tensors["last"] = last.to(torch.bfloat16).cpu().contiguous()
    if aux is not None:
        tensors["aux"] = aux.to(torch.bfloat16).cpu().contiguous()
    if streams is not None:
        tensors[STREAMS_KEY] = streams.to(torch.bfloat16).cpu().contiguous()
    if mask is not None:
        tensors[MASK_KEY] = mask.to(torch.bool).cpu().contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
