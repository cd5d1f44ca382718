"""From settings and a model to one plan per layer: the assembly, and the store and budget for a memory target."""
