"""The transformers side of the vLLM comparisons, run in the project's own environment (transformers >= 5.20).

Reads a JSON request (model folder, method, budget, settings, prompt, the tokens vLLM generated), feeds the
prompt and then the tokens one at a time through ``ScissorhandsCache`` at the same settings the plugin runs
with, and writes the log-probability of each token, the greedy choice at each step and, per budgeted layer and
KV head, the positions still stored once the engine's last step is done (the last token is sampled, never fed).

    python tests/on_vllm/reference.py request.json answer.json
    python tests/on_vllm/reference.py --serve      # one request per stdin line (JSON [request, answer]), "ok" back

The tests keep one serving process for the session (``conftest.reference``): torch and transformers are imported
once, not once per comparison.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from scissorhands import ScissorhandsCache, get_method
from scissorhands.vllm.settings import parse


def main(request_path: str, answer_path: str) -> None:
    req = json.loads(open(request_path).read())
    model = AutoModelForCausalLM.from_pretrained(req["folder"], dtype=torch.float32)
    settings = parse(req["plugin"])  # the plugin's own resolution: the same config the engine ran with
    answers = []
    for prompt, tokens, spans in zip(req["prompts"], req["tokens"], req.get("spans") or [[]] * len(req["prompts"])):
        protect = ([(0, settings.protect_prefix)] if settings.protect_prefix else []) + [tuple(s) for s in spans]
        cache = ScissorhandsCache(model, settings.config, get_method(settings.method.name)(), protect=protect or None)
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = [model(ids[:, : len(prompt)], cache=cache).logits[0, -1]]
            for t in range(len(prompt), len(prompt) + len(tokens) - 1):  # vLLM never feeds its last token
                logits.append(model(ids[:, t : t + 1], cache=cache).logits[0, -1])
        answers.append({
            "logprobs": [float(torch.log_softmax(x.float(), -1)[tok]) for x, tok in zip(logits, tokens)],
            "greedy": [int(x.argmax()) for x in logits[: len(tokens)]],
            "kept": [layer.stored_positions(0).sort(dim=-1).values.tolist() for layer in cache.budgeted_layers],
            "config": settings.config.as_dict() | {"budget": settings.config.budget},
        })
    with open(answer_path, "w") as f:
        json.dump(answers, f)


def serve() -> None:
    """Answer requests until stdin closes: each line ``[request, answer]`` (JSON), each reply ``ok`` or ``error: ...``
    on one line."""
    for line in sys.stdin:
        request_path, answer_path = json.loads(line)
        try:
            main(request_path, answer_path)
        except Exception as e:  # the test that asked fails with it; the next request is answered as usual
            print(f"error: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        else:
            print("ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
