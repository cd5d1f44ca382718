"""``ScissorhandsLayer`` is the core's budgeted layer behind transformers' layer API.

Chunk by chunk, it gives the outputs and keeps the positions of the core tests' driver (tests/core/driver.py:
a ``BudgetedKV`` and ``core.attend.streaming.attend``, which the core's tests hold to the naive reference), each
``update`` routes the attention call that follows to its layer, and the stored keys never outgrow the budget.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from test_reference import cases, chunk_mask, kept_of, make_inputs, run_layer

from scissorhands.core.attend.prefill import Streamed
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.hf.cache import ScissorhandsLayer


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_transformers_layer_is_the_core_layer(case):
    q, k, v, valid = make_inputs(case)
    params = dict(budget=case["budget"], recent=case["recent"], drop=case["drop"], window=case["window"],
                  bucket_steps=case["bucket_steps"], importance=case["importance"], scaling=0.5)
    want, core = run_layer(q, k, v, valid, case["chunks"], query_tile=case["tile"], **params)
    window, steps = case["window"], case["bucket_steps"]
    n_buckets = 1 if window is None else math.ceil(window / (steps or 1))
    state = ImportanceState(case["importance"], None if window is None else (steps or 1), n_buckets)
    layer = ScissorhandsLayer.of_budget(case["budget"], case["recent"], case["drop"], state, Scissorhands(),
                                        query_tile=case["tile"], prefill=Streamed(None))
    outs, i = [], 0
    for c in case["chunks"]:
        kwargs = {}
        layer.update(k[:, :, i:i + c], v[:, :, i:i + c], kwargs=kwargs)
        assert kwargs["scissorhands_layer"] is layer
        vc = valid[:, i:i + c]
        mask = None if bool(vc.all()) else chunk_mask(vc)
        outs.append(layer.attend(q[:, :, i:i + c], k[:, :, i:i + c], v[:, :, i:i + c], mask, 0.5))
        assert int(layer.slots.lengths.max()) <= case["budget"]
        assert layer.keys.shape[-2] <= case["budget"]
        i += c
    assert torch.equal(torch.cat(outs, dim=2), want)
    assert kept_of(layer, case["b"], case["h_kv"]) == kept_of(core, case["b"], case["h_kv"])
    assert layer.compressions == core.compressions
