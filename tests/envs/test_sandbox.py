"""The Python tool's sandbox against hostile code: every run ends, nothing escapes, output is bounded."""

import os

import pytest

from rlcore.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_output_bytes=512)


def run(code, limits=LIMITS):
    return run_python(code, limits)


def test_plain_code_runs_and_prints():
    result = run("print(sum(range(10)))")
    assert result.ok and result.output.strip() == "45"


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(60)"])
def test_endless_code_is_stopped(code):
    result = run(code)
    assert not result.ok
    assert result.timed_out  # wall clock, or the CPU limit
    assert result.seconds < 10


def test_fork_bomb_is_refused():
    result = run("import os\nwhile True:\n    os.fork()")
    assert not result.ok and "os.fork is not allowed" in result.output


def test_process_start_is_refused():
    result = run("import subprocess\nprint(subprocess.run(['ls', '/'], capture_output=True))")
    assert not result.ok and "not allowed" in result.output


def test_huge_allocation_fails_inside_the_sandbox():
    result = run("x = bytearray(8 * 1024 ** 3)\nprint('allocated')")
    assert not result.ok and "MemoryError" in result.output and "allocated" not in result.output


def test_writes_outside_the_directory_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('x')")
    assert not result.ok and "writing outside" in result.output
    assert not target.exists()
    result = run(f"import os\nos.remove({str(tmp_path)!r})")
    assert "not allowed" in result.output and tmp_path.exists()


def test_writes_inside_the_directory_work():
    result = run("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())")
    assert result.ok and result.output.strip() == "kept"


def test_sockets_are_refused():
    result = run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))")
    assert not result.ok and "socket" in result.output and "not allowed" in result.output


def test_the_environment_can_be_changed_inside():
    result = run("import os\nos.environ['SEEN'] = 'yes'\nprint(os.environ.pop('SEEN'), 'SEEN' in os.environ)")
    assert result.ok and result.output.strip() == "yes False"


def test_secrets_of_the_environment_do_not_reach_the_code(monkeypatch):
    monkeypatch.setenv("RLCORE_TEST_SECRET", "hunter2")
    assert os.environ["RLCORE_TEST_SECRET"] == "hunter2"
    result = run("import os\nprint(dict(os.environ))")
    assert result.ok and "hunter2" not in result.output and "RLCORE_TEST_SECRET" not in result.output
    result = run("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())")
    assert "hunter2" not in result.output and "not allowed" in result.output


def test_output_is_truncated():
    result = run("print('x' * 10 ** 6)")
    assert result.truncated and len(result.output) <= LIMITS.max_output_bytes + 16 and "[...]" in result.output
    assert result.describe().endswith("[output truncated]")


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)


def test_a_cancelled_run_is_stopped_long_before_its_timeout():
    """The episode that asked for the run ended: the sandbox is killed then, not at its own timeout."""
    import threading
    import time

    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    start = time.perf_counter()
    result = run_python("print('started', flush=True)\nwhile True:\n    pass\n",
                        SandboxLimits(timeout_s=30, cpu_s=30), cancel=cancel)
    assert time.perf_counter() - start < 10
    assert result.cancelled and result.timed_out and not result.ok
    assert "started" in result.output and "episode ended" in result.describe()
