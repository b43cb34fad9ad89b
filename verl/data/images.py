"""Images in rows: what a row's `images` may hold, the `<image>` placeholder rule, header checks, decoding.

A row carries its images in `images` (alias `image`, or `data.fields.images`; verl's `data.image_key`): one
value or a list (a JSON list in a CSV cell), each a file path (relative to the data file's folder), encoded
bytes, a `data:image/...;base64,` URI, a Hugging Face `Image` value (`{"bytes": ..., "path": ...}`) or a PIL
image. The normalised row keeps a
light reference per image -- an absolute path (`str`), the encoded bytes, or the caller's PIL image -- and
`load_images` decodes them to RGB when a batch is built, so the rows of a large dataset never hold pixels.

The prompt marks where each image goes with `<image>`, one per image, in order (verl's and LLaVA's convention);
a chat content given as parts (`[{"type": "image"}, {"type": "text", "text": ...}]`, Hugging Face's form) is
normalised to the same text with `<image>` for each image part, and `to_content_parts` turns it back for a
processor's chat template. A row with images and no placeholder at all gets them at the start of its first
user turn (TRL's rule); any other count that differs from the number of images is a bad row.

Start-up checks open each image's header only (format, size, PNG chunk checksums via `verify()`), never the
pixels. Pillow is imported only here, and only when a row has images, so `import verl` never imports it.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import stat
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from verl.data.report import RowError, location
from verl.errors import DataError, install_hint
from verl.utils.placeholders import IMAGE_PLACEHOLDER as PLACEHOLDER
from verl.utils.placeholders import split_placeholders

FIELD = "images"
# Decompression-bomb guard: an image whose header declares more pixels than this is a bad row (PIL's own
# default limit, which PIL applies only as a warning up to twice the figure); a lower PIL.Image.MAX_IMAGE_PIXELS wins.
MAX_PIXELS = 89_478_485
INSTALL_HINT = install_hint("pillow", "vision")
_DATA_URI = "data:"
_URL_PREFIXES = ("http://", "https://", "s3://", "gs://", "hf://")

ImageRef = Any  # str (an absolute path) | bytes (an encoded image) | PIL.Image.Image


def _pil() -> Any:
    """PIL.Image, or a DataError with the install hint: only rows with images need it."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"the data has images, which need Pillow to read: {INSTALL_HINT}") from None
    return Image


def _row_error(code: str, detail: str, field: str | None = FIELD) -> RowError:
    return RowError(code, field, detail)


def _describe(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r[:40] + '...' if len(r) > 40 else r}"


def is_pil(v: Any) -> bool:
    """A PIL image, recognised without importing PIL (a PIL image exists only where PIL is imported)."""
    return type(v).__module__.startswith("PIL.") and hasattr(v, "size") and hasattr(v, "convert")


# ------------------------------------------------------------------ the images field


def image_refs(value: Any, base: str | None = None) -> list[ImageRef]:
    """The row's images as light references, or RowError (`wrong_type`, `bad_image`): a single value is a list
    of one, null or [] is no image; relative paths resolve against `base` (the data file's folder, else the
    working directory) so the reference stays right whichever directory later reads it."""
    if value is None:
        return []
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        try:  # a CSV cell (or any string column) holding a JSON list of paths
            value = json.loads(value)
        except ValueError:
            pass
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_ref(item, i, base) for i, item in enumerate(items)]


def _ref(item: Any, i: int, base: str | None) -> ImageRef:
    where = f"images[{i}]"
    if isinstance(item, Mapping):  # a Hugging Face Image value: the bytes win, else the path
        keys = {str(k).strip().lower(): v for k, v in item.items()}
        if not keys.keys() & {"bytes", "path"} or keys.keys() - {"bytes", "path"}:
            raise _row_error("wrong_type", f"{where} is {_describe(item)}; an image dict holds 'bytes' and/or "
                                           "'path' (the Hugging Face Image form)")
        if keys.get("bytes") is not None:
            return _ref(keys["bytes"], i, base)
        if keys.get("path") is None:
            raise _row_error("wrong_type", f"{where} has neither bytes nor a path")
        return _ref(keys["path"], i, base)
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        if not data:
            raise _row_error("bad_image", f"{where} is empty bytes (zero length), not an image")
        return data
    if isinstance(item, str):
        return _path_or_uri(item, where, base)
    if isinstance(item, os.PathLike):
        return _path_or_uri(os.fspath(item), where, base)
    if is_pil(item):
        return item
    raise _row_error("wrong_type", f"{where} is {_describe(item)}; an image is a file path, bytes, a "
                                   "{'bytes': ..., 'path': ...} dict or a PIL image (one per <image> placeholder)")


