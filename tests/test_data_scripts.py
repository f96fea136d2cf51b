"""Tests of scripts/make_parts.py, scripts/write_filelist.py and scripts/prepare_demo_data.py."""

import base64
import gzip
import hashlib
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from vae_trainer.data.dataset import ImageStream, build_eval_dataloader
from vae_trainer.data.filelists import LINES, Part, read_sources
from vae_trainer.data.records import iterate_records

REPO = Path(__file__).resolve().parents[1]


def read_part_lines(path):
    return list(iterate_records(Part(str(path), LINES)))


def _load_script(name):
    """Import scripts/<name>.py under its own name (the scripts import each other that way)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_parts = _load_script("make_parts")
write_filelist = _load_script("write_filelist")
prepare_demo_data = _load_script("prepare_demo_data")


@pytest.fixture
def image_dir(tmp_path):
    """Three readable images (one nested), one broken image file and one text file."""
    folder = tmp_path / "images"
    (folder / "nested").mkdir(parents=True)
    photo = Image.fromarray(skdata.astronaut()[::8, ::8])  # 64x64
    photo.save(folder / "b_astronaut.png")
    photo.convert("L").save(folder / "a_grey.jpg", quality=90)
    Image.fromarray(skdata.chelsea()[::6, ::6]).save(folder / "nested" / "cat.webp")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "readme.txt").write_text("hello")
    return folder


def test_make_parts_stores_original_bytes_and_skips_unreadable(image_dir, tmp_path):
    out = tmp_path / "parts"
    assert make_parts.main(["--image_dir", str(image_dir), "--output_dir", str(out), "--lines_per_part", "2"]) == 0
    parts = sorted(out.iterdir())
    assert [p.name for p in parts] == ["part-00000.gz", "part-00001.gz"]
    assert all(p.read_bytes()[:2] == b"\x1f\x8b" for p in parts)
    lines = [line for part in parts for line in read_part_lines(part)]
    fields = [line.split(b"\t") for line in lines]
    assert [f[0] for f in fields] == [b"a_grey", b"b_astronaut", b"cat"]  # sorted by relative path
    assert [f[1] for f in fields] == [b"a_grey.jpg", b"b_astronaut.png", b"nested/cat.webp"]
    originals = [image_dir / "a_grey.jpg", image_dir / "b_astronaut.png", image_dir / "nested" / "cat.webp"]
    assert [base64.b64decode(f[2]) for f in fields] == [p.read_bytes() for p in originals]


def test_make_parts_summary_and_plain_text(image_dir, tmp_path, capsys):
    out = tmp_path / "plain"
    make_parts.main(["--image_dir", str(image_dir), "--output_dir", str(out), "--lines_per_part", "5", "--no-gzip"])
    summary = capsys.readouterr().out
    assert "wrote 3 images into 1 part files" in summary and "skipped 2 unreadable files" in summary
    part = out / "part-00000.txt"
    assert part.read_bytes()[:2] != b"\x1f\x8b" and len(part.read_bytes().splitlines()) == 3


def test_write_filelist_relative_paths_and_weights(image_dir, tmp_path):
    parts_a, parts_b = tmp_path / "a", tmp_path / "b"
    make_parts.main(["--image_dir", str(image_dir), "--output_dir", str(parts_a), "--lines_per_part", "1"])
    make_parts.main(["--image_dir", str(image_dir / "nested"), "--output_dir", str(parts_b)])
    lists = tmp_path / "lists"
    write_filelist.main(["--parts_dir", str(parts_a), "--output", str(lists / "a.filelist")])
    write_filelist.main(["--parts_dir", str(parts_b), "--output", str(lists / "b.filelist")])
    assert (lists / "a.filelist").read_text().splitlines() == [f"../a/part-0000{i}.gz" for i in range(3)]
    counts = (lists / "a.filelist.counts").read_text().splitlines()[1:]
    sizes = [(parts_a / f"part-0000{i}.gz").stat().st_size for i in range(3)]
    assert counts == [f"../a/part-0000{i}.gz\t1\t{sizes[i]}" for i in range(3)]
    write_filelist.main(
        ["--filelists", str(lists / "a.filelist"), f"{lists / 'b.filelist'}:2.5", "--output", str(lists / "m.filelist.list")]
    )
    assert (lists / "m.filelist.list").read_text() == "a.filelist 1\nb.filelist 2.5\n"
    sources = read_sources(str(lists / "m.filelist.list"))
    assert [s.weight for s in sources] == [1.0, 2.5]
    assert [len(s.parts) for s in sources] == [3, 1]
    assert [[p.records for p in s.parts] for s in sources] == [[1, 1, 1], [1]]  # from the .counts files
    stream = ImageStream(str(lists / "m.filelist.list"), 32, infinite=False)
    assert len(list(iter(stream))) == 4 and stream.skip_stats() == {}


def test_count_an_existing_filelist_in_parallel_with_tars_and_damage(tmp_path, capsys):
    import tarfile

    make_parts.write_parts([make_parts.Record(f"c{i}", "-", b"x") for i in range(5)], str(tmp_path / "p"), 3)
    cut = tmp_path / "cut.gz"
    whole = gzip.compress(b"".join(b"line %d\n" % i for i in range(3000)))
    cut.write_bytes(whole[: len(whole) // 2])
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for name in ("a.jpg", "a.json", "b.png"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    filelist = tmp_path / "mixed.filelist"
    filelist.write_text(f"p/part-00000.gz\np/part-00001.gz\ncut.gz\ns.tar\npipe:cat {tmp_path / 's.tar'}\n")
    assert write_filelist.main(["--count", str(filelist), "--jobs", "2"]) == 0
    rows = [row.split("\t") for row in (tmp_path / "mixed.filelist.counts").read_text().splitlines()[1:]]
    assert [row[:2] for row in rows[:2]] == [["p/part-00000.gz", "3"], ["p/part-00001.gz", "2"]]
    assert rows[2][0] == "cut.gz" and 100 < int(rows[2][1]) < 3000  # the readable lines
    assert rows[3] == ["s.tar", "2", str((tmp_path / "s.tar").stat().st_size)]
    assert rows[4] == [f"pipe:cat {tmp_path / 's.tar'}", "2", "-"]
    assert "damaged: " in capsys.readouterr().out
    (source,) = read_sources(str(filelist))
    assert [p.records for p in source.parts] == [3, 2, int(rows[2][1]), 2, 2]


def test_parse_weighted():
    assert write_filelist.parse_weighted("x/y.filelist:3") == ("x/y.filelist", 3.0)
    assert write_filelist.parse_weighted("C:/x.filelist") == ("C:/x.filelist", 1.0)
    with pytest.raises(ValueError):
        write_filelist.parse_weighted("x.filelist:0")


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.md5(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_prepare_demo_data_matches_committed_filelists_and_is_deterministic(tmp_path):
    root = tmp_path / "data"
    args = ["--output_dir", str(root / "demo"), "--filelist_dir", str(root / "filelist")]
    assert prepare_demo_data.main(args) == 0
    first = _digests(root)
    for name in ("demo.filelist.list", "demo_train.filelist", "demo_eval.filelist"):
        assert (root / "filelist" / name).read_text() == (REPO / "data" / "filelist" / name).read_text()
    assert read_sources(str(root / "filelist" / "demo.filelist.list"))[0].counted  # a .counts file was written
    prepare_demo_data.main(args)
    assert _digests(root) == first  # idempotent and deterministic
    train_lines = [line for p in sorted((root / "demo" / "train").iterdir()) for line in read_part_lines(p)]
    assert len(train_lines) == 800
    held_out = {line.split(b"\t")[0].split()[0] for p in (root / "demo" / "eval").iterdir() for line in read_part_lines(p)}
    trained = {line.split(b"\t")[0].split()[0] for line in train_lines}
    assert len(held_out) == 2 and not held_out & trained and len(trained) >= 6
    sizes = {Image.open(io.BytesIO(base64.b64decode(line.split(b"\t")[2]))).size[0] for line in train_lines[:50]}
    assert min(sizes) >= 96 and max(sizes) <= 160 and len(sizes) > 10
    stream = ImageStream(str(root / "filelist" / "demo.filelist.list"), 64, seed=0)
    batch = np.concatenate([sample["pixel_values"] for _, sample in zip(range(8), stream)])
    assert batch.shape == (8, 3, 64, 64) and batch.std() > 0.1
    paths = prepare_demo_data.photo_paths()
    eval_sizes = [Image.open(paths[name]).size for name in prepare_demo_data.split_photos(sorted(paths))[1]]
    tiles = sum((width // 128) * (height // 128) for width, height in eval_sizes)
    evaluation = build_eval_dataloader(str(root / "filelist" / "demo_eval.filelist"), 64, 8, 0, 1, None)
    assert sum(b["pixel_values"].shape[0] for b in evaluation) == tiles >= 16


def test_gzip_parts_have_no_timestamp(tmp_path):
    records = [make_parts.Record("c", "-", b"\x00\x01")]
    first = make_parts.write_parts(records, str(tmp_path / "x"), 1)[0].read_bytes()
    assert first[4:8] == b"\x00\x00\x00\x00"  # gzip MTIME field
    assert gzip.decompress(first) == b"c\t-\t" + base64.b64encode(b"\x00\x01") + b"\n"
