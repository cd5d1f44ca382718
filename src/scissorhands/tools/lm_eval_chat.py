"""How the lm-eval backend writes a conversation: the tokenizer's chat template, as lm-eval's ``hf`` model applies it.

lm-eval asks a model type for its chat template when it is run with
``--apply_chat_template``; :class:`.lm_eval_backend.ScissorhandsLM` answers
with these two functions, kept apart so that the model type stays small.
"""

from __future__ import annotations

__all__ = ["apply_chat_template", "chat_template"]


def chat_template(tokenizer, which: bool | str = False) -> str | None:
    """The tokenizer's chat template when lm-eval is asked to apply one.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer.
    which : bool or str
        lm-eval's ``chat_template`` argument: ``True``, or a template's name where the tokenizer has several;
        ``False`` (or None) when no template is to be applied.

    Returns
    -------
    str or None
        The template, or None when none is asked for.

    Raises
    ------
    ValueError
        One line naming ``apply_chat_template`` when the tokenizer has no such template.
    """
    if which is False or which is None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("apply_chat_template: the model's tokenizer has no chat template")
    if isinstance(template, dict):
        name = which if isinstance(which, str) else "default"
        if name not in template:
            raise ValueError(f"apply_chat_template: no template {name!r} in the tokenizer's "
                             f"{', '.join(sorted(template))}")
        return template[name]
    return template


def apply_chat_template(tokenizer, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation as the tokenizer's chat template writes it, as lm-eval's ``hf`` model writes it: an
    assistant turn opened (``add_generation_prompt``) or the last one continued; a template that refuses a
    system turn gets the conversation without it."""
    import jinja2

    chat_template(tokenizer, True)  # one line if the tokenizer has none

    def render(turns):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    try:
        return render(chat_history)
    except jinja2.exceptions.TemplateError:
        return render([turn for turn in chat_history if turn["role"] != "system"])
