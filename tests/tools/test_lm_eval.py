"""The lm-evaluation-harness backend: lm-eval's requests, scored through the compressed cache.

A tiny random Llama with the real SmolLM2 tokenizer keeps this quick; the
task is the one shipped in scissorhands/tools/data/lm_eval (JSONL, read offline).
"""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, LlamaConfig

from scissorhands.tools.lm_eval_backend import ScissorhandsLM
from scissorhands.tools.lm_eval_help import shipped_tasks_folder
from scissorhands.tools.models import load_model

pytestmark = pytest.mark.slow  # the tokenizer comes from the embedded default model

REPO = Path(__file__).resolve().parents[2]
TEXT = ("Scissorhands keeps the pivotal tokens of the key-value cache and drops the rest, so that memory "
        "stays bounded while the quality of the model holds up on long inputs.")


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No network, datasets cached in a temporary folder, the task's relative data path resolvable.

    ``datasets`` and ``huggingface_hub`` read the environment when first
    imported, so their settings are patched too.
    """
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets"))
        mp.chdir(REPO)
        yield


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2-135m")[1]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(shipped_tasks_folder()), include_defaults=False)


def evaluate(lm, task_manager, tasks):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, bootstrap_iters=0,
                                   log_samples=True)


def sample_scores(results, task):
    """{(context, continuation): log-likelihood} for every request of a loglikelihood task."""
    out = {}
    for sample in results["samples"][task]:
        for args, resp in zip(sample["arguments"], sample["resps"]):
            out[tuple(args)] = resp[0][0]
    return out


def plain_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Reference: one ordinary forward pass, tokenised the way lm-eval's hf backend does."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole = tokenizer.encode(stripped + continuation)
    n_ctx = len(tokenizer.encode(stripped))
    ids = torch.tensor([whole])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # (T-1, V)
    targets = ids[0, 1:]
    return float(logprobs.gather(-1, targets[:, None])[n_ctx - 1:].sum())


def test_registered_without_hiding_lm_evals_own_models():
    assert get_model("scissorhands") is ScissorhandsLM
    assert get_model("hf") is HFLM


@pytest.fixture(scope="module")
def full_results(tiny, tokenizer, task_manager):
    """The tiny tasks under method=full (no eviction)."""
    lm = ScissorhandsLM(model=(tiny, tokenizer), method="full")
    return evaluate(lm, task_manager, ["scissorhands_tiny_mc", "scissorhands_tiny_gen"])


def test_task_runs_and_full_cache_equals_a_plain_forward_pass(full_results, tiny, tokenizer):
    res = full_results
    acc = res["results"]["scissorhands_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert res["config"]["scissorhands_method"] == "full"
    scores = sample_scores(res, "scissorhands_tiny_mc")
    assert len(scores) == 6 * 4
    for (context, continuation), got in scores.items():
        assert got == pytest.approx(plain_loglikelihood(tiny, tokenizer, context, continuation), abs=1e-4)
    # generate_until went through the backend too, one answer per doc
    gens = [s["resps"][0][0] for s in res["samples"]["scissorhands_tiny_gen"]]
    assert len(gens) == 6 and all(isinstance(g, str) for g in gens)


def test_tight_budget_changes_the_scores(full_results, tiny, tokenizer, task_manager):
    full = sample_scores(full_results, "scissorhands_tiny_mc")
    lm = ScissorhandsLM(model=(tiny, tokenizer), method="scissorhands", budget=0.25, recent=4, window=8)
    res = evaluate(lm, task_manager, ["scissorhands_tiny_mc"])
    assert "acc,none" in res["results"]["scissorhands_tiny_mc"]
    tight = sample_scores(res, "scissorhands_tiny_mc")
    assert tight.keys() == full.keys()
    assert all(math.isfinite(v) for v in tight.values())
    assert max(abs(tight[k] - full[k]) for k in full) > 1e-3


def test_same_numbers_as_lm_evals_hf_backend_with_the_full_cache(tiny, tokenizer):
    """Tokenisation, empty contexts, truncation and rolling windows follow lm-eval's hf model."""
    hf = HFLM(pretrained=tiny, tokenizer=tokenizer, batch_size=1, max_length=24, device="cpu")
    ours = ScissorhandsLM(model=(tiny, tokenizer), method="full", max_length=24)
    requests = [Instance("loglikelihood", {}, args, i) for i, args in enumerate([
        ("The cat sat on the ", "mat and slept."),  # trailing space moves into the continuation
        ("", "Hello there, friend."),  # empty context: the prefix token
        ("A rather long context " * 8, " that is cut from the left"),  # longer than max_length
    ])]
    for a, b in zip(ours.loglikelihood(requests, disable_tqdm=True), hf.loglikelihood(requests, disable_tqdm=True)):
        assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]
    rolling = [Instance("loglikelihood_rolling", {}, (TEXT,), 0)]
    assert len(ours.rolling_windows(TEXT)) > 1  # several windows of 24 tokens
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True)[0] == pytest.approx(
        hf.loglikelihood_rolling(rolling, disable_tqdm=True)[0], abs=1e-3)
    gen = [Instance("generate_until", {}, ("The cat sat on the", {"until": ["zzz"], "max_gen_toks": 6}), 0)]
    assert ours.generate_until(gen, disable_tqdm=True) == hf.generate_until(gen, disable_tqdm=True)


