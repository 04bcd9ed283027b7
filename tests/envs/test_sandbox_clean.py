"""Removing a run's working directory never raises, whatever the code left there."""

import os

import pytest

from rlcore.envs.sandbox_clean import remove_tree


@pytest.mark.slow
def test_a_tree_deeper_than_recursion_and_path_length_is_removed(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for _ in range(2100):  # past the recursion limit of a recursive removal and past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("file", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    assert remove_tree(str(root)) is True
    assert not root.exists()


def test_links_are_removed_not_followed_and_unreadable_directories_are_opened(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("kept")
    root = tmp_path / "run"
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_text("x")
    os.symlink(outside, root / "link")
    os.chmod(root / "locked", 0)
    assert remove_tree(str(root)) is True
    assert (outside / "kept.txt").read_text() == "kept"


def test_what_cannot_be_removed_is_reported_not_raised(tmp_path, caplog):
    assert remove_tree(str(tmp_path / "missing")) is True  # nothing there: nothing left
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert remove_tree(str(not_a_dir)) is False
    assert "could not remove" in caplog.text