def _path_or_uri(s: str, where: str, base: str | None) -> ImageRef:
    text = s.strip()
    if not text:
        raise _row_error("wrong_type", f"{where} is an empty string; give the image's file path")
    if text[:5].lower() == _DATA_URI:
        head, sep, payload = text.partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise _row_error("bad_image", f"{where} is a data URI that is not base64 ({head[:40]!r}); write "
                                          "data:image/png;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _row_error("bad_image", f"{where}: the data URI's base64 payload is invalid") from None
        if not data:
            raise _row_error("bad_image", f"{where}: the data URI is empty")
        return data
    if text.lower().startswith(_URL_PREFIXES):
        raise _row_error("bad_image", f"{where} is a URL ({text[:60]!r}); images are not downloaded: fetch them "
                                      "and give file paths (or bytes)")
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(text)))


# ------------------------------------------------------------------ placeholders


def count(text: str) -> int:
    return text.count(PLACEHOLDER)


def parts_text(parts: list[Any], fld: str, i: int) -> str:
    """A chat content given as parts, as text: each `{"type": "image"}` becomes `<image>`, text parts are
    joined as they are (a chat template renders parts one after another). RowError (`bad_messages`) otherwise."""
    out = []
    for j, part in enumerate(parts):
        where = f"{fld}[{i}].content[{j}]"
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            raise _row_error("bad_messages", f"{where} is {_describe(part)}; expected {{'type': 'text', 'text': "
                                             "...} or {'type': 'image'}", fld)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _row_error("bad_messages", f"{where} is a text part whose 'text' is {_describe(text)}", fld)
            out.append(text)
        elif kind == "image":
            inline = [k for k in ("image", "url", "path", "image_url") if part.get(k) is not None]
            if inline:
                raise _row_error("bad_messages", f"{where} carries the image inline ({inline[0]!r}); list the image "
                                                 "in the row's 'images' and leave {'type': 'image'} in its place", fld)
            out.append(PLACEHOLDER)
        else:
            raise _row_error("bad_messages", f"{where} has type {kind!r}; content parts are 'text' or 'image'", fld)
    return "".join(out)


def has_image_parts(value: Any) -> bool:
    """Whether raw chat messages hold a `{"type": "image"}` part (a row that needs images)."""
    if not isinstance(value, list):
        return False
    for m in value:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == "image" for p in content):
            return True
    return False


# Per kind: the fields whose text may hold placeholders (the model's input), and the response fields that may not.
_INPUT_FIELDS = {"prompt": ("prompt",), "preference": ("prompt",), "sft": ("input", "messages")}
_RESPONSE_FIELDS = {"prompt": (), "preference": ("chosen", "rejected"), "sft": ("output",)}


def _texts(value: Any, responses: bool) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):  # normalised messages; assistant turns are responses
        return [m["content"] for m in value if (m["role"] == "assistant") == responses]
    return []