def test_a_chat_template_is_applied_as_lm_evals_hf_backend_applies_it(tiny, tokenizer, task_manager):
    """``apply_chat_template``: the same prompts (the SmolLM2 tokenizer's ChatML turns) and the same answers as
    lm-eval's hf model, with the full cache; a budget as large as every prompt and answer changes nothing."""
    hf = HFLM(pretrained=tiny, tokenizer=tokenizer, batch_size=1, device="cpu")

    def run(lm):
        res = lm_eval.simple_evaluate(model=lm, tasks=["scissorhands_tiny_gen"], task_manager=task_manager,
                                      bootstrap_iters=0, log_samples=True, apply_chat_template=True, limit=3)
        return [(s["arguments"][0][0], s["resps"][0][0]) for s in res["samples"]["scissorhands_tiny_gen"]]

    theirs = run(hf)
    assert all(context.startswith("<|im_start|>") and context.endswith("<|im_start|>assistant\n")
               for context, _ in theirs)
    assert run(ScissorhandsLM(model=(tiny, tokenizer), method="full")) == theirs
    assert run(ScissorhandsLM(model=(tiny, tokenizer), method="scissorhands", budget=512)) == theirs
    chat = ScissorhandsLM(model=(tiny, tokenizer), method="full")
    assert chat.chat_template(False) is None and chat.chat_template(True) == tokenizer.chat_template
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.apply_chat_template(system).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_a_chat_template_missing_or_refusing_a_system_turn(tiny):
    from conftest import byte_tokenizer_fast

    bare = ScissorhandsLM(model=(tiny, byte_tokenizer_fast()), method="full")
    with pytest.raises(ValueError, match="^apply_chat_template: the model's tokenizer has no chat template$"):
        bare.apply_chat_template([{"role": "user", "content": "Hi"}])
    # A template that refuses a system turn (as Gemma's does) gets the conversation without it, as with lm-eval's hf.
    bare.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                    "{{ raise_exception('no system turn') }}{% endif %}"
                                    "{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}")
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert bare.apply_chat_template(system) == "<user>Hi"


def test_rolling_with_a_budget_that_holds_the_text_equals_the_full_cache(tiny, tokenizer):
    n = len(tokenizer.encode(TEXT)) + 1  # the prefix token included
    request = [Instance("loglikelihood_rolling", {}, (TEXT,), 0)]

    def rolling(**kwargs):
        return ScissorhandsLM(model=(tiny, tokenizer), **kwargs).loglikelihood_rolling(request, disable_tqdm=True)[0]

    full = rolling(method="full")
    assert rolling(method="scissorhands", budget=n) == pytest.approx(full, abs=1e-3)
    assert rolling(method="h2o", budget=1.0) == pytest.approx(full, abs=1e-3)
    assert abs(rolling(method="scissorhands", budget=8, recent=2, window=4) - full) > 1e-3
    # windows of 16 tokens, each through its own cache: a budget of 17 holds every window
    assert rolling(method="streaming", budget=17, max_length=16) == pytest.approx(
        rolling(method="full", max_length=16), abs=1e-3)


