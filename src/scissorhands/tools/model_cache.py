"""Reading models through transformers, and the converted copies kept of GGUF files.

Reading a GGUF file means de-quantising every tensor, which takes tens of
seconds, so the first load writes a plain safetensors copy into the user cache
directory (:func:`cache_dir`) and every later load reads that copy instead.
The copy carries a manifest of its files' sizes, modification times and
SHA-256 sums; each load compares sizes and times (and hashes a file again only
when its time changed), and a copy that is incomplete or corrupt is converted
again, with a one-line warning.

Copies are kept of the embedded default, of the models known by name
(assembled first from their installed parts, see :mod:`.known_models`) and of
any ``.gguf`` file given by path (keyed by its path, size and modification
time). Which name means which file is :func:`.models.load_model`'s business;
this module reads the files. Every failure is reported as a one-line
:class:`ModelLoadError` whose message starts with ``"model:"``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile

import torch

from . import known_models

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "ModelLoadError",
    "cache_dir",
    "from_pretrained",
    "guarded",
    "load_converted",
    "load_gguf",
    "load_known",
]

# Files whose presence marks a finished conversion.  The folder is moved into
# place only once it is complete, so checking for them is enough.
_CACHE_MARKERS = ("config.json", "model.safetensors")

#: File in a converted model's folder that records each file's size, modification time and SHA-256.
MANIFEST = "scissorhands-manifest.json"


class ModelLoadError(ValueError):
    """A model could not be found, loaded, or is not supported."""


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


# --------------------------------------------------------------------------
# reading through transformers, failures in one line
# --------------------------------------------------------------------------


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


def guarded(name: str, load):
    """Run ``load()`` and turn any failure into a one-line ModelLoadError naming ``name``."""
    try:
        return load()
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers/huggingface_hub raise many kinds
        raise ModelLoadError(f"model: cannot load {name!r}: {_one_line(exc)}") from exc


def from_pretrained(source, dtype=None, **kwargs):
    """Model and tokenizer from a directory, hub id, or (with gguf_file) a GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_kwargs = dict(kwargs)
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    tok_kwargs = {k: v for k, v in kwargs.items() if k in ("gguf_file", "local_files_only")}
    tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    return model, tokenizer


# --------------------------------------------------------------------------
# the conversion and its self-verifying cache
# --------------------------------------------------------------------------


def _convert_gguf(folder: str, filename: str):
    """De-quantise a GGUF file into a float32 model plus its tokenizer."""
    from transformers import GgufConfig

    logger.info("converting %s (one-off, may take ~30 s)", os.path.join(folder, filename))
    model, tokenizer = from_pretrained(
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


# --------------------------------------------------------------------------
# the three kinds of converted copy
# --------------------------------------------------------------------------


def load_converted(gguf_path: str, cache_folder: pathlib.Path, label: str):
    """Load from the verified safetensors cache, converting the GGUF when needed.

    A cached folder that is incomplete, fails its checksums or cannot be read
    is converted again and replaced, with a one-line warning saying why.

    Parameters
    ----------
    gguf_path : str
        The GGUF file converted when the cache does not check out.
    cache_folder : pathlib.Path
        Where its converted copy is kept.
    label : str
        The name a failure's message gives the model.

    Returns
    -------
    model, tokenizer
        In float32, on the CPU.
    """
    problem = _cache_problem(cache_folder)
    if problem is None and cache_folder.exists():
        try:
            logger.debug("loading cached conversion %s", cache_folder)
            return from_pretrained(str(cache_folder), dtype=torch.float32)
        except Exception as exc:
            problem = f"is unreadable ({_one_line(exc)})"
    if problem is not None:
        logger.warning("cached model in %s %s; converting again", cache_folder, problem)
    folder, filename = os.path.split(os.path.abspath(gguf_path))
    model, tokenizer = guarded(label, lambda: _convert_gguf(folder, filename))
    _write_cache(model, tokenizer, cache_folder, replace=problem is not None)
    return model, tokenizer


def end_ids(tokenizer, ends: tuple[str, ...]) -> list[int]:
    """The ids of the tokens in ``ends`` (a known model's end tokens), in order; a one-line ModelLoadError if the
    tokenizer lacks one."""
    ids = []
    for token in ends:
        i = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(i, int) or i < 0 or i == tokenizer.unk_token_id:
            raise ModelLoadError(f"model: its tokenizer has no {token!r}, which its release ends a generation with")
        ids.append(i)
    return ids


def with_ends(model, tokenizer, ends: tuple[str, ...], folder: pathlib.Path | None = None):
    """``model`` ending its generations at every token of ``ends`` (its generation config's ``eos_token_id``), as
    its release does; ``folder``, its converted copy, is brought up to date too (its ``generation_config.json``
    and manifest), so that vLLM, which reads the folder, ends where transformers does."""
    if not ends:
        return model, tokenizer
    ids = end_ids(tokenizer, ends)
    if model.generation_config.eos_token_id != ids:
        model.generation_config.eos_token_id = ids
        if folder is not None and folder.is_dir():
            try:
                model.generation_config.save_pretrained(folder)
                _write_manifest(folder)
            except OSError as exc:  # a read-only cache: this process ends right, the copy stays as it was
                logger.warning("could not update %s (%s)", folder / "generation_config.json", _one_line(exc))
    return model, tokenizer


def load_known(known: known_models.KnownModel):
    """A model known by name: its verified converted copy, or its installed parts assembled and converted once;
    ending its generations where its release does (:func:`with_ends`)."""
    folder = cache_dir() / known.cache_name
    problem = _cache_problem(folder)
    if problem is None and folder.exists():
        try:
            model, tokenizer = from_pretrained(str(folder), dtype=torch.float32)
        except Exception as exc:
            problem = f"is unreadable ({_one_line(exc)})"
        else:
            return with_ends(model, tokenizer, known.ends, folder)
    if problem is not None:
        logger.warning("cached model in %s %s; converting again", folder, problem)
    logger.info("assembling %s from %d installed parts (one-off)", known.name, len(known.parts))
    gguf = known_models.assemble(known, cache_dir())
    try:
        model, tokenizer = guarded(known.name, lambda: _convert_gguf(str(gguf.parent), gguf.name))
    finally:
        gguf.unlink(missing_ok=True)  # the converted copy is what is kept
    with_ends(model, tokenizer, known.ends)
    _write_cache(model, tokenizer, folder, replace=problem is not None)
    return model, tokenizer


def _gguf_cache_name(path: str) -> str:
    """Cache folder name for a GGUF file: its stem plus a hash of its identity."""
    absolute = os.path.abspath(path)
    stat = os.stat(absolute)
    key = f"{absolute}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(absolute))[0]
    safe_stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:80]
    return f"gguf-{safe_stem}-{digest}"


def load_gguf(path: str, name: str):
    """A ``.gguf`` file given by path: its converted copy, keyed by the file's path, size and modification time."""
    try:
        folder = cache_dir() / _gguf_cache_name(path)
    except OSError as exc:
        raise ModelLoadError(f"model: cannot load {name!r}: {_one_line(exc)}") from exc
    return load_converted(path, folder, name)
