"""The exact scorer's log-probabilities, pinned on stored fixtures.

``tests/fixtures/scorer_logprobs.safetensors`` holds what the scorer gave for
every method on six tiny architectures and on SmolLM2. A refactor must leave
these numbers alone: bitwise on the tiny models, within 1e-6 on SmolLM2 (its
weights pass through a GGUF conversion). Bitwise equality needs the same torch
build and CPU kernels the fixtures were made with; on another platform the
tiny models are held to 1e-6 as well, since float reductions may then differ
in their last bit for reasons that have nothing to do with this code.

SmolLM2 off the fixtures' platform: 30 float32 layers of other SIMD kernels
(AVX2 against AVX-512 sum in another order) move the log-probabilities by up to
4.2e-5 on this text, with no eviction decision changed. That is what float32 can
promise across CPUs, so there the pin is 1e-3 on any token and 1e-4 on the mean.
A real change is far outside it: ``test_smollm2_pin_catches_a_real_change``
shows that one token less of budget moves the numbers by more than that. Only a
change meant to move the numbers regenerates them
(``python tests/fixtures/make_scorer_fixtures.py``), and its commit says so.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from scissorhands import ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs

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


# Off the fixtures' platform (see the module docstring): any token, and the mean over the text.
CROSS_CPU_MAX, CROSS_CPU_MEAN = 1e-3, 1e-4


def _within_pin(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` holds the pin, else what broke it."""
    diff = (got - want).abs()
    if SAME_PLATFORM:
        return None if float(diff.max()) <= 1e-6 else f"max diff {float(diff.max()):.3g} > 1e-6 (same platform)"
    if float(diff.max()) > CROSS_CPU_MAX or float(diff.mean()) > CROSS_CPU_MEAN:
        return f"max diff {float(diff.max()):.3g}, mean {float(diff.mean()):.3g} (other CPU: {CROSS_CPU_MAX}, " \
               f"{CROSS_CPU_MEAN})"
    return None


@pytest.fixture(scope="module")
def smollm2():
    from scissorhands.tools.models import load_model

    model, tok = load_model("smollm2-135m")
    return model, real_ids(tok)


@pytest.mark.slow
def test_smollm2_pinned(smollm2):
    model, ids = smollm2
    base = ScissorhandsConfig(budget=80, **PAPER_LIKE)
    for method in REAL_METHODS:
        got = token_logprobs(model, ids, ScoreSetup(get_method(method), 80, base))[0]
        broke = _within_pin(got, STORED[f"smollm2/{method}"])
        assert broke is None, f"smollm2/{method}: {broke}"


@pytest.mark.slow
def test_smollm2_pin_catches_a_real_change(smollm2):
    """The tolerance is not so loose that a real change passes: one token less of budget breaks it."""
    model, ids = smollm2
    base = ScissorhandsConfig(budget=79, **PAPER_LIKE)
    got = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 79, base))[0]
    assert _within_pin(got, STORED["smollm2/scissorhands"]) is not None