def test_generation_under_a_budget(tiny, tokenizer):
    prompt = "Once upon a time, in a land far away, there lived a king who loved to count his gold coins every day."
    request = [Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}), 0)]
    full = ScissorhandsLM(model=(tiny, tokenizer), method="full").generate_until(request, disable_tqdm=True)
    roomy = ScissorhandsLM(model=(tiny, tokenizer), method="tova", budget=1.0).generate_until(request,
                                                                                            disable_tqdm=True)
    tight = ScissorhandsLM(model=(tiny, tokenizer), method="scissorhands", budget=0.3, recent=4,
                           window=8).generate_until(request, disable_tqdm=True)
    assert roomy == full
    assert isinstance(tight[0], str) and "\n" not in tight[0]
    sampled = [Instance("generate_until", {}, (prompt, {"do_sample": True, "temperature": 0.7}), 0)]
    with pytest.raises(ValueError, match="^do_sample: "):
        ScissorhandsLM(model=(tiny, tokenizer), method="full").generate_until(sampled, disable_tqdm=True)


def test_budget_is_resolved_per_request(tiny, tokenizer):
    lm = ScissorhandsLM(model=(tiny, tokenizer), method="scissorhands", budget=0.2, recent=10)
    assert lm.setup_for(200).budget == 40
    assert lm.setup_for(30).budget == 11  # never below recent + 1
    assert ScissorhandsLM(model=(tiny, tokenizer), budget=64).setup_for(1000).budget == 64
    assert ScissorhandsLM(model=(tiny, tokenizer), method="full", budget=0.2).setup_for(1000).budget is None


def test_model_args_string(tiny, tokenizer):
    lm = ScissorhandsLM.create_from_arg_string("method=h2o,budget=0.5,recent=3,window=none,drop=4,max_length=64",
                                               {"model": (tiny, tokenizer), "batch_size": 8, "device": "cpu"})
    assert (lm.method.name, lm.budget_spec, lm.base.recent, lm.base.window, lm.base.drop, lm.max_length) == (
        "h2o", 0.5, 3, None, 4, 64)
    assert lm.prefix_token_id == tokenizer.bos_token_id


def test_packed_kv_with_a_residual_scores_as_the_library_does(tiny, tokenizer):
    """model_args reach the cache: kv_bits/kv_residual give the same log-likelihood as the scorer with them."""
    from scissorhands import CacheSettings, get_method
    from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs

    lm = ScissorhandsLM.create_from_arg_string("budget=24,recent=8,kv_bits=4,kv_group_size=8,kv_residual=8",
                                               {"model": (tiny, tokenizer)})
    assert (lm.base.kv_bits, lm.base.kv_residual) == (4, 8)
    ctx, cont = list(range(5, 45)), [7, 9, 11]
    setup = ScoreSetup(get_method("scissorhands"), 24, CacheSettings(recent=8, kv_bits=4, kv_group_size=8,
                                                                      kv_residual=8))
    want = continuation_logprobs(tiny, ctx, [cont], setup)[0]
    got = lm.setup_for(len(ctx) + len(cont))
    assert got.base == setup.base and got.budget == 24
    assert continuation_logprobs(tiny, ctx, [cont], got)[0] == want


@pytest.mark.parametrize("args, name", [
    ("budget=0.5,kv_bits=3", "kv_bits"),
    ("budget=0.5,kv_residual=4", "kv_residual"),
    ("budget=0", "budget"),
    ("budget=-0.5", "budget"),
    ("budget=2.5", "budget"),
    ("budget=much", "budget"),
    ("method=scissorhands", "budget"),
    ("method=nope,budget=0.5", "method"),
    ("budget=0.5,recent=-1", "recent"),
    ("budget=0.5,drop=1.5", "drop"),
    ("budget=0.5,importance=max", "importance"),
    ("budget=0.5,window=0", "window"),
    ("budget=0.5,max_length=0", "max_length"),
    ("budget=0.5,max_gen_toks=0", "max_gen_toks"),
    ("budget=0.5,temperature=3", "temperature"),
    ("budget=0.5,prefix_token_id=-1", "prefix_token_id"),
    ("budget=0.5,tokenizer=gpt2", "tokenizer"),
])
def test_bad_model_args_raise_one_line_errors(tiny, tokenizer, args, name):
    with pytest.raises(ValueError, match=f"^{name}: ") as err:
        ScissorhandsLM.create_from_arg_string(args, {"model": (tiny, tokenizer)})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, name", [
    (dict(model="./no/such/folder"), "model"),
    (dict(model="smollm2-135m", dtype="int8"), "dtype"),
    (dict(model=object()), "model"),
])
def test_bad_model_raises_one_line_errors(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: ") as err:
        ScissorhandsLM(method="full", **kwargs)
    assert "\n" not in str(err.value)


def test_built_model_needs_its_tokenizer(tiny):
    with pytest.raises(ValueError, match="^tokenizer: "):
        ScissorhandsLM(model=tiny, method="full")
