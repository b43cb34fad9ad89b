"""Rows with images: every format that can carry them, the `<image>` placeholder rule, a hostile corpus of bad
images (each reported with its line and reason while the good rows are kept), and images decoded only on demand.
Every image is drawn with PIL at test time."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_support import save_to_disk

from verl.data import index_dataset, index_rows, load_rows, normalize_files
from verl.data.fields import RowError, RowNormalizer
from verl.data.images import PLACEHOLDER, load_images, split_placeholders, to_content_parts
from verl.errors import DataError, VerlError

Image = pytest.importorskip("PIL.Image")


def png(path: Path, size: tuple[int, int] = (8, 8), color: tuple[int, ...] = (200, 30, 30), mode: str = "RGB") -> Path:
    Image.new(mode, size, color if mode != "L" else color[0]).save(path, "PNG")
    return path


def png_bytes(size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (10, 200, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height with no pixel data behind it (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("file", "line")} for r in rows]


# ------------------------------------------------------------------ good rows, every format


def test_paths_resolve_against_the_data_files_folder_in_every_text_format(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    png(data / "img" / "a.png")
    absolute = str(png(tmp_path / "b.png"))
    rows = [{"prompt": "<image>What colour?", "images": ["img/a.png"], "answer": "red"},
            {"prompt": "Compare <image> and <image>", "images": ["img/a.png", absolute], "answer": "same"},
            {"prompt": "One image, no list", "images": "img/a.png", "answer": "red"}]
    want = [str(data / "img" / "a.png"), [str(data / "img" / "a.png"), absolute], str(data / "img" / "a.png")]
    jsonl(data / "t.jsonl", rows)
    (data / "t.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist([{**r, "images": [r["images"]] if isinstance(r["images"], str) else r["images"]}
                                         for r in rows]), data / "t.parquet")  # a column has one type
    (data / "t.csv").write_text('prompt,images,answer\n"<image>What colour?",img/a.png,red\n'
                                f'"<image> or <image>","[""img/a.png"", ""{absolute}""]",red\n')
    for name in ("t.jsonl", "t.json", "t.parquet"):
        got, report = load_rows(str(data / name), "prompt")  # from another working directory than the data's
        assert report.is_clean and report.field_mapping["images"] == {"images": 3}, name
        assert [r["images"] for r in got] == [[want[0]], want[1], [want[2]]], name
        assert got[2]["prompt"] == "<image>One image, no list"  # none written: they go first
        assert "images" not in got[0]["metadata"]
    got, report = load_rows(str(data / "t.csv"), "prompt")  # CSV: a path, or a JSON list of paths, per cell
    assert report.is_clean and got[0]["images"] == [want[0]] and got[1]["images"] == want[1]
    index, _ = index_rows(str(data / "t.parquet"), "prompt")  # read back on demand: the same light references
    assert _strip(index) == _strip(load_rows(str(data / "t.parquet"), "prompt")[0])


def test_parquet_image_structs_and_bytes_columns(tmp_path: Path) -> None:
    png(tmp_path / "a.png")
    rows = [{"prompt": "<image>x", "images": [{"bytes": png_bytes(), "path": "ignored.png"}]},
            {"prompt": "<image>y", "images": [{"bytes": None, "path": "a.png"}]},
            {"prompt": "<image>z", "image": png_bytes((4, 4))}]  # TRL's single `image` column, raw bytes
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "s.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "b.parquet")
    got, report = load_rows([str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet")], "prompt")
    assert report.is_clean
    assert isinstance(got[0]["images"][0], bytes) and got[1]["images"] == [str(tmp_path / "a.png")]
    assert [im.size for r in got for im in load_images(r)] == [(8, 8), (8, 8), (4, 4)]


def test_a_save_to_disk_folder_with_image_structs(tmp_path: Path) -> None:
    rows = [{"prompt": "<image>what?", "images": [{"bytes": png_bytes(), "path": None}], "answer": "green"}
            for _ in range(5)]
    rows[3]["images"] = [{"bytes": b"not a png", "path": None}]
    folder = save_to_disk(tmp_path / "ds", rows, num_shards=2)
    with pytest.raises(DataError) as err:
        index_rows(folder, "prompt")
    assert f"{folder / 'data-00001-of-00002.arrow'} row 1: images[0] (bytes): the bytes is not a readable image" \
        in str(err.value)
    index, report = index_rows(folder, "prompt", on_bad_row="skip")
    assert len(index) == 4 and report.reasons["bad_image: images"].count == 1
    assert load_images(index[0])[0].getpixel((0, 0)) == (10, 200, 10)


def test_the_real_datasets_image_feature_is_read_undecoded(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    png(tmp_path / "a.png")
    features = datasets.Features({"images": datasets.List(datasets.Image()), "prompt": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"images": [[Image.new("RGB", (6, 6), (1, 2, 3))], [str(tmp_path / "a.png")]],
                                     "prompt": ["<image>a", "<image>b"]}, features=features)
    ds.save_to_disk(str(tmp_path / "saved"))
    for rows in (index_rows(str(tmp_path / "saved"), "prompt")[0], index_dataset(ds, "prompt")[0]):
        refs = [r["images"][0] for r in rows]
        assert isinstance(refs[0], bytes)  # stored bytes, not a decoded PIL image held by the row
        assert [im.size for r in rows for im in load_images(r)] == [(6, 6), (8, 8)]
    # a path-only Image value whose file is gone is a bad row, not an exception from `datasets`
    gone = datasets.Dataset.from_dict({"images": [[str(tmp_path / "a.png")]], "prompt": ["<image>c"]},
                                      features=datasets.Features({"images": datasets.List(datasets.Image(decode=True)),
                                                                  "prompt": datasets.Value("string")}))
    gone = gone.cast_column("images", datasets.List(datasets.Image(decode=False)))  # keep the path, not the bytes
    (tmp_path / "a.png").unlink()
    gone = gone.cast_column("images", datasets.List(datasets.Image()))
    with pytest.raises(DataError, match=r"dataset\[0\]: images\[0\]: .*a\.png does not exist"):
        index_dataset(gone, "prompt")


def test_in_memory_pil_rows_and_chat_content_parts(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
             "images": [Image.new("L", (5, 5), 7)], "answer": "grey"},
            {"prompt": [{"role": "user", "content": "Colour?"}], "images": [Image.new("RGBA", (3, 3))]}]
    index, report = index_dataset(rows, "prompt")
    assert report.is_clean
    got = list(index)
    assert got[0]["prompt"][1] == {"role": "user", "content": "<image>Colour?"}
    assert got[1]["prompt"][0]["content"] == "<image>Colour?"  # no placeholder: at the start of the first user turn
    ims = [load_images(r)[0] for r in got]
    assert [(im.mode, im.size) for im in ims] == [("RGB", (5, 5)), ("RGB", (3, 3))]
    assert ims[0] is not rows[0]["images"][0]  # a converted copy: the caller's image is not changed
    parts = to_content_parts(got[0]["prompt"])
    assert parts[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    assert parts[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert split_placeholders("a<image>b<image>") == [{"type": "text", "text": "a"}, {"type": "image"},
                                                      {"type": "text", "text": "b"}, {"type": "image"}]


def test_sft_and_preference_rows_carry_images(tmp_path: Path) -> None:
    png(tmp_path / "a.png")
    sft = [{"messages": [{"role": "user", "content": "Describe"}, {"role": "assistant", "content": "Red."}],
            "images": ["a.png"]},
           {"input": "<image>Describe", "output": "Red.", "images": ["a.png"]}]
    pref = [{"prompt": "Describe", "chosen": "Red.", "rejected": "Blue.", "images": ["a.png"]},
            {"prompt": "<image>Describe", "chosen": "A <image> tag.", "rejected": "Red.", "images": ["a.png"]}]
    got, _ = load_rows(str(jsonl(tmp_path / "s.jsonl", sft)), "sft")
    assert got[0]["messages"][0]["content"] == "<image>Describe" and got[1]["images"] == [str(tmp_path / "a.png")]
    got, report = load_rows(str(jsonl(tmp_path / "p.jsonl", pref)), "preference", on_bad_row="skip")
    assert got[0]["prompt"] == "<image>Describe" and report.kept_rows == 1
    assert "'chosen' has 1 <image> placeholder(s) in a response" in report.reasons["image_count: images"].examples[0][
        "detail"]


def test_data_fields_names_the_image_column_and_verl_image_key_translates(tmp_path: Path) -> None:
    from verl.compat.command import translate

    png(tmp_path / "a.png")
    path = jsonl(tmp_path / "t.jsonl", [{"question": "<image>?", "pics": ["a.png"], "images": "not mine"}])
    got, _ = load_rows(str(path), "prompt", fields={"images": "pics"})
    assert got[0]["images"] == [str(tmp_path / "a.png")] and got[0]["metadata"] == {"images": "not mine"}
    ours = translate(["data.image_key=pics", "data.train_files=t.jsonl"]).ours
    assert "data.fields.images=pics" in ours


def test_normalize_writes_paths_and_data_uris_that_read_back_the_same(tmp_path: Path) -> None:
    png(tmp_path / "a.png")
    rows = [{"prompt": "<image>x", "images": ["a.png"]}, {"prompt": "y"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>z", "images": [png_bytes()]}]), tmp_path / "b.parquet")
    jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out" / "clean.jsonl"
    report = normalize_files([str(tmp_path / "t.jsonl"), str(tmp_path / "b.parquet")], out, "prompt")
    assert report.is_clean
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[0]["images"] == [str(tmp_path / "a.png")] and "images" not in written[1]
    assert written[2]["images"][0].startswith("data:image/png;base64,")
    again = tmp_path / "again.jsonl"
    normalize_files(str(out), again, "prompt")
    assert again.read_text() == out.read_text()
    assert load_images(load_rows(str(again), "prompt")[0][2])[0].getpixel((1, 1)) == (10, 200, 10)


# ------------------------------------------------------------------ the hostile corpus


def test_every_bad_image_row_is_named_with_its_line_and_reason(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    png(data / "good.png")
    noisy = io.BytesIO()
    Image.effect_noise((32, 32), 64).convert("RGB").save(noisy, "PNG")
    (data / "truncated.png").write_bytes(noisy.getvalue()[: len(noisy.getvalue()) * 2 // 3])
    (data / "text.png").write_text("this is not an image\n")
    (data / "empty.png").write_bytes(b"")
    (data / "bomb.png").write_bytes(declared_png(100_000, 100_000))
    (data / "big.png").write_bytes(declared_png(10_000, 10_000))  # over the limit, under PIL's hard error
    (data / "folder.png").mkdir()
    rows = [
        {"prompt": "<image>good", "images": ["good.png"]},                       # 1
        {"prompt": "<image>x", "images": ["missing.png"]},                       # 2
        {"prompt": "<image>x", "images": ["truncated.png"]},                     # 3
        {"prompt": "<image>x", "images": ["text.png"]},                          # 4
        {"prompt": "<image>x", "images": ["empty.png"]},                         # 5
        {"prompt": "<image>x", "images": ["bomb.png"]},                          # 6
        {"prompt": "<image>x", "images": ["big.png"]},                           # 7
        {"prompt": "<image><image>x", "images": ["good.png"]},                   # 8
        {"prompt": "<image>x", "images": [7]},                                   # 9
        {"prompt": "<image>x", "images": [["good.png"]]},                        # 10
        {"prompt": "<image>x", "images": ["../../../etc/passwd.png"]},           # 11
        {"prompt": "<image>x", "images": ["folder.png"]},                        # 12
        {"prompt": "x", "images": ["good.png"]},                                 # 13 (good: placed first)
        {"prompt": "<image>x", "images": []},                                    # 14
        {"prompt": "<image>x", "images": ["https://example.com/a.png"]},         # 15
        {"prompt": "<image>x", "images": [{"bytes": None, "path": None}]},       # 16
        {"prompt": "<image>x", "images": ["data:image/png;base64,@@@"]},         # 17
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]},  # 18
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": "good.png"}]}],
         "images": ["good.png"]},                                                # 19
        {"prompt": [{"role": "user", "content": [{"type": "video"}]}], "images": []},  # 20
        {"prompt": "<image>x", "images": [{"bytes": [1, 2], "path": None}]},     # 21
    ]
    path = jsonl(data / "t.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_rows(str(path), "prompt")
    text = str(err.value)
    assert "19 of 21 rows are bad" in text
    assert f"t.jsonl:2: images[0]: {data / 'missing.png'} does not exist" in text
    got, report = load_rows(str(path), "prompt", on_bad_row="skip")
    assert [r["line"] for r in got] == [1, 13] and got[1]["prompt"] == "<image>x"
    lines = {k: sorted(e["line"] for e in v.examples) for k, v in report.reasons.items()}
    assert lines == {
        "image_missing: images": [2, 11],
        "bad_image: images": [3, 4, 5, 15, 17],
        "image_too_large: images": [6, 7],
        "image_count: images": [8, 14, 18],
        "wrong_type: images": [9, 10, 16, 21],
        "image_not_a_file: images": [12],
        "bad_messages: prompt": [19, 20],
    }
    details = {e["line"]: e["detail"] for v in report.reasons.values() for e in v.examples}
    assert str(Path(os.path.normpath(data / "../../../etc/passwd.png"))) in details[11]  # the resolved path
    assert "corrupt" in details[3] and "zero bytes" in details[5] and "is a directory" in details[12]
    assert "100000x100000" in details[6] or "decompression" in details[6].lower()
    assert "10000x10000 pixels" in details[7]
    assert "2 <image> placeholder(s) but 1 image(s)" in details[8] and "is int 7" in details[9]
    assert "is list" in details[10] and "URL" in details[15] and "'image'" in details[19]
    for key in lines:
        assert report.reasons[key].hint, key


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.png")
    _, report = load_rows(str(jsonl(tmp_path / "t.jsonl", [{"prompt": "<image>x", "images": ["pipe.png"]},
                                                           {"prompt": "ok"}])), "prompt", on_bad_row="skip")
    assert "not a regular file" in report.reasons["image_not_a_file: images"].examples[0]["detail"]


def test_an_image_broken_after_the_check_fails_its_batch_with_the_row(tmp_path: Path) -> None:
    png(tmp_path / "a.png", size=(16, 16))
    rows = [{"prompt": "ok"}, {"prompt": "<image>", "images": "a.png"}]
    index, _ = index_rows(str(jsonl(tmp_path / "t.jsonl", rows)), "prompt")
    (tmp_path / "a.png").unlink()
    with pytest.raises(DataError, match=r"t\.jsonl:2: images\[0\]: .*a\.png does not exist"):
        load_images(index[1])
    assert load_images(index[0]) == []


def test_rows_without_an_images_key_keep_image_text_as_text(tmp_path: Path) -> None:
    # an SVG question mentions <image>; with no images field nothing is interpreted
    got, report = load_rows(str(jsonl(tmp_path / "t.jsonl", [{"prompt": "What does the <image> element do in SVG?"}])),
                            "prompt")
    assert report.is_clean and "images" not in got[0] and PLACEHOLDER in got[0]["prompt"]


def test_the_normaliser_alone_checks_headers_unless_told_not_to(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_text("nope")
    row = {"prompt": "<image>x", "images": [str(tmp_path / "bad.png")]}
    with pytest.raises(RowError) as err:
        RowNormalizer("prompt").normalize(row)
    assert err.value.code == "bad_image"
    canonical, _ = RowNormalizer("prompt", check_images=False).normalize(row)  # rows read back during training
    assert canonical["images"] == [str(tmp_path / "bad.png")]


def test_without_pillow_a_row_with_images_asks_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    png(tmp_path / "a.png")
    path = jsonl(tmp_path / "t.jsonl", [{"prompt": "<image>x", "images": ["a.png"]}])
    for name in [m for m in sys.modules if m == "PIL" or m.startswith("PIL.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` now raises ImportError
    with pytest.raises(VerlError, match=r"Pillow.*\[vision\]"):
        load_rows(str(path), "prompt")
    got, _ = load_rows(str(jsonl(tmp_path / "text.jsonl", [{"prompt": "no images"}])), "prompt")
    assert got[0]["prompt"] == "no images"  # text rows never need it


def test_importing_verl_does_not_import_pil() -> None:
    code = ("import sys, verl, verl.data, verl.data.images, verl.data.load, verl.data.index; "
            "from verl.data import load_rows; assert 'PIL' not in sys.modules, 'PIL imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_data_uri_images(tmp_path: Path) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png_bytes((2, 3))).decode()
    got, _ = load_rows(str(jsonl(tmp_path / "t.jsonl", [{"prompt": "<image>", "images": uri}])), "prompt")
    assert load_images(got[0])[0].size == (2, 3)


def test_mutated_images_of_every_format_are_kept_or_reported_never_raised(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    blobs = []
    for fmt in ("PNG", "GIF", "BMP", "JPEG", "WEBP", "TIFF"):
        buf = io.BytesIO()
        Image.effect_noise((12, 12), 50).convert("RGB").save(buf, fmt)
        blobs.append(buf.getvalue())
    rows = []
    for _ in range(300):
        data = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            op = rng.random()
            at = rng.randrange(len(data))
            if op < 0.5:
                data[at] = rng.randrange(256)
            elif op < 0.8:
                del data[at:]
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 16))
        rows.append({"prompt": "<image>?", "images": [bytes(data) or b"x"]})
    index, report = index_dataset(rows, "prompt", on_bad_row="skip")
    assert report.total_rows == 300 and report.kept_rows == len(index)
    assert set(report.reasons) <= {"bad_image: images", "image_too_large: images"}
    for row in index:  # a kept row decodes, or fails with its row named
        try:
            assert load_images(row)[0].mode == "RGB"
        except DataError as e:
            assert str(e).startswith(f"dataset[{row['line']}]: images[0] (bytes)")
