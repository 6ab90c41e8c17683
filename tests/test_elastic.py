"""The restart policy both launchers share (a real worker crash is in test_checkpoint_resume)."""
from pathlib import Path

import pytest

from ms_llm.config.job import job_from_dict
from ms_llm.elastic import check_restarts, with_restarts
from ms_llm.errors import ConfigError
from ms_llm.run import RunFolder


def launches(codes: list[int]):
    calls = []

    def start() -> int:
        calls.append(len(calls))
        return codes[len(calls) - 1]
    return start, calls


@pytest.mark.parametrize("codes,max_restarts,rc,starts", [
    ([0], 3, 0, 1),                  # success: never restarted
    ([1, 0], 3, 0, 2),               # one crash, recovered
    ([1, 1, 1], 2, 1, 3),            # gives up after max_restarts, with the last status
    ([7], 0, 7, 1),                  # off by default
])
def test_restarts_until_success_or_the_limit(tmp_path, capsys, codes, max_restarts, rc, starts):
    start, calls = launches(codes)
    assert with_restarts(start, max_restarts, RunFolder(Path(tmp_path))) == rc
    assert len(calls) == starts
    assert capsys.readouterr().err.count("restart ") == starts - 1


def test_restarts_need_checkpoints():
    job = job_from_dict({"name": "j", "model": "tiny", "train": {"checkpoint": {"interval": 0}}})
    with pytest.raises(ConfigError, match="train.checkpoint.interval"):
        check_restarts(job, 1)
    with pytest.raises(ConfigError, match="--max-restarts: got -1"):
        check_restarts(job, -1)
    check_restarts(job, 0)
    check_restarts(job_from_dict({"name": "j", "model": "tiny", "train": {"checkpoint": {"interval": "auto"}}}), 2)
