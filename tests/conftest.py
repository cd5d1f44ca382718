"""Tiny random models built from configs, offline and seeded."""

import signal
import sys

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

import profiles  # noqa: F401  (the hypothesis profiles, shared with tests/core/conftest.py)
from workers import share_cores

share_cores()  # under xdist, each worker its share of the cores (tests/workers.py)

VOCAB = 256
_HELPERS = sys.modules[__name__]


def pytest_plugin_registered(plugin, plugin_name):
    """Keep ``from conftest import ...`` meaning this file once tests/core/conftest.py is loaded.

    Every conftest.py outside a package is the module ``conftest``, and pytest leaves the last one it loaded in
    ``sys.modules``: after tests/core's (which needs torch, pytest and hypothesis alone, so holds none of these
    helpers), the files collected later would import from it. This file is put back whenever another conftest
    registers.
    """
    if plugin is not _HELPERS and getattr(plugin, "__name__", None) == "conftest":
        sys.modules["conftest"] = _HELPERS


def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=2, max_position_embeddings=1024, **common)
    if arch == "mistral":
        return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=1024, sliding_window=None, **common)
    if arch == "gemma3":
        return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"], **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    if arch == "opt":
        return OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=1024, word_embed_proj_dim=64, **common)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "mistral", "gemma3", "gpt2", "opt"]
_CACHE = {}


def tiny_model(arch: str, dtype=torch.float32):
    key = (arch, dtype)
    if key not in _CACHE:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
        _CACHE[key] = model.to(dtype).eval()
    return _CACHE[key]


def left_padded(lengths, seed=0, pad_id=0):
    """Random token ids (never the pad id), left padded to the longest length."""
    gen = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.full((len(lengths), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, t - n:] = 1
    return ids, mask


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


class ByteTokenizer:
    """A real, if simple, tokenizer for the tiny models: one id per UTF-8 byte."""

    eos_token_id = 2
    pad_token_id = 0

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Enc([3 + b % (VOCAB - 3) for b in text.encode()])


def byte_tokenizer_fast():
    """A real Hugging Face tokenizer for the tiny models: byte-level, one token per byte, EOS = 256."""
    from tokenizers import Tokenizer
    from tokenizers import decoders as tk_decoders
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = tk_decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")


def batch_and_alone(model, config, lengths, seed=4, new_tokens=15):
    """Greedy generation of a left-padded batch, then of each sequence alone, through fresh ScissorhandsCaches.

    Asserts that every row's tokens and every budgeted layer's stored positions equal the sequence's alone;
    returns the batch's cache and each row's own, for further checks.
    """
    from scissorhands import ScissorhandsCache

    ids, mask = left_padded(lengths, seed=seed)

    def greedy(i, m, cache):
        with torch.no_grad():
            return model.generate(i, attention_mask=m, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)

    batch_cache = ScissorhandsCache(model, config)
    batch = greedy(ids, mask, batch_cache)
    alone_caches = []
    for row, n in enumerate(lengths):
        alone_cache = ScissorhandsCache(model, config)
        alone = greedy(ids[row:row + 1, -n:], mask[row:row + 1, -n:], alone_cache)
        assert torch.equal(batch[row, -(n + new_tokens):], alone[0])
        for lb, la in zip(batch_cache.budgeted_layers, alone_cache.budgeted_layers):
            assert torch.equal(lb.stored_positions(row), la.stored_positions(0))
        alone_caches.append(alone_cache)
    return batch_cache, alone_caches


def scored_and_decoded(model, context, cont, setup):
    """A continuation's log-probability from the exact scorer, and from decoding it token by token after the
    context through a fresh cache of the same setup; returns (scored, decoded, the decoding cache)."""
    from scissorhands.hf.scoring import continuation_logprobs

    (total, _), = continuation_logprobs(model, context, [cont], setup)
    cache = setup.make_cache(model, len(context) + len(cont))
    with torch.no_grad():
        logits = model(torch.tensor([context]), cache=cache).logits[0, -1]
        lp = [torch.log_softmax(logits.float(), -1)[cont[0]]]
        for a, b in zip(cont[:-1], cont[1:]):
            logits = model(torch.tensor([[a]]), cache=cache).logits[0, -1]
            lp.append(torch.log_softmax(logits.float(), -1)[b])
    return total, float(sum(lp)), cache


# ChatML, as SmolLM2's and Qwen2.5's tokenizers write it (without their default system turns).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def save_tiny_model(folder, arch: str = "llama", max_positions: int = 1024, chat_template: str | None = None):
    """Write a tiny random model with a byte-level tokenizer to ``folder`` (loadable by ``load_model``), with
    ``chat_template`` if given."""
    tokenizer = byte_tokenizer_fast()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = tiny_config(arch)
    config.vocab_size = len(tokenizer)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    config.max_position_embeddings = max_positions
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_cli(capsys, *args):
    """The CLI's main() in this process (fast): (exit code, stdout, stderr); argparse errors exit through SystemExit."""
    from scissorhands.tools.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def run_in_process(capsys, *args):
    """(exit code, stderr) of :func:`run_cli`."""
    code, _, err = run_cli(capsys, *args)
    return code, err
collect_ignore = ["on_vllm"]  # run by tests/on_vllm/run, in vLLM's own environment


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child that a test interrupts: SIGINT back to its default action.

    A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler,
    so without this a Ctrl-C test run under ``cmd &`` (or a CI runner that does the same) would send a signal
    the child never sees.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
