"""Field resolution and row validation: source keys -> canonical fields, or a reason the row is bad.

Datasets name their fields every which way (`question`/`answer`, `"input "` from a spreadsheet, a
zero-width space pasted from a web page). Keys are compared after stripping whitespace, zero-width
characters and BOMs, case-insensitively, against a small table of aliases; an explicit mapping wins.
The plan for a given set of keys is cached, because almost every row of a file has the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from verl.data import images
from verl.data.report import RowError
from verl.errors import ConfigError

KINDS = ("prompt", "sft", "preference")

_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)


def normalize_key(key: Any) -> str:
    """The form keys are compared in: no whitespace at the ends, no zero-width characters, casefolded."""
    return str(key).translate(_INVISIBLE).strip().casefold()


def clean_key(key: str) -> str:
    """A key with invisible characters and surrounding whitespace removed (case kept), for metadata."""
    return key.translate(_INVISIBLE).strip()


@dataclass(frozen=True)
class KindSpec:
    """Canonical fields of a dataset kind, which are required, and their aliases (in match order)."""

    fields: tuple[str, ...]
    required: tuple[str, ...]
    aliases: dict[str, tuple[str, ...]]
    # Nested paths tried only when no top-level key matches (verl's parquet convention).
    fallbacks: dict[str, tuple[str, ...]]
    # Fields that may hold chat messages as well as a string.
    messages_ok: tuple[str, ...]


# A row's images (verl.data.images): verl's default data.image_key, and TRL's single-image column.
_IMAGE_ALIASES = ("images", "image")

SPECS: dict[str, KindSpec] = {
    "prompt": KindSpec(
        fields=("prompt", "ground_truth", "data_source", "images"),
        required=("prompt",),
        aliases={
            "prompt": ("prompt", "input", "question", "query", "instruction"),
            "ground_truth": ("ground_truth", "answer", "label", "solution", "reference"),
            "data_source": ("data_source",),
            "images": _IMAGE_ALIASES,
        },
        fallbacks={"ground_truth": ("reward_model.ground_truth",)},
        messages_ok=("prompt",),
    ),
    "sft": KindSpec(
        fields=("input", "output", "messages", "images"),
        required=("input", "output"),  # unless `messages` is present
        aliases={
            "input": ("input", "prompt", "question", "query", "instruction"),
            "output": ("output", "response", "answer", "completion", "target"),
            "messages": ("messages",),
            "images": _IMAGE_ALIASES,
        },
        fallbacks={},
        messages_ok=("input", "output", "messages"),
    ),
    "preference": KindSpec(
        fields=("prompt", "chosen", "rejected", "margin", "images"),
        required=("prompt", "chosen", "rejected"),
        aliases={
            "prompt": ("prompt", "input", "question", "query", "instruction"),
            "chosen": ("chosen", "preferred", "accepted"),
            "rejected": ("rejected", "dispreferred"),
            "margin": ("margin",),  # read by the reward-model trainer (TRL's RewardTrainer convention)
            "images": _IMAGE_ALIASES,
        },
        fallbacks={},
        messages_ok=("prompt", "chosen", "rejected"),
    ),
}

# Names a user may write on the left of data.fields.<name>= that mean another canonical field.
_FIELD_SYNONYMS = {
    "prompt": {"input": "prompt"},
    "preference": {"input": "prompt"},
    "sft": {"prompt": "input"},
}


def check_kind(kind: str) -> KindSpec:
    if kind not in SPECS:
        raise ConfigError(f"data.kind={kind!r} is not a dataset kind; use one of {', '.join(KINDS)}")
    return SPECS[kind]


def canonical_mapping(kind: str, fields: dict[str, str] | None) -> dict[str, str]:
    """Validate data.fields (canonical field -> source key or dotted path) for this kind."""
    spec = check_kind(kind)
    out: dict[str, str] = {}
    for name, src in (fields or {}).items():
        fld = _FIELD_SYNONYMS[kind].get(normalize_key(name), normalize_key(name))
        if fld not in spec.fields:
            raise ConfigError(
                f"data.fields.{name}: {name!r} is not a field of kind {kind!r}; its fields are "
                f"{', '.join(spec.fields)}. Write data.fields.<field>=<your key>"
            )
        if not isinstance(src, str) or not src.strip():
            raise ConfigError(
                f"data.fields.{name}={src!r}: the source must be a non-empty key or dotted path"
            )
        if fld in out:
            raise ConfigError(f"data.fields maps {fld!r} twice ({out[fld]!r} and {src!r}); keep one")
        out[fld] = src.strip()
    return out


def _find_key(obj: dict[str, Any], name: str) -> list[str]:
    """Keys of obj equal to name exactly, else equal after normalisation."""
    if name in obj:
        return [name]
    n = normalize_key(name)
    return [k for k in obj if isinstance(k, str) and normalize_key(k) == n]


def _get_path(obj: dict[str, Any], src: str, fld: str) -> tuple[bool, Any, str, str]:
    """Resolve a mapped key or dotted path: (found, value, top-level key used, display name)."""
    keys = _find_key(obj, src)
    if len(keys) > 1:
        raise RowError(
            "duplicate_field", fld, f"keys {keys[0]!r} and {keys[1]!r} both match data.fields.{fld}={src!r}"
        )
    if keys:
        return True, obj[keys[0]], keys[0], keys[0]
    if "." not in src:
        return False, None, "", src
    parts = src.split(".")
    cur: Any = obj
    top = ""
    for i, part in enumerate(parts):
        if not isinstance(cur, dict):
            return False, None, top, src
        keys = _find_key(cur, part)
        if len(keys) > 1:
            raise RowError(
                "duplicate_field", fld, f"keys {keys[0]!r} and {keys[1]!r} both match {part!r} in {src!r}"
            )
        if not keys:
            return False, None, top, src
        if i == 0:
            top = keys[0]
        cur = cur[keys[0]]
    return True, cur, top, src


class RowNormalizer:
    """Turns a parsed object into a canonical row for one kind, or raises RowError with the reason."""

    def __init__(self, kind: str, fields: dict[str, str] | None = None, *, check_images: bool = True) -> None:
        self.kind = kind
        # Open each image's header (start-up); rows read again during training skip it (load_images decodes).
        self.check_images = check_images
        self.spec = check_kind(kind)
        self.mapping = canonical_mapping(kind, fields)
        self._alias_of: dict[str, str] = {}
        for fld, names in self.spec.aliases.items():
            if fld in self.mapping:
                continue  # an explicit mapping replaces the aliases of that field
            for a in names:
                self._alias_of[a] = fld
        self._plans: dict[tuple[str, ...], dict[str, list[str]]] = {}

    def _plan(self, obj: dict[str, Any]) -> dict[str, list[str]]:
        """Top-level keys matching each unmapped field by alias (cached per key set)."""
        sig = tuple(obj)
        plan = self._plans.get(sig)
        if plan is None:
            plan = {}
            for k in obj:
                fld = self._alias_of.get(normalize_key(k)) if isinstance(k, str) else None
                if fld is not None:
                    plan.setdefault(fld, []).append(k)
            if len(self._plans) < 4096:
                self._plans[sig] = plan
        return plan

    def normalize(self, obj: dict[str, Any], base: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """(canonical row, {field: source key}) or RowError. `base` is the folder relative image paths are
        resolved against (the data file's; None: the working directory)."""
        found: dict[str, Any] = {}
        sources: dict[str, str] = {}
        used: set[str] = set()
        for fld, src in self.mapping.items():
            ok, value, top, shown = _get_path(obj, src, fld)
            if ok:
                found[fld], sources[fld] = value, shown
                if top == shown:  # a direct key; a nested path leaves its container in metadata
                    used.add(top)
            elif fld in self.spec.required and not (
                self.kind == "sft" and fld != "messages" and self._has_messages(obj)
            ):
                raise RowError("missing", fld, f"data.fields.{fld}={src!r} but the row has no key {src!r}")
        plan = self._plan(obj)
        for fld, keys in plan.items():
            keys = [k for k in keys if k not in used]
            if len(keys) > 1:
                raise RowError("duplicate_field", fld, f"keys {keys[0]!r} and {keys[1]!r} both mean {fld!r}")
            if keys:
                found[fld], sources[fld] = obj[keys[0]], keys[0]
                used.add(keys[0])
        for fld, paths in self.spec.fallbacks.items():
            if fld in found or fld in self.mapping:
                continue
            for p in paths:
                ok, value, top, shown = _get_path(obj, p, fld)
                if ok:
                    found[fld], sources[fld] = value, shown
                    break
        row = getattr(self, f"_row_{self.kind}")(found, obj, used)
        if "images" in found:
            refs = images.image_refs(found["images"], base)
            images.place(row, self.kind, refs)
            if refs and self.check_images:
                images.check_images(refs)
        elif any(images.has_image_parts(found.get(f)) for f in ("prompt", "input", "messages")):
            raise RowError("image_count", "images", "the messages have {'type': 'image'} parts but the row has no "
                           "'images' (data.fields.images names another key)")
        return row, sources

    def _has_messages(self, obj: dict[str, Any]) -> bool:
        src = self.mapping.get("messages", "messages")
        return bool(_find_key(obj, src))

    # --- per kind -------------------------------------------------------------------------------

    def _row_prompt(self, found: dict[str, Any], obj: dict[str, Any], used: set[str]) -> dict[str, Any]:
        row: dict[str, Any] = {"prompt": _text_or_messages(found, "prompt", required=True)}
        gt = found.get("ground_truth")
        if isinstance(gt, (int, float)) and not isinstance(gt, bool):
            gt = str(gt)  # numeric answers (GSM8K-style) are compared as text by the scorers
        row["ground_truth"] = (
            _optional_text({"ground_truth": gt}, "ground_truth") if "ground_truth" in found else None
        )
        row["data_source"] = _optional_text(found, "data_source") if "data_source" in found else None
        meta: dict[str, Any] = {}
        for k, v in obj.items():
            if k in used:
                continue
            if isinstance(k, str) and normalize_key(k) == "metadata" and isinstance(v, dict):
                meta.update(v)  # our own canonical output, read back
                continue
            ck = clean_key(k) if isinstance(k, str) else str(k)
            meta[ck if ck not in meta else k] = v
        row["metadata"] = meta
        return row

    def _row_sft(self, found: dict[str, Any], obj: dict[str, Any], used: set[str]) -> dict[str, Any]:
        if found.get("messages") is not None or ("messages" in found and "input" not in found):
            msgs = _messages(found.get("messages"), "messages")
            if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
                raise RowError(
                    "no_assistant_turn", "messages", "the conversation has no non-empty assistant message"
                )
            return {"messages": msgs}
        return {
            "input": _text_or_messages(found, "input", required=True),
            "output": _text_or_messages(found, "output", required=True),
        }

    def _row_preference(self, found: dict[str, Any], obj: dict[str, Any], used: set[str]) -> dict[str, Any]:
        row = {f: _text_or_messages(found, f, required=True) for f in ("prompt", "chosen", "rejected")}
        if row["chosen"] == row["rejected"]:  # DPO and a reward model both learn nothing from it
            raise RowError("same_answer", "rejected", "'chosen' and 'rejected' are the same answer, so the pair "
                           "prefers neither")
        if found.get("margin") is not None:
            row["margin"] = _margin(found["margin"])
        return row


def _margin(v: Any) -> float:
    """A pair's margin as a float: a number, or a numeric string (CSV cells are strings)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise RowError("bad_margin", "margin", f"'margin' is {_describe(v)}; expected a number")
    try:
        value = float(v)
    except ValueError:
        raise RowError("bad_margin", "margin", f"'margin' is {_describe(v)}; expected a number") from None
    if not math.isfinite(value):
        raise RowError("bad_margin", "margin", f"'margin' is {value}; expected a finite number")
    return value


def _describe(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r[:40] + '...' if len(r) > 40 else r}"


def _check_str(v: str, fld: str) -> str:
    if not v.strip():
        raise RowError("empty", fld, f"{fld!r} is {'empty' if not v else 'whitespace only'}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(
            "invalid_unicode", fld, f"{fld!r} has an unpaired surrogate at character {e.start}"
        ) from None
    return v


def _optional_text(found: dict[str, Any], fld: str) -> str | None:
    v = found[fld]
    if v is None:
        return None
    if not isinstance(v, str):
        raise RowError("wrong_type", fld, f"{fld!r} is {_describe(v)}; expected a string")
    return _check_str(v, fld)


def _text_or_messages(found: dict[str, Any], fld: str, required: bool) -> Any:
    if fld not in found:
        raise RowError("missing", fld, f"no key for {fld!r} (looked for {', '.join(_alias_list(fld))})")
    v = found[fld]
    if v is None:
        raise RowError("null", fld, f"{fld!r} is null")
    if isinstance(v, str):
        return _check_str(v, fld)
    if isinstance(v, list):
        return _messages(v, fld)
    raise RowError("wrong_type", fld, f"{fld!r} is {_describe(v)}; expected a string or chat messages")


def _alias_list(fld: str) -> list[str]:
    out: list[str] = []
    for spec in SPECS.values():
        for a in spec.aliases.get(fld, ()):
            if a not in out:
                out.append(a)
    return out or [fld]


def _messages(v: Any, fld: str) -> list[dict[str, str]]:
    if v is None:
        raise RowError("null", fld, f"{fld!r} is null")
    if not isinstance(v, list) or not v:
        raise RowError(
            "bad_messages", fld, f"{fld!r} is {_describe(v)}; expected a non-empty list of messages"
        )
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise RowError(
                "bad_messages", fld, f"{fld}[{i}] is {_describe(m)}; expected {{'role': ..., 'content': ...}}"
            )
        role = content = None
        for k, x in m.items():
            nk = normalize_key(k)
            if nk == "role":
                role = x
            elif nk == "content":
                content = x
        if not isinstance(role, str) or not role.strip():
            raise RowError("bad_messages", fld, f"{fld}[{i}] has no string 'role'")
        if isinstance(content, list):
            content = images.parts_text(content, fld, i)
        if not isinstance(content, str):
            raise RowError(
                "bad_messages", fld, f"{fld}[{i}] 'content' is {_describe(content)}; expected a string (or "
                "content parts)"
            )
        role = role.strip().lower()
        if role in ("user", "assistant") and not content.strip():
            raise RowError("empty", fld, f"{fld}[{i}] ({role}) has empty content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise RowError("invalid_unicode", fld, f"{fld}[{i}] content has an unpaired surrogate") from None
        out.append({"role": role, "content": content})
    return out


__all__ = ["KINDS", "SPECS", "KindSpec", "RowNormalizer", "RowError", "normalize_key", "canonical_mapping"]
