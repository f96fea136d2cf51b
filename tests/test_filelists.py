"""Tests of vae_trainer.data.filelists: parsing, path resolution, weights and error messages."""

import os

import pytest

from vae_trainer.data.filelists import is_filelist_list, read_sources


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x\t-\tAAAA\n")
    return path


@pytest.fixture
def tree(tmp_path):
    """lists/main.filelist.list -> ../a/a.filelist (2 parts), /abs/b.filelist (1 part, absolute path)."""
    parts_a = [_touch(tmp_path / "a" / "parts" / f"p{i}") for i in range(2)]
    (tmp_path / "a" / "a.filelist").write_text("# parts of a\nparts/p0\n\n  parts/p1  \n")
    part_b = _touch(tmp_path / "b" / "q.gz")
    (tmp_path / "b" / "b.filelist").write_text(f"{part_b}\n")
    lists = tmp_path / "lists"
    lists.mkdir()
    return tmp_path, parts_a, part_b


def test_list_with_weights_comments_and_relative_paths(tree):
    root, parts_a, part_b = tree
    listing = root / "lists" / "main.filelist.list"
    listing.write_text(f"# comment\n\n../a/a.filelist\n{root / 'b' / 'b.filelist'} 2.5\n")
    sources = read_sources(str(listing))
    assert [s.weight for s in sources] == [1.0, 2.5]
    assert sources[0].filelist == str(root / "a" / "a.filelist")
    assert sources[0].parts == [str(p) for p in parts_a]
    assert sources[1].parts == [str(part_b)]


def test_single_filelist_is_one_source_of_weight_one(tree):
    root, parts_a, _ = tree
    sources = read_sources(str(root / "a" / "a.filelist"))
    assert len(sources) == 1 and sources[0].weight == 1.0
    assert sources[0].parts == [str(p) for p in parts_a]


def test_detection_by_content_for_other_names(tree):
    root, _, _ = tree
    as_list = root / "lists" / "weighted.txt"
    as_list.write_text("../a/a.filelist 3\n")
    as_filelist = root / "a" / "plain.txt"
    as_filelist.write_text("parts/p0\n")
    assert is_filelist_list(str(as_list)) and not is_filelist_list(str(as_filelist))
    assert read_sources(str(as_list))[0].weight == 3.0
    assert read_sources(str(as_filelist))[0].parts == [str(root / "a" / "parts" / "p0")]


def test_missing_filelist_names_path_and_line(tree):
    root, _, _ = tree
    listing = root / "lists" / "main.filelist.list"
    listing.write_text("../a/a.filelist\n# two\n../nope.filelist 2\n")
    with pytest.raises(FileNotFoundError) as error:
        read_sources(str(listing))
    message = str(error.value)
    assert os.path.normpath(root / "nope.filelist") in message and f"{listing}:3" in message


def test_missing_part_names_path_and_line(tree):
    root, _, _ = tree
    (root / "a" / "a.filelist").write_text("parts/p0\nparts/gone.gz\n")
    with pytest.raises(FileNotFoundError) as error:
        read_sources(str(root / "a" / "a.filelist"))
    assert str(root / "a" / "parts" / "gone.gz") in str(error.value)
    assert f"{root / 'a' / 'a.filelist'}:2" in str(error.value)


@pytest.mark.parametrize("weight", ["0", "-1", "abc", "nan", "inf"])
def test_bad_weight_is_value_error_with_line(tree, weight):
    root, _, _ = tree
    listing = root / "lists" / "main.filelist.list"
    listing.write_text(f"../a/a.filelist 1\n../a/a.filelist {weight}\n")
    with pytest.raises(ValueError, match=f"{listing}:2"):
        read_sources(str(listing))


def test_too_many_fields_is_value_error(tree):
    root, _, _ = tree
    listing = root / "lists" / "main.filelist.list"
    listing.write_text("../a/a.filelist 1 2\n")
    with pytest.raises(ValueError, match=f"{listing}:1"):
        read_sources(str(listing))


def test_missing_top_level_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.filelist.list"):
        read_sources(str(tmp_path / "absent.filelist.list"))
