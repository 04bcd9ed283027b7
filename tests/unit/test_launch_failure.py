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
