"""An lm-evaluation-harness model type that scores every request under a compressed KV cache.

Importing this module registers the model type ``scissorhands`` with
lm-evaluation-harness (``pip install "scissorhands[lmeval]"``). Each of
lm-eval's three request kinds is then computed through the budgeted cache:

* ``loglikelihood``: the context and continuation are streamed through a
  fresh cache, exactly as if decoded token by token
  (:func:`scissorhands.hf.scoring.continuation_logprobs`). Requests that share
  their context tokens and their budget share one pass over the context.
* ``loglikelihood_rolling``: the text is cut into lm-eval's rolling windows
  of ``max_length`` tokens; each window goes through its own fresh cache and
  the log-probs of its newly predicted tokens are summed.
* ``generate_until``: greedy decoding through the cache until a stop string,
  the end-of-text token or ``max_gen_toks`` new tokens.

The budget given as ``budget=`` is resolved per sequence: a value up to 1 is a
fraction of that sequence's own length (context + continuation tokens, a
rolling window's tokens, or prompt + ``max_gen_toks`` for generation), a
value above 1 is a token count (see :func:`scissorhands.core.planning.assembly.budget_tokens`).

Tokenisation follows lm-eval's Hugging Face backend (``--model hf``), so
``method=full`` reproduces its numbers: trailing whitespace of a context moves
into the continuation, context + continuation are encoded together and split
at the length of the encoded context, an empty context is replaced by the
prefix token, over-long requests keep their last ``max_length + 1`` tokens.
The prefix token is, like lm-eval's, the tokenizer's BOS token when it has one
and its EOS token otherwise (``prefix_token_id=`` overrides it).

Examples
--------
From Python::

    import lm_eval
    import scissorhands.tools.lm_eval_backend  # registers "scissorhands"

    lm_eval.simple_evaluate(model="scissorhands",
                            model_args="method=scissorhands,budget=0.2",
                            tasks=["hellaswag"])

From the shell (lm-eval's own command line, with this model type registered)::

    python -m scissorhands.tools.lm_eval_backend --model scissorhands \\
        --model_args method=h2o,budget=0.25 --tasks scissorhands_tiny_mc

(the ``scissorhands_tiny_*`` tasks ship with the package and run offline; see
:mod:`.lm_eval_help`; ``--help`` lists the model arguments first).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

try:
    # lm-eval fills its registry with its own (lazy) model types only when the
    # registry is empty at lookup time; import them first so that registering
    # ours does not hide "hf", "vllm", ...
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "scissorhands.tools.lm_eval_backend needs lm-evaluation-harness: pip install 'scissorhands[lmeval]'"
    ) from exc

from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs, token_logprobs

from . import lm_eval_chat
from .lm_eval_args import check_model_args, check_positive_int
from .lm_eval_tokens import RequestTokens

logger = logging.getLogger(__name__)

__all__ = ["MODEL_NAME", "ScissorhandsLM", "main"]

_T = TypeVar("_T")

#: The name this backend is registered under with lm-eval (``--model scissorhands``).
MODEL_NAME = "scissorhands"

class ScissorhandsLM(LM):
    """lm-eval model whose requests are scored under a budgeted (evicting) KV cache.

    Every argument can be given in lm-eval's ``--model_args`` string, e.g.
    ``model=smollm2-135m,method=tova,budget=256,dtype=float32``.

    Parameters
    ----------
    model : str, path, PreTrainedModel or (model, tokenizer)
        What :func:`scissorhands.tools.models.load_model` accepts (the embedded
        default ``smollm2-135m``, a folder, a ``.gguf`` file or a hub id), or
        an already-built model (then ``tokenizer`` is required) or pair.
        Built models are used as they are (``dtype``/``device`` do not apply).
    tokenizer : PreTrainedTokenizerBase, optional
        The tokenizer for an already-built model.
    method : str
        A registered method (:data:`scissorhands.METHODS`).
    budget : float or int
        Tokens each budgeted layer may store. Up to 1: a fraction of each
        sequence's own length; above 1: a token count. Never below
        ``recent + 1``. Required unless ``method=full`` or ``memory`` is given.
    memory : float, int or str, optional
        A byte budget instead (:mod:`scissorhands.core.planning.memory_target`): a fraction of the full cache's
        K/V bytes, or a size per sequence such as ``"64MiB"``; the store and the token budget are chosen
        for each request's length.
    **settings
        Every setting of :class:`scissorhands.CacheSettings` by name, a registered plug-in's own included (``recent``,
        ``window``, ``kv_bits``, ...), parsed and checked by its declaration,
        as the CLI's flags are (``window=none``; methods such as ``h2o`` or
        ``tova`` override some of them; with ``method=full`` and ``kv_bits``, a
        quantised cache without eviction).
    seed : int
        Seed of the ``random`` method.
    dtype : str
        ``float32`` (default), ``bfloat16`` or ``float16``, for loaded models.
    device : str, optional
        Where to load the model; default CUDA when available, else CPU.
    max_length : int, optional
        Longest sequence given to the model (default: from the model config,
        else the tokenizer, else 2048). Longer loglikelihood requests keep their
        last ``max_length + 1`` tokens; rolling windows have this length.
    max_gen_toks : int
        Default number of new tokens for ``generate_until`` (a task's
        ``max_gen_toks`` overrides it).
    prefix_token_id : int, optional
        Token that conditions an empty context and the first rolling window
        (default: BOS if the tokenizer has one, else EOS, as lm-eval's ``hf``).
    batch_size, max_batch_size
        Accepted for lm-eval's command line; requests run one context at a time.

    Raises
    ------
    ValueError
        A one-line message naming the bad argument, e.g. ``"budget: must be > 0, got -1"``.
    """

    def __init__(self, model="smollm2-135m", tokenizer=None, method: str = "scissorhands",
                 budget: float | int | None = None, memory: float | int | str | None = None, seed: int = 0,
                 dtype: str = "float32", device: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, prefix_token_id: int | None = None, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, **settings):
        super().__init__()
        args = check_model_args(model, tokenizer, method, budget, memory, seed, dtype, device, max_length,
                                max_gen_toks, prefix_token_id, batch_size, settings, f"model argument for {MODEL_NAME}")
        self.method, self.budget_spec, self.memory, self.base = args.method, args.budget_spec, args.memory, args.base
        self.seed, self._max_gen_toks, self._max_length = args.seed, args.max_gen_toks, args.max_length
        self._model, self.tokenizer, self._prefix_token_id = args.model, args.tokenizer, args.prefix_token_id
        self.tokens = RequestTokens(self.tokenizer, self._max_length, self._prefix_token_id)
        logger.info("lm-eval backend: method=%s budget=%s max_length=%d prefix token %d",
                    self.method.name, self.budget_spec, self._max_length, self._prefix_token_id)

    # -- what lm-eval reads -----------------------------------------------------------------
    @property
    def model(self):
        """The wrapped causal LM."""
        return self._model

    @property
    def device(self) -> torch.device:
        return self._model.device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    # -- chat templates (lm-eval's ``--apply_chat_template``; see :mod:`.lm_eval_chat`) ----------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template when lm-eval is asked to apply one; None when it is not."""
        return lm_eval_chat.chat_template(self.tokenizer, chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the tokenizer's chat template writes it, as lm-eval's ``hf`` model writes it."""
        return lm_eval_chat.apply_chat_template(self.tokenizer, chat_history, add_generation_prompt)

    def get_model_info(self) -> dict:
        """Settings recorded in lm-eval's results under ``config``: method, budget and every cache setting."""
        settings = {f"scissorhands_{k}": v for k, v in self.base.as_dict().items()}
        return {"scissorhands_method": self.method.name, "scissorhands_budget": self.budget_spec,
                "scissorhands_memory": self.memory, **settings,
                "max_length": self._max_length, "prefix_token_id": self._prefix_token_id}

    # -- budgets -----------------------------------------------------------------------------
    def setup_for(self, length: int) -> ScoreSetup:
        """The scoring setup for one sequence of ``length`` tokens (the budget is resolved against it)."""
        if self.memory is None and self.budget_spec is None:
            return ScoreSetup(self.method, None, self.base, self.seed)
        from scissorhands.hf.cache import cache_plan

        # The plan makes the budget tokens (a count, a fraction of this length) or chooses for a byte budget.
        made = cache_plan(self._model, self.base, self.method(seed=self.seed), budget=self.budget_spec,
                          memory=self.memory, length=length)
        return ScoreSetup.planned(made, self.method, self.seed)

    # -- tokenisation (lm-eval's hf conventions; see :class:`.lm_eval_tokens.RequestTokens`) ------------
    def encode(self, text: str, special_tokens: bool | None = None) -> list[int]:
        return self.tokens.encode(text, special_tokens)

    def split_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        return self.tokens.split_request(context, continuation)

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        return self.tokens.rolling_windows(text)

    # -- the three request kinds --------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Log-prob of each continuation given its context, under the compressed cache.

        Parameters
        ----------
        requests : list of lm_eval Instance
            ``args = (context, continuation)``.

        Returns
        -------
        list of (float, bool)
            Summed log-prob of the continuation tokens and whether each of them
            was the greedy (argmax) prediction.
        """
        return _loglikelihood(self, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-prob of whole texts: rolling windows, each through a fresh compressed cache.

        Parameters
        ----------
        requests : list of lm_eval Instance
            ``args = (text,)``.

        Returns
        -------
        list of float
            Sum over the windows of the log-probs of their predicted tokens; each
            window's budget is resolved against its own length (its tokens,
            conditioning ones included).
        """
        return _each(self, "loglikelihood_rolling", requests, disable_tqdm, lambda args: _text_logprob(self, args[0]))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation through the compressed cache until a stop string.

        Parameters
        ----------
        requests : list of lm_eval Instance
            ``args = (context, gen_kwargs)``; ``gen_kwargs`` may hold ``until``
            (a string or list of stop strings), ``max_gen_toks``, and
            ``do_sample``/``temperature`` (only greedy decoding is supported).

        Returns
        -------
        list of str
            Each continuation, cut before its first stop string.
        """
        def one(args) -> str:
            context, gen_kwargs = args
            return self.generate_one(context, dict(gen_kwargs or {}))

        return _each(self, "generate_until", requests, disable_tqdm, one)

    def generate_one(self, context: str, gen_kwargs: dict) -> str:
        """Greedy continuation of one prompt; see :meth:`generate_until`."""
        return _greedy(self, context, gen_kwargs)


def _each(lm: ScissorhandsLM, kind: str, requests, disable_tqdm: bool, score: Callable[[tuple], _T]) -> list[_T]:
    """``score(request.args)`` of each request of lm-eval's request kind ``kind``, in order, under a progress bar;
    each result is also recorded in lm-eval's cache hook."""
    from tqdm.auto import tqdm

    out = []
    for req in tqdm(requests, desc=f"scissorhands {kind}", disable=disable_tqdm):
        out.append(score(req.args))
        lm.cache_hook.add_partial(kind, req.args, out[-1])
    return out


def _text_logprob(lm: ScissorhandsLM, text: str) -> float:
    """Log-prob of one whole text: over its rolling windows, each through a fresh compressed cache, the sum of the
    log-probs of their predicted tokens."""
    total = 0.0
    for ctx, pred in lm.rolling_windows(text):
        ids = torch.tensor(ctx + pred)  # (T,)
        logprobs, _ = token_logprobs(lm._model, ids, lm.setup_for(len(ids)))  # (T - 1,)
        total += float(logprobs[-len(pred):].sum())
    return total


@torch.no_grad()
def _greedy(lm: ScissorhandsLM, context: str, gen_kwargs: dict) -> str:
    """Greedy continuation of one prompt through a fresh compressed cache, cut before the first stop string."""
    stops = lm.tokens.stop_strings(gen_kwargs.pop("until", None))
    new_tokens = check_positive_int("max_gen_toks", gen_kwargs.pop("max_gen_toks", lm._max_gen_toks))
    temperature = gen_kwargs.pop("temperature", 0.0)
    if gen_kwargs.pop("do_sample", False) and temperature not in (0, 0.0, None):
        raise ValueError("do_sample: only greedy decoding is supported by the scissorhands backend")
    if gen_kwargs:
        logger.debug("generate_until: ignoring %s", sorted(gen_kwargs))
    prompt = lm.encode(context) if context else [lm._prefix_token_id]
    room = max(lm._max_length - new_tokens, 1)
    prompt = prompt[-room:]
    total = len(prompt) + new_tokens
    cache = lm.setup_for(total).make_cache(lm._model, total)
    device = lm._model.device
    step_input = torch.tensor([prompt], device=device)  # (1, T)
    produced: list[int] = []
    eos_id = lm.tokenizer.eos_token_id
    for _ in range(new_tokens):
        logits = lm._model(step_input, cache=cache, logits_to_keep=1).logits  # (1, 1, V)
        token = int(logits[0, -1].argmax())
        if token == eos_id:
            break
        produced.append(token)
        if stops and any(s in lm.tokenizer.decode(produced) for s in stops):
            break
        step_input = torch.tensor([[token]], device=device)  # (1, 1)
    text = lm.tokenizer.decode(produced, skip_special_tokens=True)
    for stop in stops:
        text = text.split(stop)[0]
    return text


def _loglikelihood(lm: ScissorhandsLM, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
    """See :meth:`ScissorhandsLM.loglikelihood`."""
    from tqdm.auto import tqdm

    encoded = [lm.split_request(*req.args) for req in requests]
    # Requests with the same context tokens and the same resolved budget
    # share one pass over the context (e.g. the choices of one question).
    groups: dict[tuple, tuple[ScoreSetup, list[int]]] = {}
    for i, (ctx, cont) in enumerate(encoded):
        setup = lm.setup_for(len(ctx) + len(cont))
        groups.setdefault((tuple(ctx), setup.budget, setup.base), (setup, []))[1].append(i)
    results: list[tuple[float, bool] | None] = [None] * len(encoded)
    for (ctx, _, _), (setup, members) in tqdm(groups.items(), desc="scissorhands loglikelihood",
                                              disable=disable_tqdm):
        conts = [encoded[i][1] for i in members]
        for i, score in zip(members, continuation_logprobs(lm._model, list(ctx), conts, setup)):
            results[i] = score
            lm.cache_hook.add_partial("loglikelihood", requests[i].args, score)
    return [r for r in results if r is not None]


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line with the ``scissorhands`` model type registered.

    A ``ValueError`` (a bad model argument such as an unknown ``method``) is
    printed as one line, ``scissorhands: error: <parameter>: ...``, and exits
    with code 2; Ctrl-C exits with code 130.

    Parameters
    ----------
    argv : list of str, optional
        lm-eval's arguments (default: ``sys.argv[1:]``), e.g.
        ``["--model", "scissorhands", "--model_args", "budget=0.2", "--tasks", "hellaswag"]``.
    """
    from .cli import first_line, interrupt_in_finalizers, say

    interrupt_in_finalizers()
    from lm_eval.__main__ import cli_evaluate

    from .lm_eval_help import help_text, shipped_tasks_folder

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        sys.stdout.write(help_text(ScissorhandsLM) + "\n")  # the command line's own help, before lm-eval's
    elif "--include_path" not in args and not any(a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(shipped_tasks_folder())]  # the shipped offline tasks, by name
    sys.argv = [sys.argv[0], *args]
    try:
        cli_evaluate()
    except ValueError as e:  # a bad model argument: one line naming it, as the scissorhands command line does
        sys.exit(say(f"error: {first_line(e)}", 2))
    except KeyboardInterrupt:
        sys.exit(say("interrupted", 130))


if __name__ == "__main__":
    # Run as ``python -m scissorhands.tools.lm_eval_backend``: this file executes as
    # __main__; the registered class is the one of the imported module.
    from .lm_eval_backend import main as _main

    _main()
else:
    register_model(MODEL_NAME)(ScissorhandsLM)
