"""Generation under a budget: the library function behind ``scissorhands generate`` and ``demo``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from scissorhands.core.methods import EvictionMethod
from scissorhands.core.planning.assembly import CachePlan
from scissorhands.core.settings.config import ScissorhandsConfig
from scissorhands.hf.cache import ScissorhandsCache
from scissorhands.hf.modelinfo import model_facts

from .stats import mean_ci


def demo_prompt() -> str:
    """About 2,000 SmolLM2 tokens of real text: the opening of Hamlet (public domain)."""
    return resources.files("scissorhands.tools").joinpath("data/hamlet_act1.txt").read_text()


#: The demo's question about its excerpt, and the excerpt's length in the model's tokens.
DEMO_QUESTION = "Who are the characters in this scene, and what happens?"
DEMO_EXCERPT_TOKENS = 1000


def demo_chat(tokenizer) -> str:
    """The demo's prompt: the first ~1,000 tokens of Hamlet (cut at a line end) and a question about them.

    Rendered with the model's chat template when it has one (the instruct
    model then answers about the text instead of continuing it), else as
    plain text ending in the question.
    """
    text = demo_prompt()
    ids = tokenizer(text)["input_ids"]
    excerpt = tokenizer.decode(ids[:DEMO_EXCERPT_TOKENS])
    excerpt = excerpt[: excerpt.rfind("\n")].rstrip() if "\n" in excerpt else excerpt
    user = f"{excerpt}\n\n{DEMO_QUESTION}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    return user + "\n"


@dataclass
class AnswerCost:
    """How much a budgeted cache loses on a reference answer (the full cache's), teacher-forced.

    ``delta_nll`` is the mean over the answer's tokens of the budgeted cache's
    negative log-likelihood minus the full cache's, with its 95% half-width
    (tokens of one answer are not independent, so read it as a guide);
    ``agreement`` is the share of the answer's tokens that are also the
    budgeted cache's top choice at that position.
    """

    delta_nll: float
    ci95: float
    agreement: float
    tokens: int

    def reading(self) -> str:
        """One line in words."""
        if self.delta_nll < 0.02:
            return "the budgeted cache finds the full cache's answer as likely as the full cache does"
        if self.delta_nll < 0.1:
            return "a small cost: the budgeted cache finds the full cache's answer slightly less likely"
        return ("a clear cost at this budget: the budgeted cache finds the full cache's answer markedly less "
                "likely (raise --budget, or try --prefill prompt-aware)")


@torch.no_grad()
def answer_cost(model, tokenizer, prompt: str, answer: torch.Tensor, config: ScissorhandsConfig | CachePlan,
                method: EvictionMethod | None = None, protect=None) -> AnswerCost:
    """The budgeted cache's cost on ``answer`` (token ids, (N,)) after ``prompt``, against the full cache.

    ``config`` is a configuration (with ``method`` and ``protect``) or the plan a cache is built from (which
    holds both).

    Both caches see the prompt as one chunk and the answer as a second, as in
    generation (the answer chunk is scored exactly as if decoded token by
    token with these tokens), so the budgeted side evicts what generation
    would have evicted.
    """
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    answer = answer.reshape(1, -1).to(model.device)
    sides = []
    for cache in (ScissorhandsCache.build(model, config, method, protect=protect), DynamicCache(config=model.config)):
        first = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:]
        rest = model(answer[:, :-1], cache=cache).logits if answer.shape[1] > 1 else first[:, :0]
        logits = torch.cat([first, rest], dim=1).float()  # (1, N, V): predicts each answer token
        sides.append((torch.log_softmax(logits, -1).gather(-1, answer[..., None])[0, :, 0], logits.argmax(-1)[0]))
    (lp_b, top_b), (lp_f, _) = sides
    delta, ci = mean_ci((lp_f - lp_b).tolist())
    return AnswerCost(delta_nll=delta, ci95=ci, agreement=float((top_b == answer[0]).float().mean()),
                      tokens=int(answer.shape[1]))


def check_positions(model, prompt_tokens: int, max_new_tokens: int, prompt_name: str = "prompt") -> None:
    """Refuse, in one line, a prompt plus new tokens longer than the model's maximum positions.

    Raises
    ------
    ValueError
        ``"<prompt_name>: ..."`` when the prompt alone is too long, else ``"max-new-tokens: ..."``.
    """
    limit = model_facts(model).max_positions
    if not isinstance(limit, int) or limit <= 0:
        return
    if prompt_tokens >= limit:
        raise ValueError(f"{prompt_name}: {prompt_tokens} tokens, but the model has {limit} positions "
                         "(the prompt and the new tokens must fit)")
    if prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"max-new-tokens: {prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
                         f"model's {limit} positions; at most {limit - prompt_tokens} new tokens fit")


class _Clock(BaseStreamer):
    """generate()'s streamer hook: times the first new token and drives an optional tqdm bar."""

    def __init__(self, total: int, progress: bool):
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="generating", unit="tok", leave=False)
        self.calls = 0
        self.start = time.perf_counter()
        self.first_token = None

    def put(self, value):
        self.calls += 1
        if self.calls == 1:  # the first call carries the prompt
            return
        if self.first_token is None:
            self.first_token = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)

    def end(self):
        if self.bar is not None:
            self.bar.close()


