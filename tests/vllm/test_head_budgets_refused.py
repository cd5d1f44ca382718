"""Head-level budgets are the transformers cache's alone: the plugin's parser refuses them in one line (a vLLM
layer's blocks hold every KV head, so a layer's heads share one window)."""

import pytest

from scissorhands.vllm.settings import parse


def test_head_budgets_are_refused_by_the_plugin_in_one_line(tmp_path):
    ranking = tmp_path / "heads.json"
    ranking.write_text("{}")
    with pytest.raises(ValueError, match=r"^head_budgets: not supported by the vLLM adapter \(a vLLM layer.s "
                                         r"blocks hold every KV head"):
        parse({"method": "scissorhands", "budget": 64, "head_budgets": str(ranking)})
    with pytest.raises(ValueError, match=r"^retrieval_share: "):
        parse({"method": "scissorhands", "budget": 64, "retrieval_share": 0.5})
    assert parse({"method": "scissorhands", "budget": 64}).budget == 64  # without them it runs
