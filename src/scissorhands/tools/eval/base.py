"""What an evaluation task is: items to score, a score per item under a setup, and their aggregate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    """One unit of evaluation; ``length`` is the sequence length the budget fraction refers to."""

    key: str
    length: int
    data: dict = field(default_factory=dict)


class Task:
    name = "task"
    main_metric = "acc"

    def items(self, tokenizer, limit: int | None) -> list[Item]:
        raise NotImplementedError

    def score(self, model, item: Item, setup) -> dict:
        raise NotImplementedError

    def aggregate(self, scores: list[dict]) -> dict:
        raise NotImplementedError

    def take_full(self, items: list[Item], scores: list[dict]) -> None:
        """The exact full cache's scores of ``items``, already in the results file (a finished full cell, or the
        finished items of one cut off). A task that pairs every cell with the full cache inside :meth:`score`
        keeps what it needs of them instead of running the full cache again; by default nothing."""
