"""The lm-eval backend's model arguments, checked: each bad one a one-line ``ValueError`` naming it.

lm-eval hands every ``--model_args`` key to :class:`.lm_eval_backend.ScissorhandsLM`
as a keyword argument; :func:`check_model_args` checks them all, loads the
model when it is given by name, and works out the context length and the
prefix token. Kept apart from the model type (:mod:`.lm_eval_backend`) so that
each is small: this is arguments -> checked values, that is requests -> scores.
"""

from __future__ import annotations

import logging
import numbers
import operator
import os
from dataclasses import dataclass
from typing import Any

import torch

from scissorhands.core.methods import METHODS, EvictionMethod
from scissorhands.core.settings.budget import check_budget_spec
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import from_strings

from .models import check_supported, load_model, resolve_dtype

logger = logging.getLogger(__name__)

__all__ = ["ModelArgs", "check_model_args", "check_positive_int"]

# Fallback context length when neither the model config nor the tokenizer gives one.
_DEFAULT_MAX_LENGTH = 2048
# Tokenizers report "no limit" as a huge model_max_length.
_NO_TOKENIZER_LIMIT = 10**9


@dataclass(frozen=True)
class ModelArgs:
    """The backend's model arguments, checked; see :class:`.lm_eval_backend.ScissorhandsLM` for each.

    Attributes
    ----------
    method : type[EvictionMethod]
        The eviction method's class.
    budget_spec : float, int or None
        The token budget as given, resolved per sequence; None for
        ``method=full`` or with a byte budget.
    memory : float, int or None
        The byte budget, None unless ``memory`` was given.
    base : CacheSettings
        Every cache setting given, parsed and checked by its declaration.
    seed, max_gen_toks, max_length, prefix_token_id : int
        As given, or (the last two) worked out from the model and tokenizer.
    model : torch.nn.Module
        The model, loaded by name or as given, in eval mode.
    tokenizer : PreTrainedTokenizerBase
        Its tokenizer.
    """

    method: type[EvictionMethod]
    budget_spec: float | int | None
    memory: float | int | None
    base: CacheSettings
    seed: int
    max_gen_toks: int
    model: Any
    tokenizer: Any
    max_length: int
    prefix_token_id: int


def check_model_args(model, tokenizer, method, budget, memory, seed, dtype, device, max_length, max_gen_toks,
                     prefix_token_id, batch_size, settings: dict, what: str) -> ModelArgs:
    """Every model argument checked, in the order the backend lists them, and the model loaded.

    The arguments are :class:`.lm_eval_backend.ScissorhandsLM`'s, the cache
    settings gathered in ``settings``; ``what`` names them in the message for
    an unknown setting (``"model argument for scissorhands"``).

    Raises
    ------
    ValueError
        A one-line message naming the first bad argument, e.g. ``"budget: must be > 0, got -1"``.
    """
    chosen, budget_spec, memory = _eviction_args(method, budget, memory)
    # Every cache setting by its declaration: the same names, parsing and checks as the CLI's flags.
    base = CacheSettings(**from_strings(CacheSettings, settings, what))
    if budget_spec is not None:  # the plan's rule, before the model loads: a count above the protected tokens
        from scissorhands.core.planning.assembly import check_budget

        check_budget(budget_spec, base, chosen)
    seed = _check_int("seed", seed)
    max_gen_toks = check_positive_int("max_gen_toks", max_gen_toks)
    max_length = None if max_length is None else check_positive_int("max_length", max_length)
    if batch_size not in (None, 1, "1"):
        logger.info("batch_size=%s: requests are scored one context at a time", batch_size)

    built, tokenizer = _build(model, tokenizer, dtype, device)
    return ModelArgs(chosen, budget_spec, memory, base, seed, max_gen_toks, built, tokenizer,
                     max_length or _context_length(built, tokenizer), _prefix_token(tokenizer, prefix_token_id))


def _check_budget(budget, method: type[EvictionMethod]) -> float | int | None:
    """Validate the ``budget`` model argument; ``None`` stands for no eviction (``method=full``)."""
    if method.is_full:
        if budget is not None:
            logger.info("budget=%s is ignored for method=full", budget)
        return None
    if budget is None:
        raise ValueError(
            f"budget: is required for method {method.name!r} "
            "(a fraction of each request's length up to 1, or a token count)"
        )
    return check_budget_spec(budget, "budget")


def _eviction_args(method, budget, memory) -> tuple[type[EvictionMethod], float | int | None, float | int | None]:
    """The ``method``, ``budget`` and ``memory`` model arguments checked: the method's class, the token budget
    (``None`` for ``method=full`` or with a byte budget) and the byte budget (``None`` unless ``memory`` is given)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; choose from {', '.join(METHODS)}")
    chosen = METHODS[method]
    if memory is None:
        return chosen, _check_budget(budget, chosen), None
    from scissorhands.core.planning.assembly import check_given
    from scissorhands.core.planning.memory_target import parse_memory

    check_given(budget, memory, chosen)  # the plan's rule: a token budget or a memory target, for a method that evicts
    return chosen, None, parse_memory(memory)


def _check_int(name: str, value) -> int:
    """``value`` as an ``int`` (NumPy integers included); a bool or anything else is a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    return operator.index(value)


def check_positive_int(name: str, value) -> int:
    """``value`` as an ``int`` of at least 1; anything else is a ValueError naming ``name``."""
    value = _check_int(name, value)
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")
    return value


def _context_length(model, tokenizer) -> int:
    """The longest sequence the model takes: its config, else the tokenizer, else 2048."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(text_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_TOKENIZER_LIMIT:
        return limit
    return _DEFAULT_MAX_LENGTH


def _pick_device(device) -> torch.device:
    """The requested device; lm-eval's command line asks for CUDA by default, so fall back to the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: not a torch device, got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("device: CUDA is not available; using the CPU")
        return torch.device("cpu")
    return device


def _build(model, tokenizer, dtype, device):
    """Load (or accept) the model and tokenizer."""
    if isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError("tokenizer: must be a tokenizer object (a model name or folder brings its own)")
    if isinstance(model, (tuple, list)):
        if len(model) != 2 or tokenizer is not None:
            raise ValueError("model: a built model is given as (model, tokenizer), or model= plus tokenizer=")
        model, tokenizer = model
    if isinstance(model, (str, os.PathLike)):
        dtype = resolve_dtype(dtype)
        device = _pick_device(device)
        loaded, loaded_tokenizer = load_model(model, dtype=dtype, device=device)
        return loaded, tokenizer if tokenizer is not None else loaded_tokenizer
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a model name, a path or a built model, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("tokenizer: is required with an already-built model")
    check_supported(model)
    model.eval()
    return model, tokenizer


def _prefix_token(tokenizer, given) -> int:
    """The token that conditions an empty context: ``given``, else BOS, else EOS (as lm-eval's ``hf``)."""
    token = given
    if token is None:
        token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("prefix_token_id: the tokenizer has neither a BOS nor an EOS token; give one")
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"prefix_token_id: must be a token id (an integer >= 0), got {token!r}")
    return token
