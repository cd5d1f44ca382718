"""What the lm-eval backend tells a user: its model arguments (one table, from the declarations) and the
offline tasks shipped with the package.

The table is printed by ``python -m scissorhands.tools.lm_eval_backend --help``
before lm-eval's own help, and docs/lm_eval.md holds the same table (a test
keeps them equal). Defaults come from the backend's signature and the settings'
declarations, so the table cannot go stale.
"""

from __future__ import annotations

import inspect
import re
import tempfile
from importlib import resources
from pathlib import Path

from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import REQUIRED, declared, show
from scissorhands.core.settings.names import method_names

#: The backend's own arguments, beside the cache settings: name and meaning (the default is read from the code).
OWN_ARGUMENTS = (
    ("model", "anything `load_model` accepts: a known name (`smollm2-135m`, `qwen2.5-coder-0.5b`, "
              "`qwen2.5-coder-1.5b`), a `save_pretrained` folder, a `.gguf` file, a hub id; in Python also a "
              "built `(model, tokenizer)` pair"),
    ("method", f"the eviction method: {method_names()}"),
    ("budget", "up to 1: a fraction of each sequence's own length; above 1: a token count per budgeted layer; "
               "required unless `method=full`"),
    ("memory", "a byte budget instead of `budget`: a fraction of the full cache's K/V bytes, or a size per "
               "sequence (`64MiB`); the store and token budget are chosen per request"),
    ("seed", "seed of the `random` method"),
    ("dtype", "`float32`, `bfloat16` or `float16`, for models loaded by name"),
    ("device", "where to load the model (lm-eval's `--device`); `None`: CUDA if available, else CPU"),
    ("max_length", "the longest sequence given to the model and the rolling-window length; `None`: from the "
                   "model config, then the tokenizer, then 2048"),
    ("max_gen_toks", "new tokens for `generate_until` unless the task sets its own"),
    ("prefix_token_id", "the token that conditions an empty context and the first rolling window; `None`: BOS, "
                        "else EOS"),
    ("batch_size", "accepted so that lm-eval's flags work; requests are scored one context at a time"),
)

#: The offline tasks shipped in ``scissorhands/tools/data/lm_eval`` (six short reading-comprehension items).
SHIPPED_TASKS = ("scissorhands_tiny_mc", "scissorhands_tiny_ppl", "scissorhands_tiny_gen")


def model_args_table(backend) -> str:
    """Markdown table of every ``--model_args`` key of ``backend`` (the model class): its own, then each cache
    setting. The class is passed in, so that this module needs nothing from the backend's."""
    params = inspect.signature(backend.__init__).parameters
    lines = ["| argument | default | meaning |", "|---|---|---|"]
    for name, meaning in OWN_ARGUMENTS:
        default = params[name].default
        lines.append(f"| `{name}` | {'—' if default is None and name in ('budget', 'memory') else show(default)} | "
                     f"{meaning} |")
    for name, default, decl in declared(CacheSettings):
        meaning = decl.help.replace("](#", "](usage.md#")  # the declarations link within docs/usage.md
        lines.append(f"| `{name}` | {'—' if default is REQUIRED else show(default)} | {meaning} |")
    return "\n".join(lines)


def help_text(backend) -> str:
    """The scissorhands part of the backend's ``--help``, as plain text."""
    rows = [line.split(" | ") for line in model_args_table(backend).splitlines()[2:]]
    width = max(len(r[0].strip("| `")) for r in rows)
    out = ["scissorhands model type for lm-eval: --model scissorhands --model_args KEY=VALUE,KEY=VALUE,...",
           "", "model arguments (default in brackets):"]
    for name, default, meaning in rows:
        meaning = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", meaning.rstrip(" |")).replace("`", "")  # links: text
        out.append(f"  {name.strip('| `'):<{width}}  [{default.strip('`')}] {meaning}")
    out += ["", f"offline tasks shipped with scissorhands (used when no --include_path is given): "
                f"{', '.join(SHIPPED_TASKS)}",
            "example: python -m scissorhands.tools.lm_eval_backend --model scissorhands --model_args "
            "budget=0.3 --tasks scissorhands_tiny_mc --limit 2", "", "lm-eval's own options follow.", ""]
    return "\n".join(out)


def shipped_tasks_folder() -> Path:
    """A folder of the shipped task YAMLs whose data file is the packaged JSONL, by absolute path.

    lm-eval resolves a task's ``data_files`` against the working folder, so
    the packaged YAMLs name their data file alone and this writes copies that
    name it in full, in a fresh temporary folder.
    """
    source = resources.files("scissorhands.tools").joinpath("data/lm_eval")
    data = Path(str(source.joinpath("tiny_mc.jsonl")))
    folder = Path(tempfile.mkdtemp(prefix="scissorhands-lm-eval-tasks-"))
    for item in source.iterdir():
        if item.name.endswith(".yaml"):
            text = item.read_text().replace("    test: tiny_mc.jsonl", f"    test: {data}")
            (folder / item.name).write_text(text)
    return folder
