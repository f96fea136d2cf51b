"""Tests of vae_trainer.data.filelists: parsing, path resolution, weights, folders, tar specs, counts, errors."""

import os

import pytest

from vae_trainer.data.filelists import IMAGE, LINES, TAR, is_filelist_list, read_sources


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x\t-\tAAAA\n")
    return path


def paths(source):
    return [part.path for part in source.parts]


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
    assert sources[0].name == str(root / "a" / "a.filelist")
    assert paths(sources[0]) == [str(p) for p in parts_a]
    assert paths(sources[1]) == [str(part_b)]
    assert {part.kind for s in sources for part in s.parts} == {LINES}
    assert not any(s.counted for s in sources)  # no .counts files


def test_single_filelist_is_one_source_of_weight_one(tree):
    root, parts_a, _ = tree
    sources = read_sources(str(root / "a" / "a.filelist"))
    assert len(sources) == 1 and sources[0].weight == 1.0
    assert paths(sources[0]) == [str(p) for p in parts_a]


def test_detection_by_content_for_other_names(tree):
    root, _, _ = tree
    as_list = root / "lists" / "weighted.txt"
    as_list.write_text("../a/a.filelist 3\n")
    as_filelist = root / "a" / "plain.txt"
    as_filelist.write_text("parts/p0\n")
    assert is_filelist_list(str(as_list)) and not is_filelist_list(str(as_filelist))
    assert read_sources(str(as_list))[0].weight == 3.0
    assert paths(read_sources(str(as_filelist))[0]) == [str(root / "a" / "parts" / "p0")]


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


def test_folder_source_recursive_sorted_images_only(tmp_path):
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for name in ("b.jpg", "a.PNG", "sub/c.webp", ".hidden.jpg", "notes.txt"):
        (folder / name).write_bytes(b"x")
    listing = tmp_path / "mix.filelist.list"
    listing.write_text("photos 2\n")
    for sources in (read_sources(str(folder)), read_sources(str(listing))):
        (source,) = sources
        assert paths(source) == [str(folder / n) for n in ("a.PNG", "b.jpg", "sub/c.webp")]
        assert {p.kind for p in source.parts} == {IMAGE} and source.counted
    assert read_sources(str(listing))[0].weight == 2.0
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no image files"):
        read_sources(str(tmp_path / "empty"))


def test_tar_specs_brace_patterns_and_pipes(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        _touch(shards / f"{i:05d}.tar")
    (source,) = read_sources(str(shards / "{00000..00002}.tar"))
    assert paths(source) == [str(shards / f"{i:05d}.tar") for i in range(3)]
    assert {p.kind for p in source.parts} == {TAR} and not source.counted
    with pytest.raises(FileNotFoundError, match="00003.tar.*--file_list"):
        read_sources(str(shards / "{00000..00003}.tar"))
    (pipe,) = read_sources("pipe:cat /nowhere/{0,1}.tar")  # commands are not run (or checked) here
    assert paths(pipe) == ["pipe:cat /nowhere/0.tar", "pipe:cat /nowhere/1.tar"]
    # In a .filelist a line may be a pipe command with spaces, or a brace pattern.
    filelist = tmp_path / "tars.filelist"
    filelist.write_text("shards/{00000..00001}.tar\npipe:curl -s http://host/x.tar\nshards/00002.tar\n")
    assert paths(read_sources(str(filelist))[0]) == [
        str(shards / "00000.tar"), str(shards / "00001.tar"), "pipe:curl -s http://host/x.tar", str(shards / "00002.tar")]
    listing = tmp_path / "all.filelist.list"
    listing.write_text("shards/{00000..00001}.tar 3\ntars.filelist\n")
    sources = read_sources(str(listing))
    assert [s.weight for s in sources] == [3.0, 1.0] and len(sources[0].parts) == 2


def test_counts_file_gives_record_counts_and_stale_counts_are_dropped(tmp_path, caplog):
    for name, size in (("p0", 10), ("p1", 20)):
        (tmp_path / name).write_bytes(b"x" * size)
    filelist = tmp_path / "x.filelist"
    filelist.write_text("p0\np1\n")
    counts = tmp_path / "x.filelist.counts"
    counts.write_text("# records per part\np0\t7\t10\np1\t3\t20\n")
    (source,) = read_sources(str(filelist))
    assert [p.records for p in source.parts] == [7, 3] and source.counted
    (tmp_path / "p1").write_bytes(b"x" * 21)  # rewritten after counting
    with caplog.at_level("WARNING", logger="vae_trainer.data"):
        (source,) = read_sources(str(filelist))
    assert not source.counted and "has 21 bytes, not 20" in caplog.text
    counts.write_text("p0\t7\t10\n")  # p1 missing
    assert not read_sources(str(filelist))[0].counted
    counts.write_text("p0\tseven\t10\n")
    with pytest.raises(ValueError, match="x.filelist.counts:1"):
        read_sources(str(filelist))