@dataclass
class GenerationResult:
    """What one generation produced and cost."""

    texts: list[str]
    new_tokens: torch.Tensor  # (B, N)
    prompt_tokens: list[int]
    seconds: float
    prefill_seconds: float  # until the first new token
    memory: dict | None  # ScissorhandsCache.memory_report(); None for the full cache
    cache: object | None = None  # the cache after generation (ScissorhandsCache or DynamicCache)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second, prefill included."""
        return self.new_tokens.numel() / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after the first, per second of decoding."""
        n = self.new_tokens.shape[1] - 1
        dt = self.seconds - self.prefill_seconds
        return self.new_tokens.shape[0] * n / dt if n > 0 and dt > 0 else float("nan")


def generate(
    model,
    tokenizer,
    prompts: str | list[str],
    config: ScissorhandsConfig | CachePlan | None,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = False,
    ignore_eos: bool = False,
    method: EvictionMethod | None = None,
    prompt_name: str = "prompt",
    protect=None,
    audit=None,
    protect_name: str = "protect",
) -> GenerationResult:
    """Generate from ``prompts`` with a budgeted cache (or the full cache if ``config`` is None).

    Parameters
    ----------
    model, tokenizer
        A causal LM and its tokenizer (left padding is used for batches).
    prompts : str or list of str
        One prompt or a batch.
    config : ScissorhandsConfig, CachePlan or None
        The budget, or the plan of the cache (:func:`scissorhands.hf.cache.cache_plan`, which holds the method
        and the protected spans); ``None`` runs transformers' ``DynamicCache`` for comparison.
    method : EvictionMethod, optional
        Another method's scoring rule (see :mod:`scissorhands.core.methods`); default Scissorhands.
    max_new_tokens : int
        Tokens to generate per prompt (generation also stops at EOS unless ``ignore_eos``).
    prompt_name : str
        The parameter the prompt came from, for error messages.
    protect : list of (start, end), or one list per prompt, optional
        Token spans never evicted (see :mod:`scissorhands.core.tokens.protect`); positions
        count each prompt's own tokens from 0, padding excluded.
    protect_name : str
        The parameter the spans came from, for error messages (a command line's ``protect-prefix``).
    audit : EvictionAudit, optional
        Records what the cache evicted (see :mod:`scissorhands.core.layer.audit`).

    Returns
    -------
    GenerationResult

    Raises
    ------
    ValueError
        A one-line message naming the parameter: an empty prompt, ``max_new_tokens < 1``,
        or a prompt plus ``max_new_tokens`` longer than the model's positions
        (``max_position_embeddings``); such runs are refused rather than run past the
        positions the model was trained on.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("prompt: is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max-new-tokens: must be >= 1, got {max_new_tokens}")
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    check_positions(model, enc["input_ids"].shape[1], max_new_tokens, prompt_name)
    cache: ScissorhandsCache | DynamicCache
    if config is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = ScissorhandsCache.build(model, config, method, protect=protect, audit=audit, protect_name=protect_name)
    torch.manual_seed(seed)
    kwargs: dict = {"do_sample": do_sample}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    streamer = _Clock(max_new_tokens, progress) if len(prompts) == 1 else None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, cache=cache, max_new_tokens=max_new_tokens, streamer=streamer,
                             pad_token_id=tokenizer.pad_token_id, **kwargs)
    seconds = time.perf_counter() - start
    new = out[:, enc["input_ids"].shape[1]:]
    return GenerationResult(
        texts=tokenizer.batch_decode(new, skip_special_tokens=True),
        new_tokens=new,
        prompt_tokens=enc["attention_mask"].sum(dim=1).tolist(),
        seconds=seconds,
        prefill_seconds=(streamer.first_token - start) if streamer and streamer.first_token else float("nan"),
        memory=cache.memory_report() if isinstance(cache, ScissorhandsCache) else None,
        cache=cache,
    )


def chat_prompt(tokenizer, system: str, user: str) -> tuple[str, int]:
    """The chat-templated text of a system and a user turn, and the number of tokens of the system turn.

    The system turn is the template rendered with the system message alone; it
    must be a token prefix of the whole conversation (true of the usual
    templates), so that ``protect=[(0, n)]`` pins exactly the system prompt.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("system: the model's tokenizer has no chat template")
    if not system.strip():
        raise ValueError("system: is empty")
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                         tokenize=False, add_generation_prompt=True)
    head = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    ids, head_ids = tokenizer(text)["input_ids"], tokenizer(head)["input_ids"]
    if not text.startswith(head) or ids[: len(head_ids)] != head_ids:
        raise ValueError("system: this chat template does not render the system prompt as a prefix of the "
                         "conversation, so it cannot be pinned")
    return text, len(head_ids)
