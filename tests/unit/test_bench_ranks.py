"""benchmarks.ranks.read_rank_results: the one reader of the ranks' rank{w}.json results."""
import json

import pytest

from benchmarks.ranks import read_rank_results
from dosa.errors import DosaError


def _write(d, w, res):
    (d / f"rank{w}.json").write_text(json.dumps(res))


def test_results_in_rank_order(tmp_path):
    _write(tmp_path, 1, {"rank": 1})
    _write(tmp_path, 0, {"rank": 0})
    assert read_rank_results(tmp_path, 2, "xdp path", tmp_path / "logs") == [{"rank": 0}, {"rank": 1}]


def test_a_missing_rank_or_an_error_names_the_run(tmp_path):
    _write(tmp_path, 0, {"rank": 0})
    with pytest.raises(DosaError, match=r"^xdp path: host 1 wrote no result \(logs in .*logs\)$"):
        read_rank_results(tmp_path, 2, "xdp path", tmp_path / "logs")
    _write(tmp_path, 1, {"rank": 1, "error": "boom"})
    with pytest.raises(DosaError, match=r"^xdp path failed: boom$"):
        read_rank_results(tmp_path, 2, "xdp path", tmp_path / "logs")


def test_without_a_name_missing_ranks_are_left_out_and_errors_kept(tmp_path):
    _write(tmp_path, 1, {"rank": 1, "error": "killed"})
    assert read_rank_results(tmp_path, 3) == [{"rank": 1, "error": "killed"}]
