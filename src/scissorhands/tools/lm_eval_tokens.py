"""How the lm-eval backend turns requests into token ids, following lm-eval's Hugging Face backend.

Kept apart from the model type (:mod:`.lm_eval_backend`) so that each is small:
this is text -> ids, that is ids -> scores under the compressed cache.
"""

from __future__ import annotations

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


class RequestTokens:
    """Tokenisation of lm-eval requests (``--model hf`` conventions), for one tokenizer and context length.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
    max_length : int
        Longest sequence given to the model.
    prefix_token_id : int
        Token that conditions an empty context and the first rolling window.
    """

    def __init__(self, tokenizer, max_length: int, prefix_token_id: int):
        self.tokenizer = tokenizer
        self._max_length = max_length
        self._prefix_token_id = prefix_token_id
        bos = tokenizer.bos_token
        self._bos_text = bos if isinstance(bos, str) and bos else None

    def encode(self, text: str, special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        ``special_tokens=None`` uses the tokenizer's default (BOS added if the
        tokenizer adds one), except for a text already starting with the BOS
        string, which is encoded as is.
        """
        kwargs = {}
        if special_tokens is not None:
            kwargs["add_special_tokens"] = special_tokens
        elif self._bos_text is not None and text.startswith(self._bos_text):
            kwargs["add_special_tokens"] = False
        return list(self.tokenizer.encode(text, **kwargs))

    def split_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation token ids of one loglikelihood request.

        Whitespace at the end of the context belongs to the continuation (so
        " Paris" stays one word token); the two are encoded as one string and
        cut where the context's own encoding ends, so the continuation's
        tokens are those the model would really see. An empty context becomes
        the prefix token (unless the continuation starts with it). The
        sequence is cut from the left to ``max_length + 1`` tokens.

        Returns
        -------
        context_ids : list of int, non-empty
        continuation_ids : list of int, non-empty
        """
        trimmed = context.rstrip()
        if trimmed:
            moved = context[len(trimmed):]
            continuation = moved + continuation
            whole = self.encode(trimmed + continuation)
            ctx = self.encode(trimmed)
            cont = whole[len(ctx):]
        else:
            cont = self.encode(context + continuation, special_tokens=False)
            if cont and cont[0] == self._prefix_token_id:
                ctx, cont = cont[:1], cont[1:]
            else:
                ctx = [self._prefix_token_id]
        if not cont:
            raise ValueError(f"continuation: {continuation!r} encodes to no token after its context")
        if len(cont) > self._max_length:
            raise ValueError(f"continuation: {len(cont)} tokens, longer than max_length ({self._max_length})")
        keep = self._max_length + 1 - len(cont)
        if len(ctx) > keep:
            ctx = ctx[-keep:]
        return ctx, cont

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """lm-eval's disjoint rolling windows of ``text``: (conditioning ids, predicted ids) pairs.

        The first window is conditioned on the prefix token alone; each later
        one predicts up to ``max_length`` new tokens from the tokens before them
        (``max_length`` tokens of input in all).
        """
        ids = self.encode(text)
        windows = get_rolling_token_windows(token_list=ids, prefix_token=self._prefix_token_id,
                                            max_seq_len=self._max_length, context_len=1)
        return [make_disjoint_window(w) for w in windows]

    def stop_strings(self, until) -> list[str]:
        if until is None:
            until = []
        elif isinstance(until, str):
            until = [until]
        elif not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
            raise ValueError(f"until: must be a string or a list of strings, got {until!r}")
        stops = [s for s in until if s]
        if self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.decode([self.tokenizer.eos_token_id])
            if eos and eos not in stops:
                stops.append(eos)
        return stops

