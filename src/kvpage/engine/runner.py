"""ModelRunner: turns a scheduler plan into tensors, runs the model, returns logits.

Per step it builds, once, for every KV group an :class:`AttentionMetadata`
(positions, slot mapping, seq_lens, block tables), calls ``backend.plan`` on it, runs
the model's paged forward and returns the logits of the last token of every sequence
that samples this step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvpage.attention.checks import check_layers, check_step_layers
from kvpage.attention.metadata import AttentionMetadata, KVCache, slot_of
from kvpage.attention.plan import StepPlan
from kvpage.attention.state import StateBatch, StateCache, run_slot_copies
from kvpage.cache import batch_block_tables
from kvpage.engine.scheduler import SchedulerOutput
from kvpage.errors import SpecError
from kvpage.specs import CacheSpec

if TYPE_CHECKING:
    from kvpage.attention.protocol import AttentionBackend
    from kvpage.models.model import ModelRunnerModel


#: a step's dense torch ops (linears, norms, elementwise glue) run on all of torch's
#: threads only when its largest linear is at least this many multiply-adds (rows x
#: weight elements), when the backend runs attention on threads of its own
#: (``BackendCapabilities.own_cpu_threads``); below it, on one. 4M multiply-adds are
#: ~120 us of one core on the AVX-512 EPYC of docs/benchmarks.md, against tens of
#: microseconds to wake and join a second OpenMP thread per op (measured in
#: docs/benchmarks.md, "Threads"): a tiny model's decode ops run faster on one thread,
#: while the ~125M Llama's smallest decode step (one row, gate/up 4.7M) stays on every
#: thread, where the second pays.
DENSE_THREADS_MIN_MACS = 1 << 22
#: apply the rule above; False = every op of every step on all of torch's threads (an
#: A/B switch for benchmarks)
DENSE_THREADS_RULE = True


#: Note: ``torch.set_num_threads`` is process-wide. While a step runs with the lower
#: count, torch code on another thread of the process also sees it (a thread that first
#: enters torch's parallel code then keeps it); the server runs its engine steps on one
#: thread and its tokenizers do not use torch's intra-op pool.


def dense_threads(macs: int, threads: int) -> int:
    """Torch threads for a step's dense ops: ``threads`` when its largest linear is
    ``macs >= DENSE_THREADS_MIN_MACS`` multiply-adds, else 1."""
    return threads if macs >= DENSE_THREADS_MIN_MACS else 1


class StepInputs:
    """Host-side arrays of one step.

    Attributes:
        input_ids: ``[num_tokens]`` int64 token ids, sequences packed in batch order.
        positions: ``[num_tokens]`` int64 absolute positions.
        query_lens / seq_lens: ``[num_seqs]`` int64 new tokens / tokens after the step.
        logits_indices: ``[num_sampling_seqs]`` int64 rows of the last token of each
            sequence that samples.
        block_tables: per KV group ``[num_seqs, max_blocks]`` int32, padded with
            ``kvpage.slots.PAD_BLOCK`` (-1) past each sequence's blocks: entries a
            backend never reads (only ``ceil(seq_len / block_size)`` per row are used).
        slot_mappings: per KV group ``[num_tokens]`` int64 slots (-1 = padding; none
            here, every computed token has a slot).
    """

    def __init__(self, out: SchedulerOutput, block_size: int, num_groups: int) -> None:
        sched = out.scheduled
        n = len(sched)
        # one host pass over the scheduled sequences (loops, not generators: this runs
        # every step for every sequence)
        start_list, qlen_list = [], []
        decode = True
        for s in sched:
            start_list.append(s.start)
            qlen_list.append(s.num_tokens)
            if s.num_tokens != 1:
                decode = False
        starts = np.array(start_list, dtype=np.int64).reshape(n)
        qlens = np.array(qlen_list, dtype=np.int64).reshape(n)
        total = int(qlens.sum())
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        seq_idx = np.repeat(np.arange(n, dtype=np.int64), qlens)
        positions = np.arange(total, dtype=np.int64) - cu[seq_idx] + starts[seq_idx]
        if decode:
            ids = [s.token_ids[0] for s in sched]
        else:
            ids = [t for s in sched for t in s.token_ids]
        self.input_ids = np.asarray(ids, dtype=np.int64)
        self.positions = positions
        self.query_lens = qlens
        self.seq_lens = starts + qlens
        self.query_start_loc = cu
        last = cu[1:] - 1
        self.logits_indices = last[[i for i, s in enumerate(sched) if s.samples]]
        self.block_tables: list[np.ndarray] = []
        self.slot_mappings: list[np.ndarray] = []
        blk = positions // block_size
        for g in range(num_groups):
            bt = batch_block_tables([s.block_tables[g] for s in sched])  # padded with -1
            self.block_tables.append(bt)
            self.slot_mappings.append(
                slot_of(bt[seq_idx, blk].astype(np.int64), positions, block_size)
            )


class ModelRunner:
    """Runs a ``kvpage.models`` model over the paged caches.

    Args:
        model: a ``ModelRunnerModel`` (``forward(input_ids, positions, kv_caches,
            meta_per_group, backend, logits_indices)``).
        backend: the attention backend.
        kv_caches: one KVCache per layer (mutated by the model's ``write_kv`` calls and
            by :meth:`copy_blocks`).
        cache_spec: the cache layout (block_size, KV groups).
        device: where the tensors go.
        state_caches: hybrid models: one ``StateCache`` per ``cache_spec.state_layers``
            entry (mutated by the recurrent mixers and by :meth:`copy_state_slots`);
            None = no state layers.
        state_host_caches: host-memory rows of the state pool's host snapshots, one
            ``StateCache`` per state cache (``kvpage.cache.state_pool``); None = none.

    Raises:
        SpecError: ``state_caches`` do not match ``cache_spec.state_layers``.
    """

    def __init__(
        self,
        model: ModelRunnerModel,
        backend: AttentionBackend[Any],
        kv_caches: list[KVCache],
        cache_spec: CacheSpec,
        device: torch.device,
        *,
        state_caches: list[StateCache] | None = None,
        state_host_caches: list[StateCache] | None = None,
    ) -> None:
        n_state = len(cache_spec.state_layers)
        if n_state != len(state_caches or ()):
            raise SpecError(
                f"state_caches: expected {n_state} (one per cache_spec.state_layers entry), "
                f"got {len(state_caches or ())}"
            )
        self.state_caches = state_caches if n_state else None
        self.state_host_caches = state_host_caches
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.cache_spec = cache_spec
        self.device = device
        self.groups = cache_spec.kv_groups
        #: per token: (largest decoder linear as run, lm_head) multiply-adds
        self.dense_macs = model.dense_macs_per_token()
        # the layers' caches and specs never change: validated once here, and each step's
        # plan per KV group against its pools (checks.check_step_layers), not per layer
        self.cache_device = kv_caches[0].kv.device if kv_caches else device
        check_layers(kv_caches, cache_spec.layers, self.cache_device)
        self.pools = [
            {(kv_caches[i].block_size, kv_caches[i].num_blocks) for i in g.layer_ids}
            for g in self.groups
        ]
        caps = getattr(backend, "capabilities", None)
        self.own_cpu_threads = device.type == "cpu" and bool(getattr(caps, "own_cpu_threads", False))  # fmt: skip

    def copy_blocks(self, copies: list[list[tuple[int, int]]]) -> None:
        """Run copy-on-write block copies (per KV group) before the step's writes."""
        for g, pairs in enumerate(copies):
            if not pairs:
                continue
            caches = [self.kv_caches[layer] for layer in self.groups[g].layer_ids]
            t = torch.tensor(pairs, dtype=torch.int64, device=self.device).reshape(-1, 2)
            self.backend.copy_blocks(caches, t)

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Run recurrent-state slot copies ``(src, dst)`` in order on every state cache
        (snapshots, prefix-hit restores, forks; ``SchedulerOutput.state_copies``).
        Copies are applied one after another, so a later pair reads what an earlier one
        wrote."""
        if pairs and self.state_caches is not None:
            run_slot_copies(self.state_caches, pairs, self.state_host_caches)

    def build_state_batch(self, out: SchedulerOutput, inp: StepInputs) -> StateBatch:
        """The step's :class:`~kvpage.attention.state.StateBatch`: each sequence's live
        slot (``out.state_slots``), ``has_initial_state`` = it starts past position 0
        (its slot holds the state after its ``start`` tokens: an earlier chunk, or a
        restored snapshot), the packed offsets, and whether every sequence decodes."""
        dev = self.device
        starts = [s.start for s in out.scheduled]
        return StateBatch(
            state_indices=torch.tensor(out.state_slots, dtype=torch.int64, device=dev),
            has_initial_state=torch.tensor([st > 0 for st in starts], dtype=torch.bool, device=dev),
            query_start_loc=torch.from_numpy(inp.query_start_loc).to(dev),
            is_decode=all(s.num_tokens == 1 for s in out.scheduled),
        )

    def build_metadata(self, inp: StepInputs) -> list[StepPlan]:
        """One plan per KV group: ``backend.plan`` of the group's AttentionMetadata."""
        dev = self.device
        qsl = torch.from_numpy(inp.query_start_loc.astype(np.int32)).to(dev)
        seq_lens = torch.from_numpy(inp.seq_lens.astype(np.int32)).to(dev)
        qcpu = inp.query_lens.tolist()
        scpu = inp.seq_lens.tolist()
        metas = []
        for g in range(len(self.groups)):
            meta = AttentionMetadata(
                query_start_loc=qsl,
                seq_lens=seq_lens,
                block_tables=torch.from_numpy(inp.block_tables[g]).to(dev),
                slot_mapping=torch.from_numpy(inp.slot_mappings[g]).to(dev),
                max_query_len=max(qcpu, default=0),
                max_seq_len=max(scpu, default=0),
                query_lens_cpu=qcpu,
                seq_lens_cpu=scpu,
            )
            plan = self.backend.plan(meta)
            check_step_layers(plan, self.pools[g], self.cache_device)
            metas.append(plan)
        return metas

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, extra_spans: list[tuple[int, int, int]] | None = None
    ) -> torch.Tensor:
        """Run the step ``out`` plans: its block and state-slot copies, its inputs
        (:meth:`step_inputs`; ``extra_spans``: ``(scheduled index, first token in its
        chunk, count)`` of more positions whose logits are wanted, prompt logprobs) and
        plans (:meth:`build_metadata`), the model (:meth:`run_model`) with the dense
        ops' CPU threads (:meth:`dense_threads_for`).

        Returns:
            ``[num_sampling_seqs + num_extra, vocab_size]`` logits on ``device``, in
            float32 or, where the model computes them in bfloat16 with nothing after
            the lm_head, in bfloat16 (``ModelRunnerModel.forward(float_logits=False)``:
            the float32 copy is exact and left to the consumers that need it): one
            row per scheduled sequence with ``samples`` set, in batch order, then the
            ``extra_spans`` rows in order.
        """
        if any(out.copies):
            self.copy_blocks(out.copies)
        if out.state_copies:
            self.copy_state_slots(out.state_copies)
        inp = self.step_inputs(out, extra_spans)
        metas = self.build_metadata(inp)  # the backend's plan sees every thread
        threads = want = torch.get_num_threads()
        if threads > 1 and self.own_cpu_threads and DENSE_THREADS_RULE:
            want = self.dense_threads_for(inp, threads)
        if want == threads:
            return self.run_model(out, inp, metas)
        torch.set_num_threads(want)
        try:
            return self.run_model(out, inp, metas)
        finally:
            torch.set_num_threads(threads)

    def step_inputs(
        self, out: SchedulerOutput, extra_spans: list[tuple[int, int, int]] | None
    ) -> StepInputs:
        """The step's packed inputs (:class:`StepInputs`), with the ``extra_spans``
        positions (see :meth:`execute`) appended to its logits indices."""
        inp = StepInputs(out, self.cache_spec.block_size, len(self.groups))
        if extra_spans:
            qsl = inp.query_start_loc
            extra = [np.arange(qsl[i] + a, qsl[i] + a + n) for i, a, n in extra_spans]
            inp.logits_indices = np.concatenate([inp.logits_indices, *extra]).astype(np.int64)
        return inp

    def dense_threads_for(self, inp: StepInputs, threads: int) -> int:
        """CPU threads for the step's dense ops (:func:`dense_threads` of the larger of
        its projections' and its LM head's multiply-accumulates)."""
        per_row, lm = self.dense_macs
        macs = max(len(inp.input_ids) * per_row, len(inp.logits_indices) * lm)
        return dense_threads(macs, threads)

    def run_model(
        self, out: SchedulerOutput, inp: StepInputs, metas: list[StepPlan]
    ) -> torch.Tensor:
        """The model's forward pass over ``inp`` with the step's plans ``metas`` (and,
        for a hybrid model, its state caches and :meth:`build_state_batch`); the
        logits (see :meth:`execute`)."""
        dev = self.device
        state_kw: dict[str, Any] = {}
        if self.state_caches is not None:
            state_kw = {
                "state_caches": self.state_caches,
                "state_batch": self.build_state_batch(out, inp),
            }
        logits: torch.Tensor = self.model(
            torch.from_numpy(inp.input_ids).to(dev),
            torch.from_numpy(inp.positions).to(dev),
            self.kv_caches,
            metas,
            self.backend,
            torch.from_numpy(inp.logits_indices).to(dev),
            float_logits=False,
            **state_kw,
        )
        return logits


__all__ = [
    "DENSE_THREADS_MIN_MACS",
    "DENSE_THREADS_RULE",
    "ModelRunner",
    "StepInputs",
    "dense_threads",
]