def place(row: dict[str, Any], kind: str, refs: list[ImageRef]) -> None:
    """Check the placeholders against the images (RowError `image_count`) and store `row['images']`.

    No placeholder with N images: N placeholders go at the start of the first user turn (or the string prompt).
    A placeholder in a response (an assistant turn, `output`, `chosen`, `rejected`) is refused: images are input."""
    inputs = [f for f in _INPUT_FIELDS[kind] if f in row]
    n = sum(count(t) for f in inputs for t in _texts(row[f], False))
    for f in (*_RESPONSE_FIELDS[kind], *inputs):
        responses = f not in inputs or isinstance(row[f], list)
        hits = sum(count(t) for t in _texts(row.get(f), True)) if responses else 0
        if hits and refs:
            raise _row_error("image_count", f"{f!r} has {hits} {PLACEHOLDER} placeholder(s) in a response; images "
                                            "go in the prompt (user turns)")
    if n == 0 and refs:
        target = inputs[0]
        value = row[target]
        if isinstance(value, str):
            row[target] = PLACEHOLDER * len(refs) + value
        else:
            users = [m for m in value if m["role"] == "user"]
            if not users:
                raise _row_error("image_count", f"the row has {len(refs)} image(s) and no user turn to put them "
                                                f"in; add {PLACEHOLDER} where each goes")
            users[0]["content"] = PLACEHOLDER * len(refs) + users[0]["content"]
    elif n != len(refs):
        raise _row_error("image_count", f"{n} {PLACEHOLDER} placeholder(s) but {len(refs)} image(s); write one "
                                        f"{PLACEHOLDER} per image, in order (or none: then the images go before "
                                        "the first user turn)")
    row[FIELD] = refs


# ------------------------------------------------------------------ checks and decoding


def pixel_limit(max_pixels: int | None = None) -> int:
    limit = MAX_PIXELS if max_pixels is None else max_pixels
    pil_limit = getattr(_pil(), "MAX_IMAGE_PIXELS", None)
    return min(limit, int(pil_limit)) if pil_limit else limit


