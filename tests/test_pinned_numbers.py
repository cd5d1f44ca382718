"""The exact scorer's log-probabilities, pinned on stored fixtures.

``tests/fixtures/scorer_logprobs.safetensors`` holds what the scorer gave for
every method on six tiny architectures and on SmolLM2. A refactor must leave
these numbers alone: bitwise on the tiny models, within 1e-6 on SmolLM2 (its
weights pass through a GGUF conversion). Bitwise equality needs the same torch
build and CPU kernels the fixtures were made with; on another platform the
tiny models are held to 1e-6 as well, since float reductions may then differ
in their last bit for reasons that have nothing to do with this code. Only a change meant to move the
numbers regenerates them (``python tests/fixtures/make_scorer_fixtures.py``),
and its commit says so.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from scissorhands import ScissorhandsConfig
from scissorhands.methods import get_method
from scissorhands.scoring import ScoreSetup, token_logprobs

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_scorer_fixtures import PAPER_LIKE, REAL_METHODS, platform_signature, real_ids, tiny_cases  # noqa: E402

from conftest import tiny_model  # noqa: E402

STORED = load_file(str(FIXTURES / "scorer_logprobs.safetensors"))
with safe_open(str(FIXTURES / "scorer_logprobs.safetensors"), "pt") as f:
    SAME_PLATFORM = f.metadata() == platform_signature()
CASES = list(tiny_cases())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tiny_models_bitwise(case):
    key, arch, base, method, ids = case
    got = token_logprobs(tiny_model(arch), ids, ScoreSetup(get_method(method), base.budget, base, seed=3))[0]
    if SAME_PLATFORM:
        assert torch.equal(got, STORED[key]), f"{key}: max diff {(got - STORED[key]).abs().max():.3g}"
    else:
        torch.testing.assert_close(got, STORED[key], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_smollm2_within_1e6():
    from scissorhands.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = real_ids(tok)
    base = ScissorhandsConfig(budget=80, **PAPER_LIKE)
    for method in REAL_METHODS:
        got = token_logprobs(model, ids, ScoreSetup(get_method(method), 80, base))[0]
        torch.testing.assert_close(got, STORED[f"smollm2/{method}"], rtol=0, atol=1e-6)
