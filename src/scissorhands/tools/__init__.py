"""The tools built on the library: the command line, evaluation, analysis, bench, model loading, the lm-eval backend.

Nothing in :mod:`scissorhands.core` or an adapter imports from here. Their
extra dependencies (gguf, accelerate, matplotlib, tqdm, numpy) are the
``cli`` extra: ``pip install "scissorhands[cli]"``.
"""