def _source(ref: ImageRef, where: str) -> Any:
    """What `Image.open` reads: the bytes in a buffer, or the path after checking it is a regular file."""
    if isinstance(ref, bytes):
        return io.BytesIO(ref)
    try:
        st = os.stat(ref)
    except FileNotFoundError:
        raise _row_error("image_missing", f"{where}: {ref} does not exist") from None
    except OSError as e:
        raise _row_error("bad_image", f"{where}: {ref} cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise _row_error("image_not_a_file", f"{where}: {ref} is a directory, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise _row_error("image_not_a_file", f"{where}: {ref} is not a regular file (a device, FIFO or socket)")
    if st.st_size == 0:
        raise _row_error("bad_image", f"{where}: {ref} is empty (zero bytes)")
    return ref


def _name(ref: ImageRef, i: int) -> str:
    return f"images[{i}]" + ("" if isinstance(ref, str) else f" ({'bytes' if isinstance(ref, bytes) else 'PIL'})")


def _open(image: Any, ref: ImageRef, where: str, limit: int) -> Any:
    """Image.open without the pixels, with the size checked against `limit` (RowError)."""
    src = _source(ref, where)
    named = f"{ref}" if isinstance(ref, str) else "the bytes"
    try:
        with warnings.catch_warnings():  # the size limit is checked just below; a corrupt file is a bad row
            warnings.simplefilter("ignore")
            im = image.open(src)
    except image.DecompressionBombError as e:
        raise _row_error("image_too_large", f"{where}: {named}: {e}") from None
    except Exception as e:  # noqa: BLE001 - hostile bytes reach each format plugin's parser, which raise anything
        raise _row_error("bad_image", f"{where}: {named} is not a readable image ({type(e).__name__}: {e})") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        im.close()
        raise _row_error("bad_image", f"{where}: {named} declares an empty size ({w}x{h})")
    if w * h > limit:
        im.close()
        raise _row_error("image_too_large", f"{where}: {named} declares {w}x{h} pixels, over the limit of {limit} "
                                            "(a decompression bomb, or an image to shrink first)")
    return im


def check_images(refs: Sequence[ImageRef], max_pixels: int | None = None) -> None:
    """Each image's header, size and (for formats that have them) chunk checksums, without decoding the pixels;
    RowError with the image's index and resolved path. Needs Pillow (DataError with the install hint)."""
    image = _pil()
    limit = pixel_limit(max_pixels)
    for i, ref in enumerate(refs):
        where = _name(ref, i)
        if is_pil(ref):
            w, h = ref.size
            if w * h > limit:
                raise _row_error("image_too_large", f"{where} is {w}x{h} pixels, over the limit of {limit}")
            continue
        im = _open(image, ref, where, limit)
        try:
            with warnings.catch_warnings():  # plugins warn about corrupt metadata; the row is reported instead
                warnings.simplefilter("ignore")
                im.verify()
        except Exception as e:  # noqa: BLE001 - each plugin raises its own kind for corrupt data
            named = f"{ref}" if isinstance(ref, str) else "the bytes"
            raise _row_error("bad_image", f"{where}: {named} is corrupt ({type(e).__name__}: {e})") from None
        finally:
            im.close()


def load_images(row: Mapping[str, Any] | Sequence[ImageRef], max_pixels: int | None = None) -> list[Any]:
    """The row's images decoded as RGB `PIL.Image.Image`s, in placeholder order ([] for a row without images).

    `row` is a normalised row (its `images`) or a list of references. What the start-up checks could not see
    (pixel data that fails to decode, a file removed since) is a DataError naming the row's file and line."""
    refs = (row.get(FIELD) or []) if isinstance(row, Mapping) else list(row)
    if not refs:
        return []
    image = _pil()
    limit = pixel_limit(max_pixels)
    out = []
    for i, ref in enumerate(refs):
        where = _name(ref, i)
        try:
            if is_pil(ref):
                im = ref
                if im.size[0] * im.size[1] > limit:
                    raise _row_error("image_too_large", f"{where} is {im.size[0]}x{im.size[1]} pixels, over {limit}")
            else:
                im = _open(image, ref, where, limit)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rgb = im.convert("RGB")  # decodes; a copy even when already RGB (the file is closed below)
            except Exception as e:  # noqa: BLE001 - decoders raise OSError, SyntaxError, ValueError, ...
                raise _row_error("bad_image", f"{where}: cannot be decoded ({type(e).__name__}: {e})") from None
            finally:
                if im is not ref:
                    im.close()
            out.append(rgb)
        except RowError as e:
            raise DataError(f"{_row_where(row)}{e.detail}; the image changed or is corrupt past its header. Fix or "
                            "remove the row and restart") from None
    return out


def image_sizes(row: Mapping[str, Any] | Sequence[ImageRef], max_pixels: int | None = None) -> list[tuple[int, int]]:
    """(width, height) of each of the row's images from its header alone (no pixels decoded): what a processor's
    resize and so its image token count depend on, read when a dataset is tokenised; DataError with the row."""
    refs = (row.get(FIELD) or []) if isinstance(row, Mapping) else list(row)
    if not refs:
        return []
    image = _pil()
    limit = pixel_limit(max_pixels)
    out = []
    for i, ref in enumerate(refs):
        try:
            if is_pil(ref):
                if min(ref.size) <= 0:
                    raise _row_error("bad_image", f"{_name(ref, i)} is an empty image ({ref.size[0]}x{ref.size[1]})")
                out.append(tuple(ref.size))
                continue
            im = _open(image, ref, _name(ref, i), limit)
            out.append(tuple(im.size))
            im.close()
        except RowError as e:
            raise DataError(f"{_row_where(row)}{e.detail}. Fix or remove the row") from None
    return out


def _row_where(row: Any) -> str:
    if isinstance(row, Mapping) and "file" in row and "line" in row:
        return f"{location(str(row['file']), int(row['line']))}: "
    return ""


def to_content_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Normalised messages (string contents with `<image>`) as Hugging Face content parts, the form a
    vision-language processor's chat template reads: `{"type": "image"}` per placeholder, text parts between."""
    return [{**m, "content": split_placeholders(m["content"])} for m in messages]


def to_json(ref: ImageRef) -> str:
    """A reference as `verl data normalize` writes it: the path, or the bytes as a base64 data URI."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, bytes):
        return f"data:{_mime(ref)};base64,{base64.b64encode(ref).decode('ascii')}"
    raise DataError("an in-memory PIL image cannot be written to JSONL; save it to a file and give its path")


def _mime(data: bytes) -> str:
    for magic, mime in ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"),
                        (b"BM", "image/bmp")):
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


__all__ = ["FIELD", "INSTALL_HINT", "MAX_PIXELS", "PLACEHOLDER", "check_images", "has_image_parts", "image_refs",
           "image_sizes", "is_pil", "load_images", "parts_text", "place", "split_placeholders", "to_content_parts",
           "to_json"]
