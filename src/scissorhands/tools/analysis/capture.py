"""Attention probabilities and per-layer outputs of a model, without touching its forward.

Probabilities come from an eager-attention copy of the model with
``output_attentions=True``; the caller's model is never switched. Layer
outputs are captured with forward hooks on the attention modules.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM

from scissorhands.hf.modelinfo import model_facts


def eager_copy(model):
    """A copy of ``model`` that computes eager attention (so it can return probabilities)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin.eval()


def random_copy(model, seed: int = 0):
    """The same architecture, randomly re-initialised under ``seed``, with eager attention.

    The global RNG is left as it was.
    """
    config = copy.deepcopy(model.config)  # from_config would otherwise edit the caller's config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return twin.to(dtype=next(model.parameters()).dtype).eval()


def layer_windows(model) -> list[int | None]:
    """Per layer: its sliding window, or None for full attention.  Length n_layers."""
    return model_facts(model).sliding_windows


def full_attention_layers(model) -> list[int]:
    """Indices of the layers a :class:`~scissorhands.ScissorhandsCache` puts a budget on."""
    return model_facts(model).full_layers


@torch.no_grad()
def attention_maps(eager_model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Attention probabilities of every layer for one sequence.

    Parameters
    ----------
    eager_model : PreTrainedModel
        A model running eager attention (see :func:`eager_copy`).
    ids : LongTensor, shape (T,) or (1, T)

    Returns
    -------
    list of Tensor, one per layer, each shape (H_q, T, T), float32
        One map per query head (grouped-query heads are not merged).
    """
    ids = ids.reshape(1, -1).to(eager_model.device)  # (1, T)
    out = eager_model(ids, output_attentions=True, use_cache=False, logits_to_keep=1)
    if out.attentions is None or any(a is None for a in out.attentions):
        raise ValueError("model: attention probabilities unavailable (needs eager attention)")
    return [a[0].float() for a in out.attentions]


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of each decoder layer, in order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"model: cannot find the attention modules of {type(model).__name__}")
    return [layer.self_attn for layer in layers]


@contextmanager
def capture_attention_outputs(model):
    """Record each layer's attention output during the forwards inside the block.

    Yields
    ------
    list of list of Tensor
        ``outputs[layer]`` gets one tensor of shape (B, T, hidden) per forward.
    """
    modules = attention_modules(model)
    outputs: list[list[torch.Tensor]] = [[] for _ in modules]

    def hook_for(i):
        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            outputs[i].append(hidden.detach().float())
        return hook

    handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(modules)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()
