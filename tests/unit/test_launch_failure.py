"""What the launcher says of a failed worker, whatever form torchrun's record of it takes."""

from rlcore.distributed.launch import failure_detail


def test_a_failed_workers_record_is_text_or_the_error_files_mapping():
    assert failure_detail("RewardError: reward 'x' raised") == "RewardError: reward 'x' raised"
    # the error file's record, as torchrun reads it back for a rank that wrote one
    record = {"message": "RuntimeError: Connection closed by peer", "extraInfo": {"py_callstack": "..."}}
    assert failure_detail(record) == "RuntimeError: Connection closed by peer"
    assert failure_detail({"extraInfo": {}}) == ""
    assert failure_detail("To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html") == ""
    assert failure_detail(None) == ""


def _failure(tmp_path, rank: int, exitcode: int, message: str = "", timestamp: int = 100):
    """torchrun's record of a failed worker; ``message`` as its error file would give it."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error-{rank}.json"
    if message:
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(timestamp)}}}))
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))
    failure.timestamp = timestamp
    return failure


def test_the_rank_that_died_is_blamed_not_the_one_that_lost_it(tmp_path):
    from rlcore.distributed.launch import failure_report

    # rank 0 noticed first (an earlier timestamp) that its peer was gone; rank 1 was killed
    lost = _failure(tmp_path, 0, 1, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", timestamp=99)
    killed = _failure(tmp_path, 1, -9)
    text = failure_report({0: lost, 1: killed})
    assert text.startswith("distributed training failed: rank 1 exited with signal 9 (SIGKILL)"), text
    assert "after it: rank 0 (code 1)" in text
    # a rank that raised its own error, beside one that only lost it (the same second)
    own = _failure(tmp_path, 1, 2, "RewardError: reward 'x' raised", timestamp=100)
    lost = _failure(tmp_path, 0, 1, "BridgeError: waiting for rollout rank 0 failed", timestamp=100)
    assert failure_report({0: lost, 1: own}).startswith("distributed training failed: rank 1 exited with code 2: "
                                                        "RewardError: reward 'x' raised")
    # a rank the launcher stopped (SIGTERM, once another failed) is not the cause, even in the same second
    stopped = _failure(tmp_path, 0, -15, timestamp=100)
    failed = _failure(tmp_path, 1, 2, timestamp=100)
    assert failure_report({0: stopped, 1: failed}).startswith("distributed training failed: rank 1 exited with code 2")
    # nothing to tell them apart: the earliest, then the lowest rank
    a, b = _failure(tmp_path, 0, 1, timestamp=101), _failure(tmp_path, 1, 1, timestamp=100)
    assert "rank 1 exited" in failure_report({0: a, 1: b})


def test_the_launcher_raises_the_report_of_the_rank_that_died(tmp_path, monkeypatch):
    import pytest
    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from rlcore.distributed import launch
    from rlcore.errors import RLCoreError

    failures = {0: _failure(tmp_path, 0, 1, "RuntimeError: Connection closed by peer", timestamp=99),
                1: _failure(tmp_path, 1, -9)}

    def run(args):
        raise ChildFailedError("rlcore", failures)

    monkeypatch.setattr(trun, "run", run)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RLCoreError, match=r"rank 1 exited with signal 9 \(SIGKILL\)"):
        launch.maybe_launch(2, ["trainer.max_steps=1"])
