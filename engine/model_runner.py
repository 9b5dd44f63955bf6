"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, samples.

One forward handles any mix of prefill chunks and decodes: the new tokens of all sequences are concatenated
(`cu_seqlens_q` says which rows are whose) and attention finds each sequence's context via its block table."""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.cuda_graphs import DecodeGraphs
from kvgate.engine.decode_inputs import DecodeBatch, DecodeInputs
from kvgate.engine.host_memory import keep_freed_memory
from kvgate.engine.models import AttentionMetadata, LlamaForCausalLM, build_model
from kvgate.engine.pooler import accumulate
from kvgate.engine.sampler import Sampler
from kvgate.engine.sampling_rows import SamplingBatch
from kvgate.engine.scheduler import AllDecode, ScheduledBatch
from kvgate.engine.sequence import Sequence

logger = logging.getLogger(__name__)
GiB = 1 << 30
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are computed at once ([256, vocab] float32)


def kv_budget(total: int, free: int, activation_peak: int, utilization: float) -> int:
    """Bytes left for the KV cache: our share of the device, less what is in use now (our weights and other
    processes alike) and the activation peak a forward needs on top; never negative."""
    return max(int(total * utilization) - (total - free) - activation_peak, 0)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type != "cuda":
        return torch.float32
    wanted = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return torch.float16 if wanted in (torch.float16, "float16") else torch.bfloat16


def eos_ids(hf_config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def decode_only(batch: ScheduledBatch) -> list[Sequence] | None:
    """The batch's sequences when each computes exactly its last token (a pure decode step), else None. An embedding
    request's last prompt token is pooled, not sampled: a batch with one is never a decode step."""
    seqs = []
    for seq, n in batch:
        if n != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids) or seq.pooling is not None:
            return None
        seqs.append(seq)
    return seqs


def prompt_logprob_rows(batch: ScheduledBatch) -> list[tuple[Sequence, int, int]]:
    """(sequence, row of the flat inputs, prompt position it predicts) for each computed position whose next token
    is a prompt token, of the sequences that ask for prompt logprobs; in _prepare_mixed's row order."""
    out, row = [], 0
    for seq, n in batch:
        if seq.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            out += [(seq, row + p - start, p + 1) for p in range(start, min(start + n, seq.num_prompt_tokens - 1))]
        row += n
    return out


