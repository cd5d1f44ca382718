"""One plan per engine step, shared by every budgeted layer, and each request's round phase.

The first budgeted layer of a step turns vLLM's metadata into index tensors on the host: which rows are
prompts (and the prompt each holds, with ``prefill="keep-prompt"``), which decode, and which start a round at the
step's end; every other layer reuses the plan, and no layer reads a value back from a tensor. When the forward is
done the worker asks the planner to run the step's rounds for every layer at once (:func:`.rounds.round_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rounds import Rounded, round_layers
from .settings import PluginSettings


@dataclass
class StepPlan:
    """What one engine step asks of every budgeted layer (index tensors, CPU)."""

    #: (batch row, first token, end token, held positions, cached prefix) of each prompt: with a held prompt or
    #: prefix, vLLM's prefix cache may hold the sequence's first ``cached`` tokens already, and the step computes
    #: only the rest.
    prefills: list[tuple[int, int, int, int, int]]
    block_table: torch.Tensor  # (R, blocks) int32
    dec_tok: torch.Tensor | None = None  # (Dn,) each decode row's token index in the step
    dec_last: torch.Tensor | None = None  # (Dn,) its position p
    dec_tables: torch.Tensor | None = None  # (Dn, blocks) int32
    dec_slots: torch.Tensor | None = None  # (Dn,) physical slot of its new token
    dec_bucket: torch.Tensor | None = None  # (Dn,) ring slot its step adds to
    dec_restart: torch.Tensor | None = None  # (Dn,) bool: that ring slot starts a new bucket
    dec_held: torch.Tensor | None = None  # (Dn,) int64 each decode row's held positions [0, P), else None
    #: Each prompt row's own protected spans (batch row -> [(start, end)]), where its request has some.
    protect: dict[int, list[tuple[int, int]]] | None = None
    round_window: torch.Tensor | None = None  # (Rr, B) physical slots of each rounding row's window, oldest first
    round_seen: torch.Tensor | None = None  # (Rr,) tokens each rounding row has seen
    round_spans: torch.Tensor | None = None  # (Rr, S, 2) int32 each rounding row's protected spans, else None


class Planner:
    """Plans each step once for every layer, and remembers each request's round phase.

    A request's rounds come every ``drop`` tokens from ``max(prompt, B)`` on (the first token that finds its
    window full), as the core's rounds give: at the end of a step whose sequence length ``L`` satisfies
    ``L >= start`` and ``(L - start) % drop == 0``. A streamed prompt longer than the budget ran its own rounds
    (every ``prefill_drop`` tokens, or ``drop``, from the token ``B`` on): the next comes when the victims it left
    pending have left (:meth:`first_round`). A held prompt (``prefill="keep-prompt"``) stays beside the window, which
    then fills from the prompt's end: the first round comes at ``P + B``. A held prefix (the protected prefix of
    ``N`` tokens, :attr:`~.settings.PluginSettings.held_prefix`) stays beside a window of ``B - N``: the rounds
    come when the core's would, the window never holding the prefix.
    """

    def __init__(self, settings: PluginSettings):
        config = settings.config
        self.drop = config.drop_for(config.budget)
        self.streamed = config.prefill == "stream"
        self.holds_prompt = config.prefill == "keep-prompt"
        self.held_prefix = settings.held_prefix
        #: A request's window: the slots after what it holds (the budget, less a held prefix).
        self.window = settings.window
        #: Each live request's held positions ``[0, P)``, which its layers keep beside the window: its prompt
        #: (keep-prompt), or the held prefix.
        self.held: dict[str, int] = {}
        self.prompt_drop = config.prefill_drop_for(config.budget) or self.drop
        self.bucket_steps = config.bucket_steps()
        self.n_buckets = config.n_buckets()
        self.start: dict[str, int] = {}
        #: Each live request's block-table row and length at its last step (what its windows hold: tests, audits).
        self.where: dict[str, tuple[torch.Tensor, int]] = {}
        self.restarts = 0  # sequences begun again (a preempted request is recomputed from its first token)
        self.reused = 0  # tokens of sequences begun that vLLM's prefix cache held (keep-prompt; tests, audits)
        self._cached: tuple | None = None
        self._stack: tuple | None = None  # (the layers, their positions stacked, their importance stacked)
        #: The requests the scheduler starts in the coming step: new, or resumed after a preemption (:meth:`begin`).
        self.begun: frozenset[str] = frozenset()
        #: Each live request's own protected spans of its prompt (those it has), kept until it finishes.
        self.spans: dict[str, list[tuple[int, int]]] = {}

    def begin(self, request_ids, spans: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """The requests whose sequence the coming step starts (vLLM's new and resumed requests): with prefix
        caching their first chunk may be shorter than the sequence, its start read from cached blocks. ``spans``:
        the new requests' own protected spans (a resumed request keeps those it came with)."""
        self.begun = frozenset(request_ids)
        self.spans.update(spans or {})

    def first_round(self, prompt: int, held: int = 0) -> int:
        """The sequence length at whose step a request of ``prompt`` tokens starts its first round after the
        prompt: ``max(prompt, B)``, or for a streamed prompt past the budget when the victims its last round in
        the prompt chose (at the token ``c``, ``prompt_drop`` of them, one leaving per token) have all left.
        With a held prompt of ``held`` tokens the window starts after it, and what follows it in ``prompt`` (a
        preempted request's generated tokens, recomputed) streams into the window."""
        b_, d = self.window, self.prompt_drop
        streamed = prompt - held  # the tokens the window takes (after a held prompt, the recomputed generation)
        if not (self.streamed or self.holds_prompt) or streamed <= b_:
            return held + max(streamed, b_)  # (a prompt within a held prefix: the window fills after the prefix)
        return held + b_ + (streamed - 1 - b_) // d * d + d

    def release(self, request_ids) -> None:
        """Finished (or aborted) requests."""
        for rid in request_ids:
            self.start.pop(rid, None)
            self.where.pop(rid, None)
            self.held.pop(rid, None)
            self.spans.pop(rid, None)

    def after_step(self, step_id, layers: list[Rounded]) -> None:
        """Step ``step_id``'s rounds for every layer that deferred them, as one batch (the engine calls this once its
        forward is done; a layer's round touches only its own state, so when it runs within the step changes
        nothing). The layers' positions and importance move into one tensor each the first time, so that the
        batch is a few operations on all of them, not a few dozen per layer."""
        plan = self.cached(step_id)
        waiting = [layer for layer in layers if layer.defer_rounds and layer.kv_cache is not None]
        if plan is None or plan.round_window is None or plan.round_seen is None or not waiting:
            return
        stacked = self._stacked(waiting)
        if stacked is None:  # layers of unlike shapes: each alone
            for layer in waiting:
                layer._round(plan.round_window, plan.round_seen, layer.kv_cache, layer.block, plan.round_spans)
            return
        round_layers(waiting, stacked[0], stacked[1], [layer.kv_cache for layer in waiting], plan.round_window,
                     plan.round_seen, waiting[0].block, plan.round_spans)

    def _stacked(self, layers: list[Rounded]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The layers' positions (L, slots, H_kv) and importance (L, NB, num_blocks, H_kv, N) as one tensor each,
        the layers' own now views of them; None if their shapes differ."""
        if self._stack is not None and self._stack[0] == [id(layer) for layer in layers]:
            return self._stack[1], self._stack[2]
        pos = [layer.pos for layer in layers]
        accs = [layer.acc for layer in layers]
        shapes = {None if p is None else p.shape for p in pos}, {None if a is None else a.shape for a in accs}
        if len(shapes[0]) != 1 or None in shapes[0] or len(shapes[1]) != 1 or len({x.block for x in layers}) != 1:
            return None
        pos_all = torch.stack(pos)  # type: ignore[arg-type]
        acc_all = None if accs[0] is None else torch.stack(accs)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            layer.pos = pos_all[i]
            if acc_all is not None:
                layer.acc = acc_all[i]
        self._stack = ([id(layer) for layer in layers], pos_all, acc_all)
        return pos_all, acc_all

    def cached(self, step_id) -> StepPlan | None:
        """The plan of step ``step_id`` if a layer has made it already."""
        return self._cached[1] if self._cached is not None and self._cached[0] == step_id else None

    def for_step(self, step_id, request_ids, query_start, seq_lens, block_table, slot_mapping, block: int) -> StepPlan:
        """The plan of step ``step_id``, made by its first layer and reused by the others."""
        plan = self.cached(step_id)
        if plan is None:
            plan = self.plan(request_ids, query_start, seq_lens, block_table, slot_mapping, block)
            self._cached = (step_id, plan)
        return plan

    def plan(self, request_ids, query_start, seq_lens, block_table, slot_mapping, block: int) -> StepPlan:
        starts, lengths = query_start.tolist(), seq_lens.tolist()
        prefills, decode, rounds = [], [], []
        protect: dict[int, list[tuple[int, int]]] = {}
        b_, m = self.window, self.drop
        table = block_table.clone()  # vLLM reuses its tensor; ``where`` keeps this step's rows
        for i, rid in enumerate(request_ids):
            a, b, total = starts[i], starts[i + 1], lengths[i]
            if b == a:
                continue
            self.where[rid] = (table[i], total)
            cached = total - (b - a)
            if cached == 0 or rid in self.begun:  # the sequence's first chunk: a new request, or a preempted one again
                if cached and not (self.holds_prompt or self.held_prefix):
                    raise RuntimeError("scissorhands: a prompt came in part from vLLM's prefix cache; the plugin "
                                       "turns prefix caching off unless prefill='keep-prompt' or protect_prefix")
                if rid in self.start:
                    self.restarts += 1
                if self.holds_prompt:  # a recomputed request holds the prompt it first had, as vLLM's manager does
                    self.held.setdefault(rid, total)  # (a new one's sequence is its prompt)
                elif self.held_prefix:
                    self.held[rid] = self.held_prefix
                held = self.held.get(rid, 0)
                self.start[rid] = self.first_round(total, held)
                self.reused += cached
                prefills.append((i, a, b, held, cached))
                if rid in self.spans:
                    protect[i] = self.spans[rid]
            elif b - a == 1 and rid in self.start:
                decode.append((i, a, total - 1))
            else:
                raise RuntimeError("scissorhands: a prompt came in chunks; the plugin turns chunked prefill off")
            if total >= self.start[rid] and (total - self.start[rid]) % m == 0:
                rounds.append((i, total))
        plan = StepPlan(prefills, block_table, protect=protect or None)
        if decode:
            rows = torch.tensor([d[0] for d in decode])
            plan.dec_tok = torch.tensor([d[1] for d in decode])
            last = plan.dec_last = torch.tensor([d[2] for d in decode])
            plan.dec_tables = block_table[rows].to(torch.int32).contiguous()
            plan.dec_slots = slot_mapping[plan.dec_tok].long()
            if self.held:  # what each row holds, up to its own position (a held prefix longer than the sequence)
                holds = torch.tensor([self.held.get(request_ids[d[0]], 0) for d in decode], dtype=torch.int64)
                plan.dec_held = torch.minimum(holds, last + 1)
            if self.bucket_steps is None:
                plan.dec_bucket = torch.zeros_like(last)
                plan.dec_restart = torch.zeros(len(decode), dtype=torch.bool)
            else:
                plan.dec_bucket = (last // self.bucket_steps) % self.n_buckets
                plan.dec_restart = last % self.bucket_steps == 0
        if rounds:
            rows = torch.tensor([r[0] for r in rounds])
            seen = plan.round_seen = torch.tensor([r[1] for r in rounds])
            positions = seen[:, None] - b_ + torch.arange(b_)[None, :]  # (Rr, B), oldest first
            tables = block_table[rows].long()
            plan.round_window = tables.gather(1, positions // block) * block + positions % block
            spans = [self.spans.get(request_ids[r[0]], []) for r in rounds]
            if any(spans):  # padded with empty (0, 0) spans
                table_of = torch.zeros(len(spans), max(len(s) for s in spans), 2, dtype=torch.int32)
                for j, row in enumerate(spans):
                    if row:
                        table_of[j, :len(row)] = torch.tensor(row, dtype=torch.int32)
                plan.round_spans = table_of
        return plan