class LaunchedStep:
    """A launched decode step's sequences and sampled tokens, copied to the host without blocking (on CUDA into
    pinned memory, an event marking the copy's end); `tokens` waits for them. The copy is queued before the next
    step, which overwrites the device's token buffer (DecodeInputs.tokens); on a CPU it is made at once."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        self.seqs, self.ready = seqs, None
        self.host = tokens.to("cpu", non_blocking=True, copy=True)  # torch pins a non-blocking copy off the GPU
        if tokens.device.type == "cuda":
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    """The engine's runner for a real model; the facts the engine needs about the model (name, tokenizer,
    vocabulary, context limit, EOS ids, KV blocks) are set by `load`."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device, seed: int = 0,
                 max_num_seqs: int = 32) -> None:
        self.model = model
        self.model_name, self.tokenizer, self.vocab_size, self.max_model_len = "unknown", None, 0, 0
        self.eos_token_ids: set[int] = set()
        self.num_blocks = 0
        self.embedding_size, self.pooling = model.config.hidden_size, "last"
        if device.type == "cpu":  # a decode step has a row per running sequence
            logger.info("%d CPU GEMMs prepacked for oneDNN", model.pack_linears(rows_hint=max_num_seqs))
            keep_freed_memory()  # a step's temporaries reuse the last step's pages (engine/host_memory.py)
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed, device)
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.kv_shape = (attn.num_kv_heads, attn.head_dim)
        self.kv_cache = torch.empty(0)
        self.home_thread: int | None = threading.get_ident() if device.type == "cpu" else None
        self.max_num_seqs = max_num_seqs
        self.decode_inputs: DecodeInputs | None = None  # built at the first decode-only step
        self.graphs: DecodeGraphs | None = None  # set by load on CUDA unless enforce_eager
        self.lora = None  # engine/lora_layers.LoraModel when load gives the model adapter slots

    @classmethod
    def load(cls, model: Any, config: EngineConfig) -> ModelRunner:
        """Resolve `model` (a name, path or ModelSource), build it on the configured device and dtype, and size
        and allocate its KV cache."""
        from kvgate.engine.loader import model_pooling, resolve_model  # heavy: transformers, gguf

        source = resolve_model(model, seed=config.seed) if isinstance(model, str) else model
        hf_config = source.config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, hf_config)
        max_positions = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = min(config.max_model_len or max_positions, max_positions)
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True) and window < max_model_len:
            # attention here is always full; inside the window that is exactly sliding-window attention
            logger.warning("%s uses a %d-token sliding window: max_model_len capped from %d to %d",
                           source.name, window, max_model_len, window)
            max_model_len = window
        torch.manual_seed(config.seed)
        built = build_model(hf_config, dtype, device, source.weights(dtype), max_model_len)
        runner = cls(built, config.block_size, device, config.seed, config.max_num_seqs)
        if config.max_loras:  # before sizing the KV cache: the slots take device memory too
            from kvgate.engine.lora_layers import LoraModel
            runner.lora = LoraModel(built, config.max_loras, config.max_lora_rank, (source.name, str(source.path or "")))
        num_blocks = runner.size_kv_cache(config.kv_cache_memory, config.gpu_memory_utilization,
                                          config.max_num_seqs, max_model_len, config.max_num_batched_tokens)
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for 0 blocks of {runner.bytes_per_block} bytes: "
                             "raise kv_cache_memory or gpu_memory_utilization")
        runner.allocate_kv_cache(num_blocks)
        logger.info("%s on %s/%s: KV cache of %d blocks x %d = %d tokens (%.1f MiB)", source.name, device, dtype,
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    num_blocks * runner.bytes_per_block / 2**20)
        runner.model_name, runner.tokenizer, runner.vocab_size = source.name, source.tokenizer, hf_config.vocab_size
        runner.max_model_len, runner.eos_token_ids = max_model_len, eos_ids(hf_config, source.tokenizer)
        runner.num_blocks = num_blocks
        runner.pooling = model_pooling(source.path) if source.path is not None else "last"
        runner.sampler.vocab_size = hf_config.vocab_size
        if device.type == "cuda" and not config.enforce_eager:
            runner.capture_graphs()
        return runner

    def capture_graphs(self) -> None:
        """Decode graphs for every batch-size bucket (on a CPU: the eager twin of the same plan)."""
        inputs = self._decode_inputs()
        self.graphs = DecodeGraphs(self.model, self.max_num_seqs, inputs.max_blocks, inputs.tokens, self.device)
        self.graphs.capture()
        logger.info("decode graphs captured for batch sizes %s", self.graphs.sizes)

    @property
    def bytes_per_block(self) -> int:
        itemsize = self.model.model.embed_tokens.weight.element_size()
        return 2 * self.num_layers * self.block_size * self.kv_shape[0] * self.kv_shape[1] * itemsize

    def size_kv_cache(self, kv_cache_memory: int | None, gpu_memory_utilization: float, max_num_seqs: int,
                      max_model_len: int, max_num_batched_tokens: int) -> int:
        """Number of KV blocks: from `kv_cache_memory` bytes when given; on CUDA from what a profiling
        forward leaves of `gpu_memory_utilization`; on CPU 1 GiB or what the longest batch needs, if less."""
        if kv_cache_memory is None and self.device.type == "cuda":
            kv_cache_memory = self._profile_free_cuda_memory(gpu_memory_utilization, max_num_batched_tokens,
                                                             max_model_len)
        elif kv_cache_memory is None:
            wanted = max_num_seqs * -(-max_model_len // self.block_size) * self.bytes_per_block
            kv_cache_memory = min(GiB, wanted)
        return int(kv_cache_memory // self.bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        dtype = self.model.model.embed_tokens.weight.dtype
        # zeros, not empty: slots past a sequence's length are read and weighted by zero, and 0 * NaN is NaN
        self.kv_cache = torch.zeros(2, self.num_layers, num_blocks, self.block_size, *self.kv_shape, dtype=dtype,
                                    device=self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _profile_free_cuda_memory(self, utilization: float, max_tokens: int, max_model_len: int) -> int:
        num_tokens = min(max_tokens, max_model_len)
        self.allocate_kv_cache(-(-num_tokens // self.block_size))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        seq_len = num_tokens
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(-(-num_tokens // self.block_size), dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=torch.tensor([0, seq_len], dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([seq_len], dtype=torch.int32, device=self.device))
        with torch.inference_mode():
            self.model.compute_logits(self.model(ids, torch.arange(num_tokens, device=self.device), meta)[-1:])
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget(total, free, activations, utilization)
        logger.info("profiling forward of %d tokens: activations peak %.2f GiB, %.2f GiB in use; %.2f GiB for the "
                    "KV cache", num_tokens, activations / GiB, (total - free) / GiB, budget / GiB)
        return budget

    def prepare(self, batch: ScheduledBatch, graphed: bool = False) -> DecodeBatch | tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """A decode-only batch's inputs (`graphed`: in a decode graph's static inputs where a bucket fits), else
        the flat inputs of the batch and the rows to sample."""
        seqs = batch.seqs if isinstance(batch, AllDecode) else decode_only(batch)
        if seqs is not None:
            return self._prepare_decode(seqs, graphed)
        return self._prepare_mixed(batch)

    def _prepare_mixed(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat inputs of a prefill or mixed step, from a few numbers and one id slice per sequence: positions and
        KV slots are computed as tensors, never token by token in Python (a 16k-token step built that way spent
        milliseconds of host time per step, issue 41)."""
        starts, counts, ids, tables, sample_rows = [], [], [], [], []
        rows = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            starts.append(start)
            counts.append(n)
            ids += seq.token_ids[start:start + n]
            tables.append(seq.block_table)
            rows += n
            if start + n == seq.num_tokens and seq.pooling is None:
                sample_rows.append(rows - 1)
        width = max(len(table) for table in tables)
        block_tables = torch.tensor([table + [-1] * (width - len(table)) for table in tables], dtype=torch.int32)
        starts_t, counts_t = torch.tensor(starts, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
        cu = torch.zeros(len(counts) + 1, dtype=torch.long)
        torch.cumsum(counts_t, 0, out=cu[1:])
        seq_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
        positions = torch.arange(rows) + (starts_t - cu[:-1])[seq_of_row]  # each row: its sequence's start + offset
        slots = block_tables[seq_of_row, positions // self.block_size].long() * self.block_size \
            + positions % self.block_size
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), block_tables=block_tables.to(dev), cu_seqlens_q=cu.to(torch.int32).to(dev),
            context_lens=(starts_t + counts_t).to(torch.int32).to(dev))
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta, sample_rows

    def _decode_inputs(self) -> DecodeInputs:
        if self.decode_inputs is None:
            self.decode_inputs = DecodeInputs(self.max_num_seqs, -(-self.max_model_len // self.block_size),
                                              self.block_size, self.device)
        return self.decode_inputs

    def _prepare_decode(self, seqs: list[Sequence], graphed: bool = False) -> DecodeBatch:
        bucket = self.graphs.bucket(len(seqs)) if graphed and self.graphs is not None else None
        return self._decode_inputs().build(seqs, None if bucket is None else self.graphs.inputs, bucket)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict[int, float] | None]]:
        """Compute the batch's new tokens; sample for the sequences whose whole context is now computed."""
        if self.home_thread not in (None, threading.get_ident()):
            self._warn_foreign_thread()
        # an embedding request's chunk is never part of a decode step: its hidden states are pooled, not sampled
        pooling = not isinstance(batch, AllDecode) and any(seq.pooling is not None for seq, _ in batch)
        lora = self.lora is not None and self.lora.set_rows(batch)  # a step with adapter rows runs eagerly
        prepared = self.prepare(batch, graphed=not lora)
        decoding = isinstance(prepared, DecodeBatch)
        if decoding:  # a decode step: its sampling parameters are kept per row with its inputs
            seqs = batch.seqs if isinstance(batch, AllDecode) else [seq for seq, _ in batch]
            sampling = self.decode_inputs.sampling_batch(seqs)
        else:
            seqs = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens and seq.pooling is None]
            sampling = SamplingBatch.of(seqs) if seqs else None
        if sampling is not None and sampling.constrained:  # structured output: its mask fills during the forward
            self.sampler.start_mask(seqs, sampling.constrained)
        argmax = None
        if decoding:
            logits, argmax = self.decode(prepared, sampling)
            if logits is None:  # plain greedy: the graph's tokens
                return seqs, argmax.tolist(), [None] * len(seqs)
        else:
            input_ids, positions, meta, sample_rows = prepared
            hidden = self.forward(input_ids, positions, meta)
            if pooling:
                self._pool(batch, hidden)
            if rows := prompt_logprob_rows(batch):  # a prefill step: one pass over its sequences
                self._prompt_logprobs(hidden, rows)
            if not seqs:
                return [], [], []
            logits = self.model.logits(hidden[sample_rows])  # the sampler widens the rows that need float32
        tokens, logprobs = self.sampler(logits, seqs, sampling, consume=True, argmax=argmax)
        return seqs, tokens, logprobs

    @property
    def launch_device(self) -> str:
        """Where `launch` computes (the Runner protocol's: this runner launches ahead on any device)."""
        return self.device.type

    @torch.inference_mode()
    def launch(self, batch: AllDecode) -> LaunchedStep:
        """A decode-only step (every sequence computes its last token) launched without waiting for its tokens
        (engine/overlap.py): a last token the previous launch sampled is still on the device (negative on the host)
        and is fed from there; this step's tokens are written into DecodeInputs.tokens (the graph's argmax, or
        the sampler's output) for the next launch, and reach the host through the returned step. No logprobs, no
        structured rows: Overlap's rule keeps those to the plain step."""
        if self.home_thread not in (None, threading.get_ident()):
            self._warn_foreign_thread()
        seqs = batch.seqs
        lora = self.lora is not None and self.lora.set_rows(batch)  # this step's rows, not the last step's
        prepared = self.prepare(batch, graphed=not lora)
        d = self.decode_inputs
        sampling = d.sampling_batch(seqs)
        logits, tokens = self.decode(prepared, sampling, fed=True)
        if logits is not None:
            tokens = self.sampler.sample(logits, seqs, sampling, consume=True, out=d.tokens[:len(seqs)], argmax=tokens)
        return LaunchedStep(seqs, tokens)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[Sequence, int, int]]) -> None:
        """Each row's log-softmax at the prompt token that follows it, and its top alternatives, written on its
        sequence; in slices, so a long prefill chunk never holds logits of every row at once."""
        for at in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = rows[at:at + PROMPT_LOGPROB_ROWS]
            index = torch.tensor([r for _, r, _ in part], device=hidden.device)
            targets = torch.tensor([seq.token_ids[p] for seq, _, p in part], device=hidden.device)
            logp = self.model.compute_logits(hidden[index]).float().log_softmax(-1)
            chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            k = max(seq.params.prompt_logprobs for seq, _, _ in part)
            values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
            values, ids = values.tolist(), ids.tolist()
            for j, (seq, _, p) in enumerate(part):
                lp = {seq.token_ids[p]: chosen[j]}
                for t, v in zip(ids[j][:seq.params.prompt_logprobs], values[j]):
                    lp.setdefault(t, v)
                seq.prompt_logprobs[p] = lp

    @staticmethod
    def _pool(batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Each embedding request's chunk of hidden states into its pooled value (engine/pooler.py)."""
        row = 0
        for seq, n in batch:
            if seq.pooling is not None:
                accumulate(seq, hidden[row:row + n], seq.num_computed_tokens)
            row += n

    def _warn_foreign_thread(self) -> None:
        logger.warning("this CPU engine was loaded on one thread and is stepped on another: torch gives the second "
                       "thread an OpenMP pool of its own, and with more OpenMP threads than cores every step can run "
                       "~50%% slower; load and step it on the same thread, as `kvgate worker` does")
        self.home_thread = None  # said once

    def decode(self, batch: DecodeBatch, sampling: SamplingBatch, fed: bool = False
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A decode-only step: (None, tokens) where it replays a graph (`batch.bucket`) and every row is plain
        greedy (SamplingBatch.plain_greedy: the graph's argmax of the model-dtype logits), else (the logits in the
        model's dtype, their argmax where a graph computed it or None) for the sampler, which widens to float32
        only the rows that need it and takes the greedy rows' tokens from that argmax (a greedy row of a sampled
        batch is never cast, nor read again: at batch 256 x 151,936 vocab a whole cast was ~155 MB a step).
        `fed`: some input tokens may still be on the device (a launched step); a graph takes them itself, an eager
        step here."""
        if batch.bucket is None:
            input_ids = self.decode_inputs.fed(batch) if fed else batch.input_ids
            hidden = self.forward(input_ids, batch.positions, batch.meta, decode=True)
            return self.model.logits(hidden), None
        out = self.graphs.run(batch)
        if sampling.plain_greedy:
            return None, out.tokens
        return out.logits, out.tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                decode: bool = False) -> torch.Tensor:
        """The hidden states of an eager step; `decode` marks a decode-only one (that the host bench's stub device
        times as such), which runs here when no graph serves it."""
        return self.model(input_ids, positions, meta)
